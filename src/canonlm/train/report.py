"""Paper-style tables and figures from a sweep: ``python -m canonlm.train.report <sweep or run dirs...> [--rows task.N]
[--cols model.size] [--k K1,K2] [--best-of KEYS] [--json out.json] [--out DIR [--force]]``.

Reads every run below the folders: its ``results.json`` (written by ``train.py`` when the run ends) and the resolved
config ``hparams.json`` beside it. Runs are put in cells by the values of the ``--rows`` and ``--cols`` config keys,
and a cell shows its best run over the ``--best-of`` keys (default ``optim.lr,seed,task.seed``: the learning rates
and seeds it holds): the paper reports, for each cell, the best of the learning rates it tried (Allen-Zhu, 2025,
Physics of Language Models Part 4.1, Fig. 7). A run whose metric is NaN (diverged) never wins a cell.

Runs share a cell only when their resolved configs are equal in every other key that can change a result: only the
keys that cannot (``NEUTRAL``: paths, run names, loggers, checkpoint cadence, the resume choice, the loader's worker
count) are ignored. Runs that differ in anything else -- Canon set, positions, ``trainer.max_steps``,
``canon.kernel``, ``optim.weight_decay``, ... -- are split into one table per combination of the keys that vary,
headed by that setting, e.g. ``canon.set=ABCD pos.type=rope`` or ``trainer.max_steps=600``. Under each table its
budget (steps, tokens per run) and what its cells are the best of (e.g. ``each cell the best of optim.lr in {0.001,
0.003} x seed in {1, 2} (4 runs per cell)``) are printed, and written into ``table.md``, ``report.json`` and the
figures' captions. The README's 2 x 2 sweep ``python train.py -m canon=none,ABCD pos=rope,nope`` thus gives four one-cell tables
by default, or one 2 x 2 table with ``--rows canon.set --cols pos.type``. An empty Canon set is labelled ``none``.

A cell is the test split's (else the validation split's) number: Depo ``acc@K / acc@K/2`` in percent (whole-answer
exact match, K = task.K; ``--k 1,2`` shows ``acc@1 / acc@2`` instead, what CPU-budget runs learn); full copy
``whole-copy / per-token`` accuracy in percent; Brevo and Lano the generation accuracy (validator-accepted samples) in
percent; Capo bits per parameter; every other task the overall answer accuracy in percent (Mano: answer token at
l = L). A cell ranks its runs by the first number.

Run directories without a usable ``results.json`` (still running, killed or failed: they hold ``.hydra/``,
``metrics.jsonl`` or ``checkpoints/``) are listed under the tables as ``unfinished or failed: <dir> (last step N from
metrics.jsonl)``. ``--json`` writes every table and that list. Several folders are read as one sweep (a run found
twice counts once); a folder without any run is an error (exit 2, nothing written).

``--out DIR`` also writes, besides printing the tables: ``table.md`` (every table in markdown),
``table[-<setting>].csv`` (one per setting, the paper's layout: rows x columns, ``acc@K/acc@K/2`` or one number per
cell), the heat maps of the paper's Fig. 7 (``heatmap[-<setting>].png``: the number in each cell, colour = accuracy;
``heatmaps[-...].png``: the settings that differ in Canon set or positions side by side on one colour scale), learning
curves of validation accuracy by k over steps from ``metrics.jsonl`` (``curves[-<setting>].png``, each cell's best run)
and ``report.json`` (tables, unfinished runs, what each figure drew; see ``canonlm.train.figures``). In these files the
unfinished or failed runs are put in their cells (their config from ``hparams.json`` or ``.hydra/config.yaml``): a cell
without a finished run is ``n/a (unfinished | failed | diverged | missing)`` in the tables and grey and hatched in the
figures, and a finished cell that also has an unfinished run is marked ``*``. Nothing is overwritten: when DIR already
holds a file of one of these names the report stops with one error (exit 2) and writes nothing, unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from canonlm.utils.io import atomic_write_bytes, atomic_write_text

from canonlm.train.cells import (
    BEST_OF,
    NEUTRAL,
    auto_axes,
    axis_keys,
    cell,
    cell_kind,
    compared_keys,
    compared_label,
    depo_ks,
    find_unfinished,
    label,
    label_order,
    load_runs,
    natural_key,
    protocol,
    table,
    tables,
    under,
    value,
    UNKNOWN,
)


def _fmt(e: dict[str, Any] | None) -> str:
    if e is None:
        return "-"
    hi, lo = e["acc"]
    if lo != lo:  # single-number cell (generation accuracy, bits/param, ...)
        return f"{hi:.3f}" if e["bits"] else f"{100 * hi:5.1f}"
    return f"{100 * hi:5.1f}/{100 * lo:5.1f}"


def format_table(cells: dict[str, dict[str, dict[str, Any]]], rows: str, cols: str) -> list[str]:
    """The text lines of one table: a corner ``rows \\ cols``, then one line per row value."""
    colvals = sorted({c for row in cells.values() for c in row}, key=label_order)
    rowvals = sorted(cells, key=label_order)
    corner = f"{rows} \\ {cols}"
    w0 = max([len(corner)] + [len(r) for r in rowvals])
    texts = {(r, c): _fmt(cells[r].get(c)) for r in rowvals for c in colvals}
    ws = [max([12, len(c)] + [len(texts[r, c]) for r in rowvals]) for c in colvals]
    lines = [f"{corner:>{w0}} | " + " | ".join(f"{c:>{w}}" for c, w in zip(colvals, ws))]
    for r in rowvals:
        lines.append(f"{r:>{w0}} | " + " | ".join(f"{texts[r, c]:>{w}}" for c, w in zip(colvals, ws)))
    return lines


def _unfinished_line(u: dict[str, Any]) -> str:
    step = (
        "no metrics.jsonl"
        if not (Path(u["dir"]) / "metrics.jsonl").is_file()
        else "no step in metrics.jsonl"
        if u["last_step"] is None
        else f"last step {u['last_step']} from metrics.jsonl"
    )
    why = "" if u["reason"] == "no results.json" else f"{u['reason']}; "
    return f"unfinished or failed: {u['dir']} ({why}{step})"


def _finite(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


# ---------------------------------------------------------------------------------------------- report files (--out)

# What a cell that has no number shows: (markdown text, figure text).
STATUS_TEXT = {"unfinished": "unfinished", "failed": "failed", "missing": "missing", "diverged": "diverged"}
_REASON_STATUS = {
    "no results.json": "unfinished",
    "results.json has no test or val result": "failed",
    "unreadable results.json": "failed",
}
# Keys a side-by-side panel figure varies (one panel per value); the other keys of a setting pick the figure.
PANEL_KEYS = ("canon.set", "pos.type", "pos.fraction")
# Named in every figure title, varying or not (with the task): the paper's (arch, canon, pos) setting.
_TITLE_KEYS = {"model.arch": "arch", "canon.set": "canon", "pos.type": "pos"}


def _run_config(d: Path) -> dict[str, Any] | None:
    """The resolved config of a run directory: ``hparams.json`` (written when training starts), else Hydra's
    ``.hydra/config.yaml`` (written before anything is built); None if neither is readable."""
    try:
        cfg = json.loads((d / "hparams.json").read_text())
        if isinstance(cfg, dict) and cfg:
            return cfg
    except (OSError, ValueError):
        pass
    try:
        import yaml

        cfg = yaml.safe_load((d / ".hydra" / "config.yaml").read_text())
        return cfg if isinstance(cfg, dict) and cfg else None
    except Exception:  # noqa: BLE001 -- OSError, yaml.YAMLError: a run without a readable config is skipped
        return None


def place_unfinished(unfinished: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run-like dicts (``config``, ``dir``, ``status``, ``last_step``, ``reason``) for the unfinished or failed runs,
    so they can be put in their cells; ``config`` is None when the directory holds no config (it is then listed
    but placed in no table). ``status``: ``unfinished`` (no results.json) or ``failed``."""
    by_dir = {r["dir"]: r for r in runs}
    out = []
    for u in unfinished:
        d = Path(u["dir"])
        r = dict(by_dir.get(u["dir"], {}))
        if not r.get("config"):
            r["config"] = _run_config(d)
            r["config_unresolved"] = not (d / "hparams.json").is_file()  # Hydra's file: interpolations unresolved
        r.update(
            dir=u["dir"], last_step=u["last_step"], reason=u["reason"], status=_REASON_STATUS.get(u["reason"], "failed")
        )
        out.append(r)
    return out


