"""`python -m canonlm.data.preview`: decoded samples, loss-mask marks, JSONL output, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from canonlm.data.preview import main


def test_preview_prints_answers_and_loss_marks(capsys, tmp_path):
    out = tmp_path / "s.jsonl"
    assert main(["task=depo1_cpu", "n=3", "split=test", "task.N=6", f"jsonl={out}"]) == 0
    text = capsys.readouterr().out
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert r["split"] == "test" and len(r["tokens"]) == len(r["loss_mask"]) == len(r["answer_id"])
        # test split: n = N = 6 edges -> 12 names (ending in a final token e1..e8) before the first query
        names = r["text"].split(" <query_")[0].split()[1:]
        assert len(names) == 12 and all(x.split(".")[-1].startswith("e") for x in names)
    assert text.count("answer:  k=") == sum(len(set(a for a in r["answer_id"] if a >= 0)) for r in rows)
    stars = sum(line.count("*") for line in text.splitlines() if line.startswith("loss:"))
    assert stars == sum(sum(r["loss_mask"]) for r in rows)
    # never overwrites
    assert main(["task=depo1_cpu", f"jsonl={out}"]) == 2
    assert "jsonl" in capsys.readouterr().err


def test_preview_packed_windows(capsys):
    assert main(["task=depo1_cpu", "n=2", "packed=true"]) == 0
    assert capsys.readouterr().out.count("window ") == 2


@pytest.mark.parametrize(
    "args, key",
    [
        (["task=nope"], "task"),
        (["task=depo1_cpu", "n=0"], "n"),
        (["task=depo1_cpu", "split=dev"], "split"),
        (["task=depo1_cpu", "task.N=2"], "task.N"),
        (["bogus=1"], "bogus"),
        (["task=depo1_cpu", "seed=abc"], "seed"),
    ],
)
def test_preview_bad_input_one_line(args, key):
    r = subprocess.run([sys.executable, "-m", "canonlm.data.preview", *args], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and key in r.stderr and "Traceback" not in r.stderr
