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
    (d / "results.json").write_text(
        json.dumps(
            {
                "task": "depo1",
                "steps": steps,
                "tokens_seen": steps * 1024,
                "train_time_s": t,
                "test": {"by_group": {str(k): {"answers": 10, "acc": a} for k, a in accs.items()}},
            }
        )
    )
    (d / "hparams.json").write_text(
        json.dumps(
            {
                "task": {"name": "depo1", "N": N, "K": 2},
                "canon": {"set": canon},
                "optim": {"lr": lr},
                "seed": 1,
                "model": {"size": "2L64D", "arch": "llama"},
                "trainer": {"max_steps": steps, "default_root_dir": "/x"},
                "paths": {"output_dir": f"/machine/runs/{name}"},
                "logger": {"csv": {"save_dir": "/machine"}},
                "callbacks": {"checkpoint": {"dirpath": "/machine/ck", "every_n_train_steps": 500}},
            }
        )
    )
    return d


def test_runs_and_report_blocks_are_generated_and_a_stale_one_is_caught(tmp_path, capsys, monkeypatch):
    res = tmp_path / "docs" / "results" / "s"
    _fake_run(res, "r1", 5, "", 1e-3, {1: 0.529, 2: 0.344})
    _fake_run(res, "r2", 5, "ABCD", 1e-3, {1: 1.0, 2: 1.0}, t=153.9)
    md = tmp_path / "doc.md"
    md.write_text(
        "# Results\n\n<!-- table: runs docs/results/s --keys task.N,canon.set,optim.lr --k 1,2 -->\nold\n"
        "<!-- /table -->\n\n<!-- table: report docs/results/s --rows canon.set --cols task.N --k 1,2 -->\n"
        "<!-- /table -->\ntail\n"
    )
    monkeypatch.setattr(docs_tables, "ROOT", tmp_path)
    assert docs_tables.main(["--check", "--files", str(md)]) == 1
    assert "stale" in capsys.readouterr().err
    assert docs_tables.main(["--files", str(md)]) == 0
    text = md.read_text()
    want_runs = (
        "| run | task.N | canon.set | optim.lr | steps | train s | acc@1 % | acc@2 % |\n"
        "|---|---|---|---|---|---|---|---|\n"
        "| r1 | 5 | none | 0.001 | 3000 | 142 | 52.9 | 34.4 |\n"
        "| r2 | 5 | ABCD | 0.001 | 3000 | 154 | 100.0 | 100.0 |\n"
    )
    assert want_runs in text, text
    want_report = (
        "```\ncanon.set \\ task.N |            5\n"
        "              none |   52.9/ 34.4\n"
        "              ABCD |  100.0/100.0\n"
        "3000 steps (3.07M tokens) per run; one setting per cell (1 run per cell); optim.lr=0.001, seed=1\n"
    )
    assert want_report in text, text
    assert text.endswith("<!-- /table -->\ntail\n") and "old" not in text
    assert docs_tables.main(["--check", "--files", str(md)]) == 0
    md.write_text(text.replace("| 52.9 |", "| 53.1 |"))  # a hand edit
    assert docs_tables.main(["--check", "--files", str(md)]) == 1
    diff = capsys.readouterr().out
    assert (
        "-| r1 | 5 | none | 0.001 | 3000 | 142 | 53.1 | 34.4 |" in diff
        and "+| r1 | 5 | none | 0.001 | 3000 | 142 | 52.9" in diff
    ), diff


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


def _pos_run(folder, name, canon, pos, lr, acc2):
    """A finished Depo run (K=2) of the atlas's grid: Canon set x positions, at one learning rate."""
    d = _fake_run(folder, name, 5, canon, lr, {1: 1.0, 2: acc2})
    hp = json.loads((d / "hparams.json").read_text())
    hp["pos"] = {"type": pos}
    (d / "hparams.json").write_text(json.dumps(hp))
    return d