def _cell_text(acc: tuple[float, float], bits: bool, sep: str = " / ") -> str:
    hi, lo = acc
    if lo != lo:
        return f"{hi:.3f}" if bits else f"{100 * hi:.1f}"
    return f"{100 * hi:.1f}{sep}{100 * lo:.1f}"


def _slug(setting: dict[str, str]) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", "_".join(f"{k}={v}" for k, v in setting.items())).replace("=", "-")


def layout(
    runs: list[dict[str, Any]], placed: list[dict[str, Any]], rows: str, cols: str, best_of: tuple[str, ...] = BEST_OF
) -> list[dict[str, Any]]:
    """The paper's tables with nothing dropped: like ``tables`` (one per setting, best run over the ``best_of`` keys
    per cell -- Fig. 7 of Allen-Zhu 2025 reports the best of four learning rates), but the settings, row values and column values
    also come from the unfinished or failed runs (``place_unfinished``), and every (row, column) pair of a task is a
    cell of each of its settings. Each item: ``setting`` / ``title`` (the keys that vary), ``name`` (task and
    (arch, canon, pos) always named; ``named`` the same as a dict), ``slug``, ``group`` (the setting without
    ``PANEL_KEYS``), ``row_values``,
    ``col_values``, ``kind``, ``bits`` and ``cells[r][c]`` = ``{"status": ok | diverged | unfinished | failed |
    missing, "acc": (acc@K, acc@K/2) or None, "value": colour value (percent, or bits) or None, "text", "dir"
    (best run), "runs" (finished runs), "unfinished": [dirs of this cell's unfinished or failed runs]}``."""
    evaluated = [r for r in runs if cell(r) is not None]
    others = [u for u in placed if u.get("config")]
    every = evaluated + others
    keys = compared_keys(every, rows, cols, best_of)
    axis = axis_keys(every, keys, rows, cols)
    sigs = [{k: compared_label(r, k) for k in keys} for r in every]
    varying = [k for k in keys if len({s[k] for s in sigs} - {UNKNOWN}) > 1 and k not in axis]
    groups: dict[tuple[str, ...], list[int]] = {}
    pending = []
    for i, sig in enumerate(sigs):
        g = tuple(sig[k] for k in varying)
        if UNKNOWN in g:
            pending.append(i)
        else:
            groups.setdefault(g, []).append(i)
    for i in pending:  # an unfinished run with unresolved values joins the setting its other values match
        g = tuple(sigs[i][k] for k in varying)
        match = next((h for h in groups if all(a in (UNKNOWN, b) for a, b in zip(g, h))), g)
        groups.setdefault(match, []).append(i)
    # row / column values per task: a setting that lacks a (row, col) pair its task has elsewhere shows it missing
    task_of = [label("task.name", value(r, "task.name")) for r in every]
    rv_task: dict[str, set[str]] = {}
    cv_task: dict[str, set[str]] = {}
    for r, t in zip(every, task_of):
        rv_task.setdefault(t, set()).add(label(rows, value(r, rows)))
        cv_task.setdefault(t, set()).add(label(cols, value(r, cols)))
    out = []
    for g in sorted(groups, key=lambda t: tuple(label_order(x) for x in t)):
        idx = groups[g]
        setting = {k: label(k, value(every[idx[0]], k)) for k in varying}
        fin = [every[i] for i in idx if i < len(evaluated)]
        unf = [every[i] for i in idx if i >= len(evaluated)]
        first = every[idx[0]]
        task = task_of[idx[0]]
        best = table(fin, rows, cols, best_of) if fin else {}
        rvals = sorted(rv_task[task], key=label_order)
        cvals = sorted(cv_task[task], key=label_order)
        kinds = {cell_kind(r) for r in fin}
        kind = kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "answer accuracy (%)")
        bits = kind == "bits per parameter"
        cells: dict[str, dict[str, dict[str, Any]]] = {}
        for rv in rvals:
            for cv in cvals:
                mine = [u["dir"] for u in unf if (label(rows, value(u, rows)), label(cols, value(u, cols))) == (rv, cv)]
                e = best.get(rv, {}).get(cv)
                if e is not None and e["acc"][0] == e["acc"][0]:
                    v = e["acc"][0] if e["bits"] else 100 * e["acc"][0]
                    text = _cell_text(e["acc"], e["bits"]) + ("*" if mine else "")
                    c = {"status": "ok", "acc": e["acc"], "value": v, "text": text, "dir": e["dir"], "runs": e["runs"]}
                else:
                    if e is not None:
                        status = "diverged"
                    elif mine:
                        st = {u["status"] for u in unf if u["dir"] in mine}
                        status = "unfinished" if "unfinished" in st else "failed"
                    else:
                        status = "missing"
                    c = {
                        "status": status,
                        "acc": None,
                        "value": None,
                        "text": "n/a (" + STATUS_TEXT[status] + ")",
                        "dir": e["dir"] if e else None,
                        "runs": e["runs"] if e else 0,
                    }
                c["unfinished"] = mine
                c["last_step"] = max(
                    [u["last_step"] for u in unf if u["dir"] in mine and u["last_step"] is not None], default=None
                )
                cells.setdefault(rv, {})[cv] = c
        named = {"task.name": task}
        named.update({k: label(k, value(first, k)) for k in _TITLE_KEYS})
        if named.get("pos.type") == "partial_rope":
            named["pos.fraction"] = label("pos.fraction", value(first, "pos.fraction"))
        named.update(setting)
        named = {_TITLE_KEYS.get(k, k): v for k, v in named.items() if k not in ("task.name", rows, cols)}
        name = f"{task}: " + " ".join(f"{k}={v}" for k, v in named.items())
        out.append(
            {
                "setting": setting,
                "title": " ".join(f"{k}={v}" for k, v in setting.items()),
                "name": name,
                "named": named,
                "slug": _slug(setting),
                "group": {k: v for k, v in setting.items() if k not in PANEL_KEYS},
                "task": task,
                "row_values": rvals,
                "col_values": cvals,
                "kind": kind,
                "bits": bits,
                "cells": cells,
                "protocol": protocol(fin, best_of, best, rows, cols),
            }
        )
    return out


