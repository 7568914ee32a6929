"""Preparation at scale: several inputs, worker processes, SLURM array tasks, restart after a kill.

Oracles: the fixture corpora (tests/fixtures/corpora, real texts) re-read and cut into paragraphs by a naive loop and
tokenized directly with the ``tokenizers`` library; the split of document i recomputed with a pure-Python SplitMix64;
shards read back with numpy from the documented layout (meta.json + .bin + .idx.npy), not through the package; the
single-process output as the reference for the parallel / array / resumed outputs (byte-identical shards)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from canonlm.data.prepare import MERGE_BELOW, assign_units
from canonlm.data.prepare import main as prepare_main
from canonlm.data.seeding import stable_hash64
from test_text import read_split

CORPORA = Path(__file__).parent / "fixtures" / "corpora"
FILES = [*sorted((CORPORA / "licenses" / "text").glob("*.txt")), *sorted((CORPORA / "readmes" / "text").glob("*.md"))]
M64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15
COMMON = [
    "--text-unit",
    "paragraph",
    "--append-eos",
    "--val-fraction",
    "0.1",
    "--test-fraction",
    "0.1",
    "--shard-tokens",
    "3000",
    "--quiet",
]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    """A byte-level BPE (vocab 512, with </s>) trained on the fixture corpora."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in FILES], tr)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def paragraphs(path: Path) -> list[str]:
    """Documents of ``--text-unit paragraph``: runs of non-blank lines joined by newlines (naive loop)."""
    out, cur = [], []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line.strip():
            cur.append(line)
        elif cur:
            out.append("\n".join(cur))
            cur = []
    if cur:
        out.append("\n".join(cur))
    return out


def mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def split_u(seed: int, i: int) -> float:
    """u_i of the documented split rule, in pure Python."""
    key = mix64((mix64(stable_hash64("canonlm-text-split", seed) & M64) + i * G) & M64)
    return (key >> 11) * 2.0**-53


def read_corpus(d: Path) -> dict[int, tuple[str, list[int]]]:
    """{document index: (split, ids)} read with numpy from meta.json + shards (test_text.read_split per split)."""
    got = {}
    for split in ("train", "val", "test"):
        for i, ids in read_split(d, split)[0].items():
            assert i not in got, f"document {i} twice"
            got[i] = (split, ids.tolist())
    meta = json.loads((d / "meta.json").read_text())
    assert len(got) == sum(sh["documents"] for sp in ("train", "val", "test") for sh in meta["splits"][sp]["shards"])
    return got


def tree(d: Path) -> dict[str, bytes]:
    """Every file of a prepared directory (meta.json without its creation time)."""
    out = {}
    for f in sorted(d.rglob("*")):
        if f.is_file():
            b = f.read_bytes()
            if f.name == "meta.json":
                m = json.loads(b)
                m.pop("created")
                b = json.dumps(m, sort_keys=True).encode()
            out[str(f.relative_to(d))] = b
    return out


def run(args: list[str]) -> int:
    return prepare_main([*args, "--quiet"] if "--quiet" not in args else args)


def inputs(files=FILES) -> list[str]:
    return [a for f in files for a in ("--input", str(f))]


# ---------------------------------------------------------------------------------------------- equality
def test_workers_and_array_tasks_give_the_single_process_output(tmp_path, tok_path, capsys):
    from tokenizers import Tokenizer

    base = [*inputs(), "--tokenizer", str(tok_path), *COMMON]
    assert run([*base, "--out", str(tmp_path / "one")]) == 0
    assert run([*base, "--out", str(tmp_path / "two"), "--workers", "2"]) == 0
    # two array tasks: the first leaves its units for the second, which finalizes
    arr = tmp_path / "arr"
    assert run([*base, "--out", str(arr), "--num-tasks", "2", "--task-index", "1"]) == 0
    assert "waits for the other tasks" in capsys.readouterr().out and not (arr / "meta.json").exists()
    assert run([*base, "--out", str(arr), "--num-tasks", "2", "--task-index", "0", "--workers", "2"]) == 0
    ref = tree(tmp_path / "one")
    assert tree(tmp_path / "two") == ref and tree(arr) == ref
    assert not (arr / ".prepare").exists()
    capsys.readouterr()
    # a task started again after the end (a requeue) has nothing to do; one task without --force is refused
    assert run([*base, "--out", str(arr), "--num-tasks", "2", "--task-index", "1"]) == 0
    assert "wrote" in capsys.readouterr().out and tree(arr) == ref
    assert run([*base, "--out", str(arr)]) == 2
    assert "--force" in capsys.readouterr().err

    # the oracle: every paragraph of every file, in input order, tokenized by the library, in its hashed split
    raw = Tokenizer.from_file(str(tok_path))
    eos = raw.token_to_id("</s>")
    docs = [p for f in FILES for p in paragraphs(f)]
    got = read_corpus(tmp_path / "one")
    assert sorted(got) == list(range(len(docs)))
    for i, text in enumerate(docs):
        split, ids = got[i]
        assert ids == raw.encode(text, add_special_tokens=False).ids + [eos], i
        u = split_u(0, i)
        assert split == ("val" if u < 0.1 else "test" if u < 0.2 else "train"), (i, u)
    # a shard never holds two files' documents unless they are small tails merged at finalize: every shard but the
    # last of a split reaches the merge size, so small files do not leave many tiny shards
    meta = json.loads((tmp_path / "one" / "meta.json").read_text())
    merge = min(3000, MERGE_BELOW)
    assert meta["documents"] == len(docs) and meta["prepare"]["units"] == len(FILES)
    for split in ("train", "val", "test"):
        sh = meta["splits"][split]["shards"]
        assert [s["file"] for s in sh] == [f"{split}_{k:05d}.bin" for k in range(len(sh))]
        assert all(s["tokens"] >= merge for s in sh[:-1]), (split, [s["tokens"] for s in sh])
    # ... and the text task reads it
    from canonlm.data.tasks import build_task

    task = build_task("text", {"name": "text", "data_dir": str(tmp_path / "arr"), "context": 64})
    assert task.windows("val", [0, 1]).shape == (2, 64)