def test_the_atlas_is_drawn_from_the_runs_and_a_changed_run_or_picture_is_caught(tmp_path, capsys, monkeypatch):
    """The atlas block: its table holds each cell's best run over the learning rates (by hand below), the PNG shows
    those numbers in the cells' colours (read back at the probe pixels), and --check fails when a run's result
    changes (table and picture stale) or when the picture alone no longer matches (a PNG that embeds other numbers
    or none)."""
    import matplotlib.image
    import numpy as np

    from canonlm.train.atlas import build
    from canonlm.train.figures import cell_color

    res = tmp_path / "docs" / "results" / "depth"
    accs = {
        ("", "nope"): (0.30, 0.25),
        ("", "rope"): (0.20, 0.35),
        ("ABCD", "nope"): (0.90, 1.0),
        ("ABCD", "rope"): (0.80, 0.95),
    }
    for i, ((canon, pos), (a, b)) in enumerate(accs.items()):
        _pos_run(res, f"r{2 * i}", canon, pos, 1e-3, a)
        _pos_run(res, f"r{2 * i + 1}", canon, pos, 2e-3, b)
    md = tmp_path / "README.md"
    spec = "atlas docs/figures/atlas.png depth=docs/results/depth:2,1 breadth=-"
    md.write_text(f"<!-- table: {spec} -->\n<!-- /table -->\n")
    monkeypatch.setattr(docs_tables, "ROOT", tmp_path)
    assert docs_tables.main(["--check", "--files", str(md)]) == 1
    assert docs_tables.main(["--files", str(md)]) == 0
    text = md.read_text()
    # best of the two learning rates per cell: none/NoPE 30.0, ABCD/NoPE 100.0, none/RoPE 35.0, ABCD/RoPE 95.0
    assert "| depth | Depo (`experiment=mini/depth`) | acc@2 (%) | 30.0 | 100.0 | 35.0 | 95.0 |" in text, text
    assert "| breadth | Brevo (`experiment=mini/breadth`, planned) | not run yet | - | - | - | - |" in text
    assert "![canonlm atlas](docs/figures/atlas.png)" in text and "optim.lr in {0.001, 0.002}" in text
    png = tmp_path / "docs" / "figures" / "atlas.png"
    img = matplotlib.image.imread(png)
    _, _, _, info = build(spec.split()[2:], tmp_path)
    assert list(img.shape[1::-1]) == info["size_px"]
    want = {("none", "nope"): 30.0, ("ABCD", "nope"): 100.0, ("none", "rope"): 35.0, ("ABCD", "rope"): 95.0}
    for c in info["cells"]:
        x, y = c["probe_px"]
        if c["panel"] == 0:
            assert np.allclose(img[y, x, :3], cell_color(want[(c["row"], c["col"])], 0, 100)[:3], atol=0.02)
        else:  # the skill without runs: grey
            assert c["value"] is None
    assert docs_tables.main(["--check", "--files", str(md)]) == 0
    # a run's result changes: the table and the picture are stale
    r = res / "r1" / "results.json"
    doc = json.loads(r.read_text())
    doc["test"]["by_group"]["2"]["acc"] = 0.40
    r.write_text(json.dumps(doc))
    assert docs_tables.main(["--check", "--files", str(md)]) == 1
    err = capsys.readouterr().err
    assert str(png) in err and str(md) in err
    assert docs_tables.main(["--files", str(md)]) == 0 and "| 40.0 | 100.0 | 35.0 | 95.0 |" in md.read_text()
    assert docs_tables.main(["--check", "--files", str(md)]) == 0
    # the picture alone: another PNG (no embedded numbers) in its place is caught
    matplotlib.image.imsave(png, np.zeros((4, 4, 3)))
    assert docs_tables.main(["--check", "--files", str(md)]) == 1
    assert str(png) in capsys.readouterr().err and "stale" not in md.read_text()


