"""PNG figures of a sweep report (``python -m canonlm.train.report <dirs> --out DIR``), drawn with matplotlib's Agg
canvas (no pyplot, no display, no global backend switch).

* :func:`heatmap` -- the heat maps of the paper's Fig. 7 (Allen-Zhu, 2025, Physics of Language Models Part 4.1):
  rows the task difficulty (e.g. Depo's N), columns the model sizes, each cell the best run over the learning rates
  and seeds it holds (the caption states them, with the budget), its number printed in the cell (Depo ``acc@K / acc@K/2``) and its colour the first number
  (accuracy in percent on a fixed 0-100 scale; Capo bits per parameter from 0). Several settings (Canon sets,
  positional encodings) are drawn as side-by-side panels with one shared colour scale. A cell without a finished
  run is light grey and hatched, with ``unfinished`` / ``failed`` / ``missing`` / ``diverged`` written in it.
* :func:`curves` -- learning curves: validation accuracy by group (Depo: by hop count k, the ``val/acc_k<k>`` keys of
  ``metrics.jsonl``, read with :func:`canonlm.train.metrics_file.read_metrics`) over training steps, one line per k,
  one subplot per cell of a setting's table showing that cell's best run (or its unfinished run, marked so).

Both return ``(png_bytes, info)``; ``info`` records what was drawn: the figure's size in pixels and, per heat-map
cell, its value, text, RGBA colour and ``probe_px`` -- a pixel (x from the left, y from the top of the PNG) inside
the cell, clear of its text, where the cell's colour can be read back.
"""

from __future__ import annotations

import io
import textwrap
import math
import re
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from canonlm.train.metrics_file import read_metrics

CMAP = "viridis"
DPI = 120
NA_FACE = (0.86, 0.86, 0.86, 1.0)  # a cell without a number: light grey ...
NA_HATCH = (0.62, 0.62, 0.62, 1.0)  # ... hatched in a darker grey
NA_HATCH_PATTERN = "//"
CELL_W, CELL_H = 1.2, 0.6  # inches per heat-map cell
PROBE = 0.14  # probe pixel: this fraction of a cell below its top edge, centred
_LEGEND = "grey hatched: no finished run (n/a); *: another run of the cell is unfinished"


def scale(tables: list[dict[str, Any]]) -> tuple[float, float, str]:
    """(vmin, vmax, label) of the colour scale shared by ``tables``: accuracy 0-100 %, bits per parameter 0 to
    max(2, largest cell)."""
    kinds = {t["kind"] for t in tables}
    vals = [c["value"] for t in tables for row in t["cells"].values() for c in row.values() if c["value"] is not None]
    if kinds == {"bits per parameter"}:
        return 0.0, max([2.0] + vals), "bits per parameter"
    hi = max([100.0] + vals)
    kind = kinds.pop() if len(kinds) == 1 else "accuracy (%)"
    # a two-number cell ("acc@K / acc@K/2 (%)", "whole-copy acc / per-token acc (%)"): the colour is the first
    return 0.0, hi, (kind.split(" / ")[0] + " (%)" if " / " in kind else kind)


def cell_color(value: float, vmin: float, vmax: float) -> tuple[float, float, float, float]:
    """The RGBA colour a cell of ``value`` is drawn with."""
    return tuple(float(x) for x in colormaps[CMAP](Normalize(vmin, vmax)(value)))


def _text_color(rgba: tuple[float, ...]) -> str:
    return "black" if 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] > 0.5 else "white"


def _na_text(c: dict[str, Any]) -> str:
    t = c["status"]
    if c["status"] in ("unfinished", "failed") and c.get("last_step") is not None:
        t += f"\nstep {c['last_step']}"
    return t


def _png(fig: Figure, text: dict[str, str] | None = None) -> bytes:
    """The figure as PNG bytes; ``text``: tEXt chunks to embed (key: value)."""
    buf = io.BytesIO()
    # never bbox_inches="tight": the probe pixels need the same geometry
    fig.savefig(buf, format="png", dpi=DPI, metadata=text)
    return buf.getvalue()