def test_tiny_corpora_fallback_over_units_and_unit_assignment(tmp_path, tok_path):
    files = []
    for n, text in enumerate(["Alpha beta gamma.", "Delta epsilon.", "Zeta eta theta iota."]):
        f = tmp_path / f"f{n}.txt"
        f.write_text(text + "\n")
        files.append(f)
    base = [*inputs(files), "--tokenizer", str(tok_path), "--val-fraction", "0.001", "--test-fraction", "0.001"]
    assert run([*base, "--out", str(tmp_path / "a")]) == 0
    assert run([*base, "--out", str(tmp_path / "b"), "--workers", "3"]) == 0
    assert tree(tmp_path / "a") == tree(tmp_path / "b")
    got = read_corpus(tmp_path / "a")
    us = sorted(range(3), key=lambda i: split_u(0, i))
    assert all(split_u(0, i) >= 0.002 for i in range(3))  # so val and test come from the fallback
    assert got[us[0]][0] == "val" and got[us[1]][0] == "test" and got[us[2]][0] == "train"
    # units go to tasks largest first, each to the least loaded task (derived by hand: 9 -> t0; 7 -> t1;
    # 5 -> t1 (load 7 < 9); 1 -> t0 (load 9 < 12))
    assert assign_units([5, 9, 1, 7], 2) == [1, 0, 0, 1]
    assert assign_units([3, 3, 3], 5) == [0, 1, 2]


# ---------------------------------------------------------------------------------------------- restart
def _big_inputs(d: Path) -> list[Path]:
    """Three inputs: a small first file, then two larger ones (the fixture texts twice, every paragraph made
    distinct) so that the run is still busy (~1 s) after the first unit is done."""
    d.mkdir()
    paras = [p for f in FILES for p in paragraphs(f)]
    out = [d / "a.txt"]
    out[0].write_text("\n\n".join(paras[:40]) + "\n")
    for n in range(2):
        f = d / f"b{n}.txt"
        f.write_text("\n\n".join(f"{k} {p}" for k in range(2) for p in paras) + "\n")
        out.append(f)
    return out


def test_killed_run_resumes_to_the_same_corpus_without_redoing_done_units(tmp_path, tok_path, capsys):
    files = _big_inputs(tmp_path / "in")
    args = [
        *inputs(files),
        "--tokenizer",
        str(tok_path),
        "--text-unit",
        "paragraph",
        "--append-eos",
        "--val-fraction",
        "0.05",
        "--test-fraction",
        "0.05",
        "--shard-tokens",
        "2000",
    ]
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "canonlm.data.prepare", *args, "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    done0 = out / ".prepare" / "done" / "u00000.json"
    t0 = time.monotonic()
    while not done0.exists() and p.poll() is None and time.monotonic() - t0 < 60:
        time.sleep(0.002)
    assert done0.exists(), p.stderr.read() if p.poll() is not None else "timeout"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stderr.close()
    assert p.returncode == -signal.SIGKILL
    done = sorted(f.name for f in (out / ".prepare" / "done").iterdir())
    assert done[0] == "u00000.json" and len(done) < 3, done  # killed mid-way
    assert not (out / "meta.json").exists()
    unit0 = {
        f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in (out / ".prepare" / "units" / "u00000").glob("*.bin")
    }
    # resume (with another worker count): unit 0 is not redone -- its whole shards are the same files (inodes),
    # renamed into the corpus
    capsys.readouterr()
    assert prepare_main([*args, "--out", str(out), "--workers", "2"]) == 0
    err = capsys.readouterr().err
    assert "3 of 3 units are this task's; 1 of them already done (kept), 2 to prepare" in err, err
    meta = json.loads((out / "meta.json").read_text())
    first = [s for s in meta["splits"]["train"]["shards"]][:2]
    assert [(out / s["file"]).stat().st_ino for s in first] == [unit0[f"train_{k:05d}.bin"][0] for k in range(2)]
    # the first is untouched; the second had the file's small tail appended at finalize
    assert (out / first[0]["file"]).stat().st_mtime_ns == unit0["train_00000.bin"][1]
    # ... and the corpus equals an uninterrupted single-process run
    assert run([*args, "--out", str(tmp_path / "ref")]) == 0
    assert tree(out) == tree(tmp_path / "ref")


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("canonlm.data.prepare: error: "), err
    return lines[0]


