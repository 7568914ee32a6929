"""The result tables in README.md and docs/results.md are generated from the runs committed under docs/results/
(scripts/docs_tables.py): regenerating them changes nothing, a hand edit or a changed result is caught, and
``--collect`` copies runs without their machine paths. Oracle for the tables: the fake runs' numbers, written by
hand below."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
docs_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs_tables)


def test_the_committed_docs_tables_are_up_to_date(capsys):
    blocks = [m.group("spec") for f in docs_tables.FILES for m in docs_tables.BLOCK.finditer((ROOT / f).read_text())]
    assert blocks, "README.md and docs/results.md hold no generated table"
    assert docs_tables.main(["--check"]) == 0, capsys.readouterr().out[-3000:]


def _fake_run(folder, name, N, canon, lr, accs, steps=3000, t=142.4):
    d = folder / name
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({
        "task": "depo1", "steps": steps, "tokens_seen": steps * 1024, "train_time_s": t,
        "test": {"by_group": {str(k): {"answers": 10, "acc": a} for k, a in accs.items()}}}))
    (d / "hparams.json").write_text(json.dumps({
        "task": {"name": "depo1", "N": N, "K": 2}, "canon": {"set": canon}, "optim": {"lr": lr}, "seed": 1,
        "model": {"size": "2L64D", "arch": "llama"}, "trainer": {"max_steps": steps, "default_root_dir": "/x"},
        "paths": {"output_dir": f"/machine/runs/{name}"}, "logger": {"csv": {"save_dir": "/machine"}},
        "callbacks": {"checkpoint": {"dirpath": "/machine/ck", "every_n_train_steps": 500}}}))
    return d


def test_runs_and_report_blocks_are_generated_and_a_stale_one_is_caught(tmp_path, capsys, monkeypatch):
    res = tmp_path / "docs" / "results" / "s"
    _fake_run(res, "r1", 5, "", 1e-3, {1: 0.529, 2: 0.344})
    _fake_run(res, "r2", 5, "ABCD", 1e-3, {1: 1.0, 2: 1.0}, t=153.9)
    md = tmp_path / "doc.md"
    md.write_text("# Results\n\n<!-- table: runs docs/results/s --keys task.N,canon.set,optim.lr --k 1,2 -->\nold\n"
                  "<!-- /table -->\n\n<!-- table: report docs/results/s --rows canon.set --cols task.N --k 1,2 -->\n"
                  "<!-- /table -->\ntail\n")
    monkeypatch.setattr(docs_tables, "ROOT", tmp_path)
    assert docs_tables.main(["--check", "--files", str(md)]) == 1
    assert "stale" in capsys.readouterr().err
    assert docs_tables.main(["--files", str(md)]) == 0
    text = md.read_text()
    want_runs = ("| run | task.N | canon.set | optim.lr | steps | train s | acc@1 % | acc@2 % |\n"
                 "|---|---|---|---|---|---|---|---|\n"
                 "| r1 | 5 | none | 0.001 | 3000 | 142 | 52.9 | 34.4 |\n"
                 "| r2 | 5 | ABCD | 0.001 | 3000 | 154 | 100.0 | 100.0 |\n")
    assert want_runs in text, text
    want_report = ("```\ncanon.set \\ task.N |            5\n"
                   "              none |   52.9/ 34.4\n"
                   "              ABCD |  100.0/100.0\n"
                   "3000 steps (3.07M tokens) per run; one setting per cell (1 run per cell); optim.lr=0.001, seed=1\n")
    assert want_report in text, text
    assert text.endswith("<!-- /table -->\ntail\n") and "old" not in text
    assert docs_tables.main(["--check", "--files", str(md)]) == 0
    md.write_text(text.replace("| 52.9 |", "| 53.1 |"))               # a hand edit
    assert docs_tables.main(["--check", "--files", str(md)]) == 1
    diff = capsys.readouterr().out
    assert "-| r1 | 5 | none | 0.001 | 3000 | 142 | 53.1 | 34.4 |" in diff and "+| r1 | 5 | none | 0.001 | 3000 | 142 | 52.9" \
        in diff, diff


def test_collect_copies_results_without_machine_paths_and_never_overwrites(tmp_path, capsys):
    sweep = tmp_path / "logs" / "multiruns" / "t"
    _fake_run(sweep, "0", 5, "", 1e-3, {1: 0.5})
    _fake_run(sweep, "1", 5, "ABCD", 1e-3, {1: 0.9})
    into = tmp_path / "docs" / "results" / "x"
    assert docs_tables.main(["--collect", str(sweep), "--into", str(into)]) == 0
    assert sorted(p.name for p in into.iterdir()) == ["0", "1"]
    hp = json.loads((into / "1" / "hparams.json").read_text())
    assert "paths" not in hp and "logger" not in hp and "default_root_dir" not in hp["trainer"]
    assert hp["callbacks"]["checkpoint"] == {"every_n_train_steps": 500} and hp["canon"]["set"] == "ABCD"
    assert json.loads((into / "1" / "results.json").read_text())["test"]["by_group"]["1"]["acc"] == 0.9
    before = (into / "0" / "results.json").read_bytes()
    assert docs_tables.main(["--collect", str(sweep), "--into", str(into)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds 0, 1" in err, err
    assert (into / "0" / "results.json").read_bytes() == before


@pytest.mark.parametrize("spec", ["table docs/results/s", "runs nowhere --keys a", "runs docs/results/s --k x"])
def test_a_bad_block_is_one_error(tmp_path, capsys, monkeypatch, spec):
    _fake_run(tmp_path / "docs" / "results" / "s", "r1", 5, "", 1e-3, {1: 0.5})
    md = tmp_path / "doc.md"
    md.write_text(f"<!-- table: {spec} -->\n<!-- /table -->\n")
    monkeypatch.setattr(docs_tables, "ROOT", tmp_path)
    assert docs_tables.main(["--files", str(md)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("docs_tables: error: block spec"), err
    assert md.read_text() == f"<!-- table: {spec} -->\n<!-- /table -->\n"
