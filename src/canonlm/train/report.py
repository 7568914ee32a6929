"""Paper-style tables from a sweep: ``python -m canonlm.train.report <sweep dir> [--rows task.N] [--cols model.size]
[--json out.json]``.

Reads every run below the folder: its ``results.json`` (written by ``train.py`` when the run ends) and the resolved
config ``hparams.json`` beside it. Runs are put in cells by the values of the ``--rows`` and ``--cols`` config keys,
and a cell shows its best run over the learning rates and seeds it holds: the paper reports, for each cell, the best
of the learning rates it tried (Allen-Zhu, 2025, Physics of Language Models Part 4.1). A run whose metric is NaN
(diverged) never wins a cell.

When the runs also differ in other keys that define *what* is compared (``IDENTITY``: task, architecture, Canon set,
positional encoding, qk-norm, MLP, model size, task parameters), one table is printed per combination of the keys
that vary, headed by that setting, e.g. ``canon.set=ABCD pos.type=rope``; runs of different settings never share a
cell. The README's 2 x 2 sweep ``python train.py -m canon=none,ABCD pos=rope,nope`` thus gives four one-cell tables
by default, or one 2 x 2 table with ``--rows canon.set --cols pos.type``. An empty Canon set is labelled ``none``.

A cell is the test split's (else the validation split's) number: Depo ``acc@K / acc@K/2`` in percent (whole-answer
exact match, K = task.K); Brevo and Lano the generation accuracy (validator-accepted samples) in percent; Capo bits
per parameter; every other task the overall answer accuracy in percent (Mano: answer token at l = L; fullcopy: whole
copy).

Run directories without a usable ``results.json`` (still running, killed or failed: they hold ``.hydra/``,
``metrics.jsonl`` or ``checkpoints/``) are listed under the tables as ``unfinished or failed: <dir> (last step N from
metrics.jsonl)``. ``--json`` writes every table and that list. A folder without any run is an error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from canonlm.train.metrics_file import read_metrics


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part, {}) if isinstance(d, dict) else {}
    return d if d != {} else None


def _natural(p: Path | str) -> list[Any]:
    """Sort key that puts multirun job 2 before job 10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def load_runs(root: Path) -> list[dict[str, Any]]:
    """Each finished run: its results.json plus its resolved config (``hparams.json`` beside it) and ``dir``.
    A results.json that does not parse is left out here (``find_unfinished`` lists it)."""
    runs = []
    for res in sorted(Path(root).rglob("results.json"), key=_natural):
        try:
            r = json.loads(res.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(r, dict):
            continue
        hp = res.parent / "hparams.json"
        try:
            r["config"] = json.loads(hp.read_text()) if hp.exists() else {}
        except (OSError, ValueError):
            r["config"] = {}
        r["dir"] = str(res.parent)
        runs.append(r)
    return runs


def last_step(run_dir: Path) -> int | None:
    """The last step logged in ``<run_dir>/metrics.jsonl`` (resumes and torn lines handled), None if none."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    try:
        rows = read_metrics(path)
    except OSError:
        return None
    return rows[-1]["step"] if rows else None


def find_unfinished(root: Path, runs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Run directories below ``root`` that hold ``.hydra/``, ``metrics.jsonl`` or ``checkpoints/`` but no usable
    results.json (missing, unreadable, or without any test / val result), each ``{"dir", "last_step", "reason"}``."""
    root = Path(root)
    runs = load_runs(root) if runs is None else runs
    evaluated = {r["dir"] for r in runs if cell(r) is not None}
    finished = {r["dir"] for r in runs}
    dirs: set[Path] = set()
    dirs |= {p.parent for p in root.rglob(".hydra") if p.is_dir()}
    dirs |= {p.parent for p in root.rglob("checkpoints") if p.is_dir()}
    dirs |= {p.parent for p in root.rglob("metrics.jsonl") if p.is_file()}
    dirs |= {Path(r["dir"]) for r in runs}  # finished runs without a test / val result
    dirs |= {p.parent for p in root.rglob("results.json")}  # unreadable results.json
    out = []
    for d in sorted(dirs, key=_natural):
        if str(d) in evaluated:
            continue
        res = d / "results.json"
        if not res.exists():
            reason = "no results.json"
        elif str(d) in finished:
            reason = "results.json has no test or val result"
        else:
            reason = "unreadable results.json"
        out.append({"dir": str(d), "last_step": last_step(d), "reason": reason})
    return out


def cell(run: dict[str, Any]) -> tuple[float, float] | None:
    """(acc at k=K, acc at k=K/2) of a run's test (else val) split, or None if absent."""
    split = run.get("test") or run.get("val")
    if not split:
        return None
    nan = float("nan")
    if "generate" in split:
        return split["generate"]["acc"], nan
    if "bits_per_param" in (split.get("task_metrics") or {}):
        return split["task_metrics"]["bits_per_param"], nan
    K = _get(run["config"], "task.K") or run.get("task_config", {}).get("K")
    if not K or not str(run.get("task", "depo")).startswith("depo"):
        acc = (split.get("overall") or {}).get("acc")
        return None if acc is None else (acc, nan)
    by = split.get("by_group") or {}
    hi, lo = by.get(str(K)), by.get(str(K // 2))
    if hi is None:
        return None
    return hi["acc"], (lo["acc"] if lo else float("nan"))


def _kind(run: dict[str, Any]) -> str:
    """What a run's cell shows (the legend under the tables); the same cases as ``cell``."""
    split = run.get("test") or run.get("val") or {}
    if "generate" in split:
        return "generation accuracy (%)"
    if "bits_per_param" in (split.get("task_metrics") or {}):
        return "bits per parameter"
    K = _get(run["config"], "task.K") or run.get("task_config", {}).get("K")
    if K and str(run.get("task", "depo")).startswith("depo"):
        return "acc@K / acc@K/2 (%)"
    return "answer accuracy (%)"


# Keys that define *what* is compared; within one cell only the lr and the seeds may vary (the paper's "best of").
IDENTITY = ("task.name", "model.arch", "canon.set", "pos.type", "pos.fraction", "model.qk_norm", "model.mlp",
            "model.size", "task.N", "task.K", "task.L", "task.grammar")

# Where results.json keeps an identity key, for runs without hparams.json.
_FROM_RESULTS = {"task.name": ("task",), "model.arch": ("model", "arch"), "canon.set": ("model", "canon"),
                 "pos.type": ("model", "pos"), "model.qk_norm": ("model", "qk_norm")}


def _value(run: dict[str, Any], key: str) -> Any:
    if key == "model.size" and run.get("model", {}).get("size"):  # the built size (n_layers / d_model overrides)
        return run["model"]["size"]
    if run.get("config"):
        return _get(run["config"], key)
    if key in _FROM_RESULTS:
        return _get(run, ".".join(_FROM_RESULTS[key]))
    if key.startswith("task."):
        return _get(run.get("task_config") or {}, key[len("task."):])
    return None


def label(key: str, value: Any) -> str:
    """How a config value is printed: an empty (or null) Canon set is ``none``."""
    if key == "canon.set" and value in (None, ""):
        return "none"
    return str(value)


def _order(lab: str) -> tuple:
    """Sort key of labels: none first, then numbers by value, then strings by length (8L512D before 12L512D, A
    before AB before ABCD)."""
    if lab in ("none", "None", ""):
        return (0, 0.0, "")
    try:
        x = float(lab)
        if x == x:
            return (1, x, "")
    except ValueError:
        pass
    return (2, len(lab), lab)


def _rank(c: tuple[float, float]) -> tuple[float, float]:
    """Cell order: acc@K, then acc@K/2; NaN (diverged) loses, a missing acc@K/2 counts as 0."""
    return (float("-inf") if c[0] != c[0] else c[0], 0.0 if c[1] != c[1] else c[1])


def table(runs: list[dict[str, Any]], rows: str, cols: str) -> dict[str, dict[str, dict[str, Any]]]:
    """{row label: {col label: {"acc": (hi, lo), "dir": best run dir, "runs": n}}} of runs of ONE setting: best by
    acc@K then acc@K/2 over the runs of a cell, which may differ only in learning rate and seeds (the paper's
    best-of); runs that differ in an identity key (Canon set, positions, architecture, task, ...) raise ValueError
    naming it (``tables`` splits a sweep into settings first). NaN (diverged) loses."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    ident: dict[tuple[str, str], tuple] = {}
    keys = [k for k in IDENTITY if k not in (rows, cols)]
    for r in runs:
        c = cell(r)
        if c is None:
            continue
        rv, cv = label(rows, _value(r, rows)), label(cols, _value(r, cols))
        sig = tuple(label(k, _value(r, k)) for k in keys)
        prev = ident.setdefault((rv, cv), sig)
        if prev != sig:
            diff = [f"{k}={a} vs {b}" for k, a, b in zip(keys, prev, sig) if a != b]
            raise ValueError(f"cell ({rows}={rv}, {cols}={cv}) mixes runs that differ in {', '.join(diff)}")
        best = out.setdefault(rv, {}).get(cv)
        n = 1 + (best["runs"] if best else 0)
        if best is None or _rank(c) > best["key"]:
            bits = "bits_per_param" in ((r.get("test") or r.get("val") or {}).get("task_metrics") or {})
            out[rv][cv] = {"acc": c, "key": _rank(c), "dir": r["dir"], "bits": bits, "kind": _kind(r)}
        out[rv][cv]["runs"] = n
    return out


def tables(runs: list[dict[str, Any]], rows: str, cols: str) -> list[dict[str, Any]]:
    """One table per setting: the runs (with a test or val result) are split by the identity keys other than
    ``rows`` / ``cols`` that take more than one value among them. Each item: ``{"setting": {key: label},
    "title": "key=label key=label", "cells": table(...)}``, in the order none < numbers < strings by length."""
    keys = [k for k in IDENTITY if k not in (rows, cols)]
    evaluated = [r for r in runs if cell(r) is not None]
    sigs = [{k: label(k, _value(r, k)) for k in keys} for r in evaluated]
    varying = [k for k in keys if len({s[k] for s in sigs}) > 1]
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r, s in zip(evaluated, sigs):
        groups.setdefault(tuple(s[k] for k in varying), []).append(r)
    out = []
    for g in sorted(groups, key=lambda t: tuple(_order(x) for x in t)):
        setting = dict(zip(varying, g))
        out.append({"setting": setting, "title": " ".join(f"{k}={v}" for k, v in setting.items()),
                    "cells": table(groups[g], rows, cols)})
    return out


def _fmt(e: dict[str, Any] | None) -> str:
    if e is None:
        return "-"
    hi, lo = e["acc"]
    if lo != lo:  # single-number cell (generation accuracy, bits/param, ...)
        return f"{hi:.3f}" if e["bits"] else f"{100 * hi:5.1f}"
    return f"{100 * hi:5.1f}/{100 * lo:5.1f}"


def format_table(cells: dict[str, dict[str, dict[str, Any]]], rows: str, cols: str) -> list[str]:
    """The text lines of one table: a corner ``rows \\ cols``, then one line per row value."""
    colvals = sorted({c for row in cells.values() for c in row}, key=_order)
    rowvals = sorted(cells, key=_order)
    corner = f"{rows} \\ {cols}"
    w0 = max([len(corner)] + [len(r) for r in rowvals])
    texts = {(r, c): _fmt(cells[r].get(c)) for r in rowvals for c in colvals}
    ws = [max([12, len(c)] + [len(texts[r, c]) for r in rowvals]) for c in colvals]
    lines = [f"{corner:>{w0}} | " + " | ".join(f"{c:>{w}}" for c, w in zip(colvals, ws))]
    for r in rowvals:
        lines.append(f"{r:>{w0}} | " + " | ".join(f"{texts[r, c]:>{w}}" for c, w in zip(colvals, ws)))
    return lines


def _unfinished_line(u: dict[str, Any]) -> str:
    step = ("no metrics.jsonl" if not (Path(u["dir"]) / "metrics.jsonl").is_file() else
            "no step in metrics.jsonl" if u["last_step"] is None else f"last step {u['last_step']} from metrics.jsonl")
    why = "" if u["reason"] == "no results.json" else f"{u['reason']}; "
    return f"unfinished or failed: {u['dir']} ({why}{step})"


def _finite(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m canonlm.train.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="a sweep (multirun) folder, or any folder holding run directories")
    ap.add_argument("--rows", default="task.N", help="config key of the rows (default: task.N)")
    ap.add_argument("--cols", default="model.size", help="config key of the columns (default: model.size)")
    ap.add_argument("--json", type=Path, help="also write every table and the unfinished runs to this file")
    args = ap.parse_args(argv)
    if not args.root.is_dir():
        print(f"report: error: {args.root} is not a directory", file=sys.stderr)
        return 2
    runs = load_runs(args.root)
    unfinished = find_unfinished(args.root, runs)
    if not runs and not unfinished:
        print(f"report: error: no runs below {args.root} (no results.json, metrics.jsonl, checkpoints/ or .hydra/)",
              file=sys.stderr)
        return 2
    ts = tables(runs, args.rows, args.cols)
    for key in (args.rows, args.cols):
        if ts and all(_value(r, key) is None for r in runs if cell(r) is not None):
            print(f"report: note: no run sets {key}; its value shows as None", file=sys.stderr)
    for i, t in enumerate(ts):
        if i:
            print()
        if t["title"]:
            print(t["title"])
        print("\n".join(format_table(t["cells"], args.rows, args.cols)))
    if ts:
        kinds = sorted({e["kind"] for t in ts for row in t["cells"].values() for e in row.values()})
        print(f"\ncells: {', '.join(kinds)}; the best run over learning rates and seeds (test split, else val)")
    else:
        print("no finished runs")
    if unfinished:
        print()
        for u in unfinished:
            print(_unfinished_line(u))
    if args.json:
        doc = {"rows": args.rows, "cols": args.cols,
               "tables": [{"setting": t["setting"], "title": t["title"],
                           "cells": {r: {c: {"acc": [_finite(x) for x in e["acc"]], "dir": e["dir"],
                                             "runs": e["runs"]} for c, e in row.items()}
                                     for r, row in t["cells"].items()}} for t in ts],
               "unfinished": unfinished}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