def markdown(
    lay: list[dict[str, Any]],
    rows: str,
    cols: str,
    roots: list[Path],
    placed: list[dict[str, Any]],
    figures: dict[str, list[str]],
) -> str:
    """The tables as markdown: one per setting, rows ``rows`` values, columns ``cols`` values, each cell the best
    run over the learning rates (``n/a (unfinished)`` etc. where there is none), then the unfinished runs."""
    lines = ["# Sweep report", "", "Runs below: " + ", ".join(f"`{r}`" for r in roots), ""]
    for t in lay:
        lines += [f"## {t['name']}", "", f"Cells: {t['kind']} (test split, else val). {t['protocol']['text']}.", ""]
        lines.append(f"| {rows} \\ {cols} | " + " | ".join(t["col_values"]) + " |")
        lines.append("|---|" + "---:|" * len(t["col_values"]))
        for rv in t["row_values"]:
            lines.append(f"| {rv} | " + " | ".join(t["cells"][rv][cv]["text"] for cv in t["col_values"]) + " |")
        lines.append("")
        figs = figures.get(t["slug"], [])
        if figs:
            lines += [" ".join(f"![{f}]({f})" for f in figs), ""]
    if any(c["unfinished"] and c["status"] == "ok" for t in lay for row in t["cells"].values() for c in row.values()):
        lines += [
            "`*`: another run of this cell is unfinished or failed; the cell is the best of the finished ones.",
            "",
        ]
    if placed:
        lines += ["## Unfinished or failed runs", ""]
        for u in placed:
            where = "" if u.get("config") else " (no hparams.json or .hydra/config.yaml: in no table)"
            lines.append(f"- {_unfinished_line(u)}{where}")
        lines.append("")
    return "\n".join(lines)


