"""``python -m canonlm.train.report <dirs> --out DIR``: markdown / CSV tables in the paper's layout, Fig. 7-style heat
maps (best of the learning rates per cell), side-by-side panels, learning curves and report.json; the PNGs are read
back and their cell colours checked against the accuracies."""

import json

import numpy as np
import pytest
import yaml
from matplotlib import colormaps
from matplotlib.image import imread

from canonlm.train import figures
from canonlm.train.report import main
from test_report import _config, _run, _sweep_2x2, _val_rows

NAN = float("nan")
SIZES = ["8L512D", "8L768D", "12L768D"]


def _grid(root):
    """depo1 N in {225, 300, 375} x sizes {8L512D, 8L768D, 12L768D}, with, by hand (acc@8 / acc@4 in %):

    225: 70.0/80.0 (best of two lr: 50/90 and 70/80) | 40.0/60.0 | 95.0/99.0
    300: 30.0/60.0 | missing (no run at all)          | 80.0/97.0, and an unfinished run of another lr (*)
    375: diverged (NaN, the only run)               | missing   | unfinished (only .hydra/config.yaml, step 150)
    """
    curve = [(100, {1: 0.3, 2: 0.1, 4: 0.05, 8: 0.0}), (200, {1: 0.6, 2: 0.3, 4: 0.2, 8: 0.1})]
    _run(root, "0", 225, "8L512D", 1e-3, 0.50, 0.90, curve=curve)
    _run(root, "1", 225, "8L512D", 2e-3, 0.70, 0.80, curve=curve)
    _run(root, "2", 225, "8L768D", 1e-3, 0.40, 0.60)
    _run(root, "3", 225, "12L768D", 1e-3, 0.95, 0.99)
    _run(root, "4", 300, "8L512D", 1e-3, 0.30, 0.60)
    _run(root, "5", 300, "12L768D", 1e-3, 0.80, 0.97)
    _run(root, "6", 375, "8L512D", 1e-3, NAN, NAN)
    for name, N, lr, rows in (
        ("7", 300, 2e-3, '{"step": 40, "time": 1.0, "train/loss": 2.0}\n'),
        ("8", 375, 1e-3, _val_rows([(100, {1: 0.2, 8: 0.0})]) + '{"step": 150, "time": 9.0, "train/loss": 1.5}\n'),
    ):
        d = root / name  # killed: Hydra's config and metrics.jsonl only (no hparams.json, no results.json)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(_config(N, "12L768D", lr)))
        (d / "metrics.jsonl").write_text(rows)
    return root


CSV = """\
task.N \\ model.size,8L512D,8L768D,12L768D
225,70.0/80.0,40.0/60.0,95.0/99.0
300,30.0/60.0,n/a,80.0/97.0
375,n/a,n/a,n/a
"""

MD = """\
| task.N \\ model.size | 8L512D | 8L768D | 12L768D |
|---|---:|---:|---:|
| 225 | 70.0 / 80.0 | 40.0 / 60.0 | 95.0 / 99.0 |
| 300 | 30.0 / 60.0 | n/a (missing) | 80.0 / 97.0* |
| 375 | n/a (diverged) | n/a (missing) | n/a (unfinished) |
"""


def _pixel(img, xy):
    x, y = xy
    return img[y, x, :3]


def _lut_value(rgb, vmin, vmax):
    """The colour-scale value whose colormap colour is nearest ``rgb`` (and the distance)."""
    lut = colormaps[figures.CMAP](np.linspace(0, 1, 256))[:, :3]
    d = np.abs(lut - rgb).sum(axis=1)
    i = int(d.argmin())
    return vmin + (vmax - vmin) * i / 255, float(d[i])