def test_an_atlas_panel_picks_one_value_of_a_third_axis(tmp_path):
    """Runs of two task.N values form two (Canon set x positions) tables: a plain panel is refused naming them, and
    ``@task.N=<n>`` keeps only that population's runs (their best per cell, by hand), and says so in the caption."""
    from canonlm.train.atlas import build, parse_panel

    res = tmp_path / "runs"
    for n, (none, abcd) in {5: (0.2, 0.9), 8: (0.1, 0.6)}.items():
        _pos_run(res, f"n{n}a", "", "rope", 1e-3, none)
        _pos_run(res, f"n{n}b", "ABCD", "rope", 1e-3, abcd)
        for name in (f"n{n}a", f"n{n}b"):
            hp = json.loads((res / name / "hparams.json").read_text())
            hp["task"]["N"] = n
            (res / name / "hparams.json").write_text(json.dumps(hp))
    with pytest.raises(ValueError, match="form 2 settings"):
        build(["depth=runs:2,1"], tmp_path)
    assert parse_panel("depth=runs:2,1@task.N=8") == ("depth", "runs", (2, 1), ("task.N", "8"))
    _, data, md, _ = build(["depth=runs:2,1@task.N=8"], tmp_path)
    cells = data["panels"][0]["cells"]
    assert cells["none"]["rope"] == 10.0 and cells["ABCD"]["rope"] == 60.0 and cells["none"]["nope"] is None
    assert "depth (task.N=8):" in md
    with pytest.raises(ValueError, match="no run below .* has task.N=7 .they have: 5, 8"):
        build(["depth=runs:2,1@task.N=7"], tmp_path)
    with pytest.raises(ValueError, match="must be KEY=VALUE"):
        parse_panel("depth=runs@task.N")


def _task_run(folder, name, task, test):
    """A finished run of ``task`` (a fake Depo run whose results.json says ``task`` and holds ``test``)."""
    d = _fake_run(folder, name, 5, "", 2e-3, {})
    r = json.loads((d / "results.json").read_text())
    r["task"], r["test"] = task, test
    (d / "results.json").write_text(json.dumps(r))
    return d


def test_a_lano_runs_table_shows_the_kl_beside_the_generation_accuracy(tmp_path):
    """Lano is scored by generation accuracy with its KL (Part 4.1, App. A.5): the runs table gives both, the KL next
    to that of a model uniform over the vocabulary; a run without a KL says n/a."""
    res = tmp_path / "lano"
    for name, gen in {"l1": {"acc": 0.328, "kl": 0.02612, "kl_uniform": 0.8962}, "l2": {"acc": 0.0}}.items():
        _task_run(res, name, "lano", {"by_group": {}, "generate": {"samples": 64, **gen}})
    text = docs_tables._runs_block(res, ["canon.set"], [])
    assert "| run | canon.set | steps | train s | acc % | KL (uniform model) |" in text
    assert (
        "| l1 | none | 3000 | 142 | 32.8 | 0.0261 (0.896) |" in text
        and "| l2 | none | 3000 | 142 | 0.0 | n/a |" in text
    )


def test_a_capo_runs_table_gives_bits_per_parameter_and_the_bits(tmp_path):
    """Capo's runs table heads its column with what it holds (Part 3.3's bits per parameter, then the bits)."""
    res = tmp_path / "capo"
    for name, (bpp, bits) in {"c1": (-1.622, -62747.2), "c2": (0.04048, 6392.4)}.items():
        _task_run(res, name, "capo", {"by_group": {}, "task_metrics": {"bits_per_param": bpp, "bits": bits}})
    text = docs_tables._runs_block(res, ["canon.set"], [])
    assert "| run | canon.set | steps | train s | bits / param (bits) |" in text
    assert (
        "| c1 | none | 3000 | 142 | -1.622 (-62,747) |" in text
        and "| c2 | none | 3000 | 142 | 0.04048 (6,392) |" in text
    )