def csv_table(t: dict[str, Any], rows: str, cols: str) -> str:
    """One setting's table as CSV in the paper's layout: a corner ``rows \\ cols``, the column values, then one line
    per row value; a cell is ``acc@K/acc@K/2`` (Depo) or one number, ``n/a`` where no finished run has one."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([f"{rows} \\ {cols}"] + t["col_values"])
    for rv in t["row_values"]:
        w.writerow(
            [rv]
            + [
                _cell_text(c["acc"], t["bits"], "/") if c["status"] == "ok" else "n/a"
                for c in (t["cells"][rv][cv] for cv in t["col_values"])
            ]
        )
    return buf.getvalue()


def _json_cell(c: dict[str, Any]) -> dict[str, Any]:
    return {
        "status": c["status"],
        "acc": None if c["acc"] is None else [_finite(x) for x in c["acc"]],
        "text": c["text"],
        "dir": c["dir"],
        "runs": c["runs"],
        "unfinished": c["unfinished"],
        "last_step": c["last_step"],
    }


def build_outputs(
    roots: list[Path],
    runs: list[dict[str, Any]],
    unfinished: list[dict[str, Any]],
    rows: str,
    cols: str,
    best_of: tuple[str, ...] = BEST_OF,
) -> dict[str, bytes]:
    """Every file of ``--out``, by name, rendered in memory (nothing is written here): ``table.md``, one CSV per
    setting, one Fig. 7-style heat map per setting, side-by-side panels for the settings that differ only in Canon
    set or positions, learning curves per setting, and ``report.json`` (tables, unfinished runs, figure geometry)."""
    from canonlm.train import figures

    placed = place_unfinished(unfinished, runs)
    lay = layout(runs, placed, rows, cols, best_of)
    files: dict[str, bytes] = {}
    figs: list[dict[str, Any]] = []
    per_setting: dict[str, list[str]] = {}
    unplaced = [u["dir"] for u in placed if not u.get("config")]
    for i, t in enumerate(lay):
        sfx = f"-{t['slug']}" if t["slug"] else ""
        files[f"table{sfx}.csv"] = csv_table(t, rows, cols).encode()
        name = f"heatmap{sfx}.png"
        png, info = figures.heatmap([t], rows=rows, cols=cols, title=t["name"], unplaced=unplaced)
        files[name] = png
        figs.append({"file": name, "type": "heatmap", "tables": [i], **info})
        cname = f"curves{sfx}.png"
        png, info = figures.curves(t, rows=rows, cols=cols, title=t["name"])
        files[cname] = png
        figs.append({"file": cname, "type": "curves", "tables": [i], **info})
        per_setting[t["slug"]] = [name, cname]
    # side-by-side panels (shared colour scale): settings of one task and group that differ in canon / pos only
    pgroups: dict[tuple, list[int]] = {}
    for i, t in enumerate(lay):
        if any(k in PANEL_KEYS for k in t["setting"]):
            pgroups.setdefault((t["task"], tuple(t["group"].items()), t["kind"]), []).append(i)
    for (task, group, _), idx in pgroups.items():
        if len(idx) < 2:
            continue
        gs = _slug(dict(group))
        name = f"heatmaps{'-' + gs if gs else ''}.png"
        ts = [lay[i] for i in idx]
        # the title names what all panels share: the task, the (arch, canon, pos) keys that do not vary, the group
        varied = {_TITLE_KEYS.get(k, k) for k in ts[0]["setting"] if k in PANEL_KEYS}
        title = f"{task}: " + " ".join(f"{k}={v}" for k, v in ts[0]["named"].items() if k not in varied)
        # canon x pos (two panel keys, every combination present): panels in a grid, one line per Canon set
        vary = [k for k in PANEL_KEYS if k in ts[0]["setting"]]
        ncols = None
        if len(vary) == 2:
            second = sorted({t["setting"][vary[1]] for t in ts}, key=label_order)
            if len(ts) == len({t["setting"][vary[0]] for t in ts}) * len(second):
                ncols = len(second)
        png, info = figures.heatmap(ts, rows=rows, cols=cols, title=title, unplaced=unplaced, ncols=ncols)
        files[name] = png
        figs.append({"file": name, "type": "panels", "tables": idx, **info})
        for i in idx:
            per_setting[lay[i]["slug"]].append(name)
    files["table.md"] = markdown(lay, rows, cols, roots, placed, per_setting).encode()
    doc = {
        "roots": [str(r) for r in roots],
        "rows": rows,
        "cols": cols,
        "tables": [
            {
                "setting": t["setting"],
                "title": t["title"],
                "name": t["name"],
                "kind": t["kind"],
                "protocol": t["protocol"],
                "row_values": t["row_values"],
                "col_values": t["col_values"],
                "csv": f"table{'-' + t['slug'] if t['slug'] else ''}.csv",
                "cells": {r: {c: _json_cell(e) for c, e in row.items()} for r, row in t["cells"].items()},
            }
            for t in lay
        ],
        "unfinished": [
            {
                "dir": u["dir"],
                "last_step": u["last_step"],
                "reason": u["reason"],
                "status": u["status"],
                "placed": bool(u.get("config")),
            }
            for u in placed
        ],
        "figures": figs,
    }
    files["report.json"] = json.dumps(doc, indent=1).encode()
    return files


def write_outputs(out: Path, files: dict[str, bytes], force: bool) -> str | None:
    """Write ``files`` into ``out`` (created if needed); None, or the error message (nothing written) when ``out``
    is not a directory or already holds a file of the same name and ``force`` is off."""
    if out.exists() and not out.is_dir():
        return f"--out {out} exists and is not a directory"
    clash = sorted(n for n in files if (out / n).exists())
    if clash and not force:
        return (
            f"--out {out} already holds {', '.join(clash)}; nothing written (another --out, or --force to "
            "replace these files)"
        )
    bad = [n for n in clash if not (out / n).is_file()]
    if bad:
        return f"--out {out}: {', '.join(bad)} exist and are not files; nothing written"
    for n, data in files.items():
        atomic_write_bytes(out / n, data)
    return None


def _checked(args: argparse.Namespace) -> tuple[tuple[int, int] | None, tuple[str, ...]]:
    """``(--k hop counts or None, --best-of keys)``; ValueError with the message for a bad value or a folder that
    is not a directory (nothing is read or written before)."""
    ks = None
    if args.k is not None:
        try:
            ks = tuple(int(x) for x in args.k.split(","))
        except ValueError:
            ks = ()
        if len(ks) != 2 or min(ks) < 1:
            raise ValueError(f"--k {args.k!r}: two positive hop counts are allowed, e.g. --k 1,2")
    if args.best_of is None:
        best_of = tuple(k for k in BEST_OF if k not in (args.rows, args.cols))
    else:
        best_of = tuple(k.strip() for k in args.best_of.split(",") if k.strip())
        axes = (args.rows, args.cols, "task.name")
        clash = [k for k in best_of if under(k, NEUTRAL) or any(a == k or a.startswith(k + ".") for a in axes)]
        if clash or not best_of or any(not re.fullmatch(r"[A-Za-z_][\w.]*", k) for k in best_of):
            why = (
                "not a list of config keys"
                if not clash
                else f"{clash[0]} is a key that cannot change a result"
                if under(clash[0], NEUTRAL)
                else f"{clash[0]} is (or holds) --rows, --cols or task.name"
            )
            raise ValueError(
                f"--best-of {args.best_of!r}: {why}; allowed: comma-separated config keys other than "
                "--rows and --cols, e.g. optim.lr,seed,task.seed"
            )
    bad = [str(r) for r in args.roots if not r.is_dir()]
    if bad:
        raise ValueError(f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a directory")
    return ks, best_of


def _read_roots(roots: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """``(finished runs, unfinished runs, roots without any run)`` below ``roots``; a run found under two roots
    counts once."""
    runs: list[dict[str, Any]] = []
    unfinished: list[dict[str, Any]] = []
    empty = []
    seen: set[str] = set()
    seen_u: set[str] = set()
    for root in roots:
        rr = load_runs(root)
        uu = find_unfinished(root, rr)
        if not rr and not uu:
            empty.append(str(root))
        for r in rr:
            if str(Path(r["dir"]).resolve()) not in seen:
                seen.add(str(Path(r["dir"]).resolve()))
                runs.append(r)
        for u in uu:
            if str(Path(u["dir"]).resolve()) not in seen_u:
                seen_u.add(str(Path(u["dir"]).resolve()))
                unfinished.append(u)
    return runs, unfinished, empty


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m canonlm.train.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "roots",
        type=Path,
        nargs="+",
        metavar="dir",
        help="sweep (multirun) folders, run directories, or any folders holding run directories",
    )
    ap.add_argument(
        "--rows",
        default="task.N",
        help="config key of the rows (default: task.N); auto: the first key that varies among the runs (see --cols)",
    )
    ap.add_argument(
        "--cols",
        default="model.size",
        help="config key of the columns (default: model.size); auto: the "
        "second key that varies among the runs, or the only one (then the rows are task.name); the "
        "learning rate and seeds a cell takes its best over never count. A sweep's closing report uses "
        "auto for both unless its preset names them",
    )
    ap.add_argument(
        "--k",
        metavar="K1,K2",
        help="Depo cells: accuracy at these two hop counts, e.g. 1,2 (default: K "
        "and K/2, the paper's layout; at CPU budgets only k=1 is learnt)",
    )
    ap.add_argument(
        "--best-of",
        default=None,
        metavar="KEY,KEY",
        help=f"config keys a cell takes its best run over (default: {','.join(BEST_OF)}, the learning "
        "rate and the seeds, less --rows / --cols); runs that differ in any other key that can change "
        "a result are never merged",
    )
    ap.add_argument("--json", type=Path, help="also write every table and the unfinished runs to this file")
    ap.add_argument("--out", type=Path, help="write table.md, CSV tables, PNG figures and report.json here")
    ap.add_argument("--force", action="store_true", help="with --out: replace files of the same names")
    ap.add_argument(
        "--wandb",
        action="store_true",
        help="with --out: also log the figures and tables as one wandb "
        "run (job_type report, the sweep's group; offline unless WANDB_MODE is set)",
    )
    args = ap.parse_args(argv)
    if args.wandb and args.out is None:
        ap.error("--wandb needs --out (the figures it logs are the files written there)")
    if args.wandb:
        from canonlm.errors import ConfigError
        from canonlm.train.wandb_utils import require_wandb

        try:
            require_wandb("--wandb", "true", "no --wandb")
        except ConfigError as e:
            ap.error(str(e))
    try:
        ks, best_of = _checked(args)
    except ValueError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    runs, unfinished, empty = _read_roots(args.roots)
    if "auto" in (args.rows, args.cols):
        evaluated = [r for r in runs if cell(r) is not None] or runs
        rows, cols = auto_axes(evaluated, best_of)
        args.rows = rows if args.rows == "auto" else args.rows
        args.cols = cols if args.cols == "auto" else args.cols
        if args.rows == args.cols:  # one axis named, auto picked the same key for the other
            args.cols = "model.size" if args.rows != "model.size" else "task.N"
        if args.best_of is None:
            best_of = tuple(k for k in BEST_OF if k not in (args.rows, args.cols))
        print(
            f"report: rows {args.rows}, columns {args.cols} (auto: the keys that vary among the runs)", file=sys.stderr
        )
    if ks is not None:
        for r in runs:
            r["report_k"] = ks
        depo = [r for r in runs if depo_ks(r) is not None]
        evaluated = {g for r in depo for g in ((r.get("test") or r.get("val") or {}).get("by_group") or {})}
        if depo and str(ks[0]) not in evaluated:
            print(
                f"report: error: --k {args.k}: no Depo run has an accuracy at k={ks[0]} (evaluated at k in "
                f"{{{', '.join(sorted(evaluated, key=natural_key))}}})",
                file=sys.stderr,
            )
            return 2
    if empty:
        print(
            f"report: error: no runs below {', '.join(empty)} (no results.json, metrics.jsonl, checkpoints/ or "
            ".hydra/)",
            file=sys.stderr,
        )
        return 2
    unset = [k for k in best_of if args.best_of is not None and all(value(r, k) is None for r in runs)]
    if runs and unset:
        print(
            f"report: error: --best-of {args.best_of!r}: no run sets {unset[0]} (a typo? the runs' keys are in "
            "their hparams.json)",
            file=sys.stderr,
        )
        return 2
    # a finished run counted in two roots is one run; an unfinished one found again as finished stays finished
    done = {r["dir"] for r in runs if cell(r) is not None}
    unfinished = [u for u in unfinished if u["dir"] not in done]
    files = None
    if args.out is not None:
        files = build_outputs(list(args.roots), runs, unfinished, args.rows, args.cols, best_of)
        err = write_outputs(args.out, files, args.force)
        if err:
            print(f"report: error: {err}", file=sys.stderr)
            return 2
        if args.wandb:
            from canonlm.train.wandb_utils import log_report

            print(f"wandb: report logged in {log_report(args.out, files, list(args.roots), runs)}", file=sys.stderr)
    ts = tables(runs, args.rows, args.cols, best_of)
    for key in (args.rows, args.cols):
        if ts and all(value(r, key) is None for r in runs if cell(r) is not None):
            print(f"report: note: no run sets {key}; its value shows as None", file=sys.stderr)
    for i, t in enumerate(ts):
        if i:
            print()
        if t["title"]:
            print(t["title"])
        print("\n".join(format_table(t["cells"], args.rows, args.cols)))
        print(t["protocol"]["text"])
    if ts:
        kinds = sorted({e["kind"] for t in ts for row in t["cells"].values() for e in row.values()})
        print(f"\ncells: {', '.join(kinds)} (test split, else val)")
    else:
        print("no finished runs")
    if unfinished:
        print()
        for u in unfinished:
            print(_unfinished_line(u))
    if args.json:
        doc = {
            "rows": args.rows,
            "cols": args.cols,
            "tables": [
                {
                    "setting": t["setting"],
                    "title": t["title"],
                    "protocol": t["protocol"],
                    "cells": {
                        r: {
                            c: {"acc": [_finite(x) for x in e["acc"]], "dir": e["dir"], "runs": e["runs"]}
                            for c, e in row.items()
                        }
                        for r, row in t["cells"].items()
                    },
                }
                for t in ts
            ],
            "unfinished": unfinished,
        }
        atomic_write_text(args.json, json.dumps(doc, indent=1))
    if files is not None:
        print(f"\nwrote {len(files)} files to {args.out}: {', '.join(sorted(files))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