def test_out_tables_heatmap_curves(tmp_path, capsys):
    root = _grid(tmp_path / "sweep")
    out = tmp_path / "out"
    assert main([str(root), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith("task.N \\ model.size |       8L512D |       8L768D |      12L768D\n")  # as without --out
    assert f"wrote 5 files to {out}" in stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "curves.png",
        "heatmap.png",
        "report.json",
        "table.csv",
        "table.md",
    ]
    assert (out / "table.csv").read_text() == CSV
    md = (out / "table.md").read_text()
    assert "## depo1: arch=llama canon=ABCD pos=rope" in md and MD in md
    assert f"unfinished or failed: {root}/7 (last step 40 from metrics.jsonl)" in md
    assert f"unfinished or failed: {root}/8 (last step 150 from metrics.jsonl)" in md

    doc = json.loads((out / "report.json").read_text())
    (t,) = doc["tables"]
    assert t["row_values"] == ["225", "300", "375"] and t["col_values"] == SIZES
    status = {(r, c): e["status"] for r, row in t["cells"].items() for c, e in row.items()}
    assert status == {
        ("225", "8L512D"): "ok",
        ("225", "8L768D"): "ok",
        ("225", "12L768D"): "ok",
        ("300", "8L512D"): "ok",
        ("300", "8L768D"): "missing",
        ("300", "12L768D"): "ok",
        ("375", "8L512D"): "diverged",
        ("375", "8L768D"): "missing",
        ("375", "12L768D"): "unfinished",
    }
    best = t["cells"]["225"]["8L512D"]
    assert best["acc"] == pytest.approx([0.70, 0.80]) and best["dir"] == str(root / "1") and best["runs"] == 2
    assert t["cells"]["300"]["12L768D"]["unfinished"] == [str(root / "7")]
    assert t["cells"]["375"]["12L768D"]["last_step"] == 150

    # the heat map, read back: its size, cell colours ordered like the accuracies, n/a cells grey
    (hm,) = [f for f in doc["figures"] if f["file"] == "heatmap.png"]
    img = imread(out / "heatmap.png")
    assert img.shape[:2] == (hm["size_px"][1], hm["size_px"][0]) and img.shape[0] > 300 and img.shape[1] > 400
    assert (hm["vmin"], hm["vmax"], hm["cmap"]) == (0.0, 100.0, "viridis")
    cells = {(c["row"], c["col"]): c for c in hm["cells"]}
    assert len(cells) == 9
    ok = {k: c for k, c in cells.items() if c["status"] == "ok"}
    assert {k: c["value"] for k, c in ok.items()} == pytest.approx(
        {
            ("225", "8L512D"): 70.0,
            ("225", "8L768D"): 40.0,
            ("225", "12L768D"): 95.0,
            ("300", "8L512D"): 30.0,
            ("300", "12L768D"): 80.0,
        }
    )
    assert cells["300", "12L768D"]["text"] == "80.0 / 97.0*"
    # one pixel against the colormap itself: acc@8 = 70 % on the 0-100 scale
    want = np.array(colormaps["viridis"](0.70)[:3])
    assert np.abs(_pixel(img, cells["225", "8L512D"]["probe_px"]) - want).max() < 2.5 / 255
    recovered = {}
    for k, c in ok.items():
        rgb = _pixel(img, c["probe_px"])
        assert np.abs(rgb - np.array(c["rgba"][:3])).max() < 2.5 / 255, k
        recovered[k], dist = _lut_value(rgb, 0, 100)
        assert dist < 0.02 and recovered[k] == pytest.approx(c["value"], abs=0.6)
    assert sorted(recovered, key=recovered.get) == sorted(ok, key=lambda k: ok[k]["value"])
    for k in [("300", "8L768D"), ("375", "8L512D"), ("375", "8L768D"), ("375", "12L768D")]:
        rgb = _pixel(img, cells[k]["probe_px"])
        assert np.ptp(rgb) < 0.02 and 0.5 < rgb.mean() < 0.95, (k, rgb)  # grey (background or hatch line)
        assert _lut_value(rgb, 0, 100)[1] > 0.1  # not a colour of the scale
    assert cells["375", "12L768D"]["text"] == "n/a (unfinished)"

    # learning curves: one subplot per cell, the cell's best run (or its unfinished run), one line per k
    (cv,) = [f for f in doc["figures"] if f["file"] == "curves.png"]
    assert imread(out / "curves.png").shape[:2] == (cv["size_px"][1], cv["size_px"][0])
    cc = {(c["row"], c["col"]): c for c in cv["cells"]}
    assert cc["225", "8L512D"]["dir"] == str(root / "1") and cc["225", "8L512D"]["groups"] == [1, 2, 4, 8]
    assert cc["225", "8L512D"]["points"] == 8
    assert cc["375", "12L768D"]["dir"] == str(root / "8") and cc["375", "12L768D"]["groups"] == [1, 8]
    assert cc["300", "8L768D"]["dir"] is None and cc["300", "8L768D"]["status"] == "missing"


def test_canon_by_pos_panels_share_one_scale(tmp_path, capsys):
    s = _sweep_2x2(tmp_path)
    out = tmp_path / "out"
    assert main([str(s), "--out", str(out)]) == 0
    capsys.readouterr()
    doc = json.loads((out / "report.json").read_text())
    assert [t["name"] for t in doc["tables"]] == [
        f"depo1: arch=llama canon={c} pos={p}" for c in ("none", "ABCD") for p in ("nope", "rope")
    ]
    assert (out / "table-canon.set-ABCD_pos.type-rope.csv").read_text() == "task.N \\ model.size,2L64D\n16,60.0/95.0\n"
    (pan,) = [f for f in doc["figures"] if f["type"] == "panels"]
    assert pan["file"] == "heatmaps.png" and pan["tables"] == [0, 1, 2, 3] and (pan["vmin"], pan["vmax"]) == (0, 100)
    img = imread(out / pan["file"])
    assert img.shape[:2] == (pan["size_px"][1], pan["size_px"][0])
    cells = pan["cells"]
    assert [c["panel"] for c in cells] == [0, 1, 2, 3] and [c["value"] for c in cells] == pytest.approx(
        [5.0, 12.0, 55.0, 60.0]
    )  # none/nope, none/rope, ABCD/nope, ABCD/rope (by hand in _sweep_2x2)
    vals = [_lut_value(_pixel(img, c["probe_px"]), 0, 100)[0] for c in cells]
    assert vals == sorted(vals) and vals == pytest.approx([5.0, 12.0, 55.0, 60.0], abs=0.6)
    # 2 x 2 panels: a line per Canon set, a column per position encoding
    (x0, y0), (x1, y1), (x2, y2) = (c["probe_px"] for c in cells[:3])
    assert y0 == y1 and x1 > x0 and y2 > y0 and x2 == x0
    # the runs without a config (killed before Hydra wrote it, ...) are listed, never in a cell
    assert [u["placed"] for u in doc["unfinished"]] == [False, False, False]
    assert "## Unfinished or failed runs" in (out / "table.md").read_text()


def test_out_never_overwrites_and_errors_write_nothing(tmp_path, capsys):
    root = _grid(tmp_path / "sweep")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "table.md").write_text("my table")
    assert main([str(root), "--out", str(out)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and "already holds table.md" in cap.err and "--force" in cap.err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "table.md"]
    assert (out / "table.md").read_text() == "my table"
    assert main([str(root), "--out", str(out), "--force"]) == 0
    capsys.readouterr()
    assert (out / "notes.txt").read_text() == "mine" and (out / "table.csv").read_text() == CSV
    # several dirs: one without runs is one error, nothing written
    empty = tmp_path / "empty"
    empty.mkdir()
    out2 = tmp_path / "out2"
    assert main([str(root), str(empty), "--out", str(out2)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and f"no runs below {empty}" in cap.err
    assert not out2.exists()


def test_several_dirs_are_one_sweep(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, "0", 225, "8L512D", 1e-3, 0.50, 0.90)
    _run(b, "0", 225, "8L512D", 2e-3, 0.70, 0.80)  # the other lr of the same cell, from another sweep
    _run(b, "1", 225, "12L768D", 1e-3, 0.20, 0.30)
    out = tmp_path / "out"
    assert main([str(a), str(b), str(a), "--out", str(out)]) == 0  # a dir given twice counts once
    capsys.readouterr()
    assert (out / "table.csv").read_text() == "task.N \\ model.size,8L512D,12L768D\n225,70.0/80.0,20.0/30.0\n"
    doc = json.loads((out / "report.json").read_text())
    assert doc["tables"][0]["cells"]["225"]["8L512D"]["runs"] == 2