def test_resume_with_other_inputs_or_options_is_refused(tmp_path, tok_path, capsys, monkeypatch):
    files = [tmp_path / "x.txt", tmp_path / "y.txt"]
    files[0].write_text("one line\nanother line\nthird line\n")
    files[1].write_text("more text here\nand more\n")
    base = [*inputs(files), "--tokenizer", str(tok_path), "--val-fraction", "0.2", "--test-fraction", "0"]
    out = tmp_path / "o"
    # an unfinished preparation: task 0 of 2 (by SLURM_ARRAY_TASK_ID) did its unit only
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "4")
    assert run([*base, "--out", str(out), "--num-tasks", "2"]) == 0
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    monkeypatch.delenv("SLURM_ARRAY_TASK_MIN")
    assert sorted(f.name for f in (out / ".prepare" / "done").iterdir()) == ["u00000.json"]
    before = tree(out)
    capsys.readouterr()
    cases = [
        ([*base, "--seed", "1"], "--seed 0 there, 1 now"),
        ([*base, "--shard-tokens", "7"], "--shard-tokens"),
        ([*inputs(files[:1]), *base[4:]], "2 files there, 1 now"),
    ]
    for args, want in cases:
        assert run([*args, "--out", str(out), "--num-tasks", "2", "--task-index", "1"]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert want in line and str(out) in line and "unfinished" in line, line
    files[1].write_text("changed text\n")
    assert run([*base, "--out", str(out), "--num-tasks", "2", "--task-index", "1"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(files[1]) in line and "changed" in line, line
    assert tree(out) == before  # nothing touched
    # other refusals, one line each: --finalize too early, --force with array tasks, --num-tasks without an index,
    # an array job run as one task
    assert run(["--finalize", "--out", str(out)]) == 2
    assert "1 of 2 work units are not done" in _one_error_line(capsys.readouterr().err)
    assert run([*base, "--out", str(out), "--num-tasks", "2", "--task-index", "1", "--force"]) == 2
    assert "--force" in _one_error_line(capsys.readouterr().err)
    assert run([*base, "--out", str(tmp_path / "n"), "--num-tasks", "2"]) == 2
    assert "--task-index" in _one_error_line(capsys.readouterr().err)
    assert run([*inputs([files[0], files[0]]), *base[4:], "--out", str(tmp_path / "n")]) == 2
    assert f"input {files[0]} is given twice" in _one_error_line(capsys.readouterr().err)
    assert run([*base, "--out", str(tmp_path / "n"), "--workers", "0"]) == 2
    assert "--workers 0 is not allowed" in _one_error_line(capsys.readouterr().err)
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    assert run([*base, "--out", str(tmp_path / "n")]) == 2
    assert "--num-tasks 3" in _one_error_line(capsys.readouterr().err)
    monkeypatch.delenv("SLURM_ARRAY_TASK_COUNT")
    assert not (tmp_path / "n").exists()
    # with the changed file, --force (one task) starts over and finishes
    assert run([*base, "--out", str(out), "--force"]) == 0
    assert json.loads((out / "meta.json").read_text())["documents"] == 4


def test_finalize_after_a_finalizer_died_half_way(tmp_path, tok_path, capsys):
    """A task that died while finalizing leaves its lock and a half-appended shard (``.<name>.bin.part``): the
    other task does not finalize over the lock, ``--finalize`` completes the corpus, equal to a single-process run."""
    base = [*inputs(), "--tokenizer", str(tok_path), *COMMON]
    assert run([*base, "--out", str(tmp_path / "ref")]) == 0
    out = tmp_path / "o"
    assert run([*base, "--out", str(out), "--num-tasks", "2", "--task-index", "0"]) == 0
    work = out / ".prepare"
    (work / "finalize.lock").touch()  # the finalizer that died
    assert run([*base, "--out", str(out), "--num-tasks", "2", "--task-index", "1"]) == 0
    assert "waits for the other tasks" in capsys.readouterr().out and not (out / "meta.json").exists()
    # the dead finalizer had renamed the first unit's first train shard into place and appended part of a tail
    src = work / "units" / "u00000" / "train_00000.bin"
    size = src.stat().st_size
    part = out / ".train_00000.bin.part"
    src.rename(part)
    with open(part, "ab") as f:
        f.write(b"\x07\x00" * 123)
    assert part.stat().st_size == size + 246
    assert run(["--finalize", "--out", str(out)]) == 0
    assert tree(out) == tree(tmp_path / "ref")
    assert run(["--finalize", "--out", str(out)]) == 2  # nothing left to finalize: one line
    assert "already a complete prepared corpus" in _one_error_line(capsys.readouterr().err)