def heatmap(
    tables: list[dict[str, Any]],
    *,
    rows: str,
    cols: str,
    title: str,
    unplaced: list[str] | None = None,
    ncols: int | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """Fig. 7-style heat map(s) of one or several settings' tables (``canonlm.train.report.layout`` items), one
    panel each, side by side (``ncols`` per line, default up to 4) with one shared colour bar; the figure's title
    ``title``, each panel's title its setting, the caption each table's budget and best-of protocol (``protocol`` of
    :func:`canonlm.train.report.layout`: steps, tokens, learning rates, seeds, runs per cell) and the legend.
    ``unplaced``: unfinished runs that have no config (named under the figure). ``info["caption"]`` is that text."""
    vmin, vmax, slabel = scale(tables)
    # the caption: each table's budget and best-of protocol (``canonlm.train.cells.protocol``), once if shared
    protos = list(dict.fromkeys(t["protocol"]["text"] for t in tables if t.get("protocol")))
    if len(protos) > 1:
        protos = [f"[{t['title'] or t['name']}] {t['protocol']['text']}" for t in tables if t.get("protocol")]
    note = "".join(f"{x}. " for x in protos) + _LEGEND[0].upper() + _LEGEND[1:]
    n = len(tables)
    nc = min(n, ncols or 4)
    nr = math.ceil(n / nc)
    R = max(len(t["row_values"]) for t in tables)
    C = max(len(t["col_values"]) for t in tables)
    w = nc * (C * CELL_W + 1.0) + 1.2
    h = nr * (R * CELL_H + 1.0) + 0.9 + (0.2 if unplaced else 0)
    fig = Figure(figsize=(w, h), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nr, nc, squeeze=False)
    norm = Normalize(vmin, vmax)
    drawn: list[tuple[Any, int, int, int, dict[str, Any], str, str]] = []
    for k, t in enumerate(tables):
        ax = axes[k // nc][k % nc]
        rv, cv = t["row_values"], t["col_values"]
        ax.set_xlim(-0.5, len(cv) - 0.5)
        ax.set_ylim(len(rv) - 0.5, -0.5)  # first row on top, as in the table
        for i, r in enumerate(rv):
            for j, c in enumerate(cv):
                e = t["cells"][r][c]
                if e["status"] == "ok":
                    face = cell_color(e["value"], vmin, vmax)
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=face, edgecolor="white", lw=2))
                    ax.text(j, i, e["text"], ha="center", va="center", fontsize=9, color=_text_color(face))
                else:
                    face = NA_FACE
                    ax.add_patch(
                        Rectangle(
                            (j - 0.5, i - 0.5),
                            1,
                            1,
                            facecolor=NA_FACE,
                            edgecolor=NA_HATCH,
                            hatch=NA_HATCH_PATTERN,
                            lw=0,
                        )
                    )
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="white", lw=2))
                    ax.text(
                        j,
                        i,
                        _na_text(e),
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="black",
                        bbox={"facecolor": NA_FACE, "edgecolor": "none", "pad": 1.0},
                    )
                drawn.append((ax, k, i, j, e, r, c))
        ax.set_xticks(range(len(cv)), cv)
        ax.set_yticks(range(len(rv)), rv)
        ax.tick_params(length=0, labelsize=9)
        ax.set_xlabel(cols)
        ax.set_ylabel(rows)
        for s in ax.spines.values():
            s.set_visible(False)
        if n > 1 or t["title"]:
            ax.set_title(t["title"] or t["name"], fontsize=9)
    for k in range(n, nr * nc):
        axes[k // nc][k % nc].set_visible(False)
    used = [axes[k // nc][k % nc] for k in range(n)]
    fig.colorbar(
        ScalarMappable(norm=norm, cmap=CMAP), ax=used, label=slabel, shrink=0.9, aspect=max(8, 12 * R * nr / 3)
    )
    fig.suptitle(title, fontsize=11)
    kinds = {t["kind"] for t in tables}
    if len(kinds) == 1 and " / " in next(iter(kinds)):
        note = f"cells: {next(iter(kinds))}, colour: {slabel[:-4]}; " + note[0].lower() + note[1:]
    if unplaced:
        n_u = len(unplaced)
        note += f"; {n_u} unfinished run{'s' if n_u > 1 else ''} without a config, in no cell (see table.md)"
    fig.supxlabel(textwrap.fill(note, width=int(w * 15)), fontsize=7)
    fig.canvas.draw()
    H = fig.bbox.height
    cells = []
    for ax, k, i, j, e, r, c in drawn:
        x, y = ax.transData.transform((j, i - 0.5 + PROBE))
        cells.append(
            {
                "panel": k,
                "row": r,
                "col": c,
                "status": e["status"],
                "value": e["value"],
                "text": e["text"],
                "rgba": list(cell_color(e["value"], vmin, vmax)) if e["status"] == "ok" else list(NA_FACE),
                "probe_px": [int(round(x)), int(round(H - y))],
            }
        )
    png = _png(fig)
    info = {
        "size_px": [int(round(fig.bbox.width)), int(round(H))],
        "dpi": DPI,
        "cmap": CMAP,
        "vmin": vmin,
        "vmax": vmax,
        "scale": slabel,
        "cells": cells,
        "caption": note,
    }
    return png, info


_ACC = re.compile(r"^val/acc_([A-Za-z_]*?)(\d+)$")
_GEN = re.compile(r"^val/gen_acc_([A-Za-z_]*?)(\d+)$")


def accuracy_series(run_dir: str | Path) -> tuple[str, dict[int, tuple[list[int], list[float]]]]:
    """``(group name, {group: (steps, accuracies)})`` of a run's validation accuracy by group (Depo: k) from its
    ``metrics.jsonl``: the ``val/acc_<group><g>`` keys, else the generation accuracy ``val/gen_acc_<group><g>``,
    else the overall ``val/acc`` (group 0). Empty when the file is missing or has none."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return "", {}
    try:
        rows = read_metrics(path)
    except OSError:
        return "", {}
    for pat in (_ACC, _GEN):
        out: dict[int, tuple[list[int], list[float]]] = {}
        name = ""
        for row in rows:
            for key, v in row.items():
                m = pat.match(key)
                if m and isinstance(v, (int, float)):
                    name = m.group(1)
                    s, vals = out.setdefault(int(m.group(2)), ([], []))
                    s.append(row["step"])
                    vals.append(float(v))
        if out:
            return name, dict(sorted(out.items()))
    out = {}
    for row in rows:
        if isinstance(row.get("val/acc"), (int, float)):
            s, vals = out.setdefault(0, ([], []))
            s.append(row["step"])
            vals.append(float(row["val/acc"]))
    return "", out


def curves(t: dict[str, Any], *, rows: str, cols: str, title: str) -> tuple[bytes, dict[str, Any]]:
    """Learning curves of one setting: a grid of subplots laid out like its table (rows x columns), each the
    validation accuracy (%) by group (Depo: one line per hop count k) over steps of the cell's best run; a cell
    with only unfinished or failed runs shows the most advanced of them on a grey background, a missing cell is
    grey and hatched."""
    rv, cv = t["row_values"], t["col_values"]
    nr, nc = len(rv), len(cv)
    fig = Figure(figsize=(max(nc * 2.8 + 0.6, 4.6), nr * 2.1 + 1.2), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nr, nc, squeeze=False, sharey=True)
    data: dict[tuple[str, str], tuple[str, dict]] = {}
    groups: set[int] = set()
    cells = []
    for r in rv:
        for c in cv:
            e = t["cells"][r][c]
            run = e["dir"] if e["status"] in ("ok", "diverged") else None
            if run is None and e["unfinished"]:  # the unfinished run that got furthest
                run = max(e["unfinished"], key=lambda d: _last(d))
            name, series = accuracy_series(run) if run else ("", {})
            data[r, c] = (name, series)
            groups |= set(series)
            cells.append(
                {
                    "row": r,
                    "col": c,
                    "status": e["status"],
                    "dir": run,
                    "groups": sorted(series),
                    "points": sum(len(s) for s, _ in series.values()),
                }
            )
    colors = colormaps["tab10"]
    order = {g: i for i, g in enumerate(sorted(groups))}
    handles: dict[int, Any] = {}
    for i, r in enumerate(rv):
        for j, c in enumerate(cv):
            ax = axes[i][j]
            e = t["cells"][r][c]
            name, series = data[r, c]
            for g, (steps, vals) in series.items():
                (ln,) = ax.plot(
                    steps,
                    [100 * v for v in vals],
                    marker="o",
                    ms=2.5,
                    lw=1.3,
                    color=colors(order[g] % 10),
                    label=f"{name}={g}" if name else "all",
                )
                handles.setdefault(g, ln)
            ax.set_ylim(-3, 103)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            head = f"{rows}={r}, {cols}={c}"
            if e["status"] != "ok":
                ax.set_facecolor(NA_FACE)
                head += "\n" + _na_text(e).replace("\n", ", ")
            if e["status"] == "missing":
                ax.add_patch(
                    Rectangle(
                        (0, 0),
                        1,
                        1,
                        transform=ax.transAxes,
                        facecolor=NA_FACE,
                        edgecolor=NA_HATCH,
                        hatch=NA_HATCH_PATTERN,
                        lw=0,
                    )
                )
            if not series:
                ax.text(
                    0.5,
                    0.5,
                    "missing" if e["status"] == "missing" else "no validation accuracy logged",
                    transform=ax.transAxes,
                    ha="center",
                    va="center",
                    fontsize=8,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5},
                )
                ax.set_xticks([])
            ax.set_title(head, fontsize=8)
            if i == nr - 1:
                ax.set_xlabel("step", fontsize=8)
            if j == 0:
                ax.set_ylabel("val accuracy (%)", fontsize=8)
    if handles:
        fig.legend(
            [handles[g] for g in sorted(handles)],
            [handles[g].get_label() for g in sorted(handles)],
            loc="outside right upper",
            fontsize=8,
        )  # the caption (supxlabel) takes the bottom
    # a narrow figure (one or two cells) gets the title over two lines instead of cutting it off
    sep = "\n" if nc < 3 else " -- "
    fig.suptitle(f"{title}{sep}learning curves (best run per cell)", fontsize=10)
    caption = (t.get("protocol") or {}).get("text", "")
    if caption:  # the budget and the best-of protocol (canonlm.train.cells.protocol)
        fig.supxlabel(textwrap.fill(caption + ".", width=int(fig.get_figwidth() * 15)), fontsize=7)
    fig.canvas.draw()
    png = _png(fig)
    return png, {
        "size_px": [int(round(fig.bbox.width)), int(round(fig.bbox.height))],
        "dpi": DPI,
        "cells": cells,
        "caption": caption,
    }


def _last(run_dir: str) -> int:
    try:
        rows = read_metrics(Path(run_dir) / "metrics.jsonl")
        return rows[-1]["step"] if rows else -1
    except OSError:
        return -1


ATLAS_ROWS = ("none", "ABCD")  # canon.set labels: no Canon, Canon-ABCD
ATLAS_COLS = ("nope", "rope")  # pos.type labels
ATLAS_ROW_NAMES = {"none": "no Canon", "ABCD": "Canon-ABCD"}
ATLAS_COL_NAMES = {"nope": "NoPE", "rope": "RoPE"}


def atlas(
    panels: list[dict[str, Any]], *, title: str, caption: str, text: dict[str, str] | None = None
) -> tuple[bytes, dict[str, Any]]:
    """The skills side by side (the paper's Fig. 7 read across tasks): one 2 x 2 panel per skill, rows no Canon /
    Canon-ABCD, columns NoPE / RoPE, each cell the number of :mod:`canonlm.train.atlas` (the best run of the cell)
    written in it and its colour on the panel's own scale (accuracy 0-100 %; bits per parameter from 0 to
    max(0.5, largest cell)). A cell without runs is grey and hatched ("n/a"); a skill without committed runs is a
    grey panel that names its preset ("not run yet").

    Args:
        panels: ``canonlm.train.atlas.panels`` items: ``skill``, ``task``, ``preset``, ``metric`` (str), ``bits``
            (bool), ``cells`` ({row: {col: float or None}} or None when the skill has no runs).
        title: the figure's title. caption: the text under the panels (budgets, learning rates, seeds).
        text: PNG tEXt chunks to embed (``canonlm.train.atlas`` stores the numbers drawn, to check the picture).
    Returns: (png bytes, info) with info ``size_px``, per cell ``panel``, ``row``, ``col``, ``value``, ``rgba`` and
        ``probe_px`` (a pixel of the PNG inside the cell, clear of its text, where ``rgba`` can be read back).
    """
    n = len(panels)
    w, h = n * 2.6 + 0.6, 3.4
    fig = Figure(figsize=(w, h), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n, squeeze=False)[0]
    drawn = []
    for k, p in enumerate(panels):
        ax = axes[k]
        ax.set_xlim(-0.5, 1.5)
        ax.set_ylim(1.5, -0.5)
        vals = [v for row in (p["cells"] or {}).values() for v in row.values() if v is not None]
        vmin, vmax = (0.0, max([0.5] + vals)) if p["bits"] else (0.0, 100.0)
        for i, r in enumerate(ATLAS_ROWS):
            for j, c in enumerate(ATLAS_COLS):
                v = (p["cells"] or {}).get(r, {}).get(c)
                if v is not None:
                    face = cell_color(v, vmin, vmax)
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=face, edgecolor="white", lw=2))
                    ax.text(
                        j,
                        i,
                        f"{v:#.3g}" if p["bits"] else f"{v:.1f}",
                        ha="center",
                        va="center",
                        fontsize=10,
                        color=_text_color(face),
                    )
                else:
                    face = NA_FACE
                    ax.add_patch(
                        Rectangle(
                            (j - 0.5, i - 0.5),
                            1,
                            1,
                            facecolor=NA_FACE,
                            edgecolor=NA_HATCH,
                            hatch=NA_HATCH_PATTERN,
                            lw=0,
                        )
                    )
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="white", lw=2))
                    if p["cells"] is not None:
                        ax.text(
                            j,
                            i,
                            "n/a",
                            ha="center",
                            va="center",
                            fontsize=8,
                            bbox={"facecolor": NA_FACE, "edgecolor": "none", "pad": 1.0},
                        )
                drawn.append((ax, k, i, j, r, c, v, list(face)))
        if p["cells"] is None:
            ax.text(
                0.5,
                0.5,
                f"not run yet\n(planned: experiment=\n{p['preset']})",
                ha="center",
                va="center",
                fontsize=8,
                bbox={"facecolor": "white", "edgecolor": NA_HATCH, "pad": 3.0},
            )
        ax.set_xticks(range(2), [ATLAS_COL_NAMES[c] for c in ATLAS_COLS])
        ax.set_yticks(range(2), [ATLAS_ROW_NAMES[r] for r in ATLAS_ROWS] if k == 0 else ["", ""])
        ax.tick_params(length=0, labelsize=9)
        for s in ax.spines.values():
            s.set_visible(False)
        ax.set_title(f"{p['skill']}: {p['task']}\n{p['metric']}", fontsize=9)
    fig.suptitle(title, fontsize=11)
    fig.supxlabel(textwrap.fill(caption, width=int(w * 16)), fontsize=7)
    fig.canvas.draw()
    H = fig.bbox.height
    cells = []
    for ax, k, i, j, r, c, v, face in drawn:
        x, y = ax.transData.transform((j, i - 0.5 + PROBE))
        cells.append(
            {"panel": k, "row": r, "col": c, "value": v, "rgba": face, "probe_px": [int(round(x)), int(round(H - y))]}
        )
    return _png(fig, text), {"size_px": [int(round(fig.bbox.width)), int(round(H))], "cells": cells}
