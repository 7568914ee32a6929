"""Which runs of a sweep share a cell, and what a cell shows (the rules of :mod:`canonlm.train.report`).

Reading: :func:`load_runs` (each finished run's ``results.json`` with its settings: ``hparams.json``, else Hydra's
``.hydra/config.yaml``, else the run is in no cell and named by :func:`find_unfinished`), :func:`find_unfinished`
(run directories without a usable result). A run's value of a config key (:func:`_value`,
:func:`label`), the two numbers of its cell (:func:`cell`: Depo acc@K / acc@K/2, full copy whole / per-token, else
one number). Grouping: runs share a cell only when their resolved configs are equal in every key
(:func:`compared_keys`) except the rows / columns keys, the ``best_of`` keys (:data:`BEST_OF`: learning rate and
seeds, the paper's best-of, Part 4.1 Fig. 7) and the keys that cannot change a result (:data:`NEUTRAL`);
:func:`tables` splits a sweep into one table per setting, :func:`table` takes each cell's best run, :func:`protocol`
states a table's budget and what its cells are the best of.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from canonlm.train.metrics_file import read_metrics


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part, {}) if isinstance(d, dict) else {}
    return d if d != {} else None


def natural_key(p: Path | str) -> list[Any]:
    """Sort key that puts multirun job 2 before job 10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


#: Why a finished run is in no cell when neither of its settings files can be read (``find_unfinished``).
NO_SETTINGS = "no readable hparams.json or .hydra/config.yaml: its settings are unknown, so it is compared with no run"


def _hydra_settings(path: Path) -> dict[str, Any] | None:
    """The settings of a run from Hydra's ``.hydra/config.yaml`` (written by ``train.py`` once the config passed its
    checks): every leaf resolved with OmegaConf and canonlm's value resolvers (``${canonlm_steps:...}``,
    ``${task.N}``, ...); a leaf that does not resolve outside the job (``${hydra:...}``, ``${now:...}``: paths and
    names, which never split a cell) keeps its text, so it is compared as written and never guessed. None when the
    file is missing, does not parse or is not a mapping."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        from canonlm.config.resolvers import register_value_resolvers

        register_value_resolvers()
        cfg = OmegaConf.load(path)
        if not isinstance(cfg, DictConfig) or not len(cfg):
            return None
        raw = OmegaConf.to_container(cfg, resolve=False)
    except Exception:  # noqa: BLE001 -- OSError, YAML and OmegaConf errors: unreadable
        return None

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, key + ".")
                continue
            if "${" not in json.dumps(v, default=str):
                continue
            try:
                got = OmegaConf.select(cfg, key, throw_on_missing=True)
                node[k] = (
                    OmegaConf.to_container(got, resolve=True) if isinstance(got, (DictConfig, ListConfig)) else got
                )
            except Exception:  # noqa: BLE001 -- an interpolation only the job could resolve: keep its text
                pass

    walk(raw, "")
    return raw


def read_settings(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(settings, the file they come from) of a run directory: ``hparams.json`` (the resolved config the run wrote
    when training started) when it is a readable, non-empty JSON object, else ``.hydra/config.yaml``
    (:func:`_hydra_settings`); (None, None) when neither can be read: such a run is compared with no other run
    (:data:`NO_SETTINGS`), never guessed from ``results.json``."""
    hp = Path(run_dir) / "hparams.json"
    try:
        cfg = json.loads(hp.read_text())
        if isinstance(cfg, dict) and cfg:
            return cfg, "hparams.json"
    except (OSError, ValueError):
        pass
    cfg = _hydra_settings(Path(run_dir) / ".hydra" / "config.yaml")
    return (cfg, ".hydra/config.yaml") if cfg is not None else (None, None)


def _results(res: Path) -> dict[str, Any] | None:
    try:
        r = json.loads(res.read_text())
    except (OSError, ValueError):
        return None
    return r if isinstance(r, dict) else None


def load_runs(root: Path) -> list[dict[str, Any]]:
    """Each finished run: its results.json plus its settings (``config``: :func:`read_settings`, from ``hparams.json``
    or else ``.hydra/config.yaml``; ``config_source`` names the file) and ``dir``. A results.json that does not parse,
    and a run whose settings cannot be read, are left out here (``find_unfinished`` lists them by name)."""
    runs = []
    for res in sorted(Path(root).rglob("results.json"), key=natural_key):
        r = _results(res)
        if r is None:
            continue
        cfg, source = read_settings(res.parent)
        if cfg is None:
            continue
        r["config"], r["config_source"] = cfg, source
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
    results.json (missing, unreadable, or without any test / val result), and finished runs whose settings cannot be
    read (reason :data:`NO_SETTINGS`), each ``{"dir", "last_step", "reason"}``."""
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
    for d in sorted(dirs, key=natural_key):
        if str(d) in evaluated:
            continue
        res = d / "results.json"
        if not res.exists():
            reason = "no results.json"
        elif str(d) in finished:
            reason = "results.json has no test or val result"
        elif (r := _results(res)) is not None:  # finished, but its settings cannot be read
            reason = NO_SETTINGS if cell({**r, "config": {}}) is not None else "results.json has no test or val result"
        else:
            reason = "unreadable results.json"
        out.append({"dir": str(d), "last_step": last_step(d), "reason": reason})
    return out


def depo_ks(run: dict[str, Any]) -> tuple[int, int] | None:
    """The two hop counts a Depo cell shows: ``run["report_k"]`` (``--k``), else (K, K/2); None for other tasks."""
    K = _get(run["config"], "task.K") or run.get("task_config", {}).get("K")
    if not K or not str(run.get("task", "depo")).startswith("depo"):
        return None
    return tuple(run["report_k"]) if run.get("report_k") else (int(K), int(K) // 2)


def cell(run: dict[str, Any]) -> tuple[float, float] | None:
    """The two numbers of a run's cell from its test (else val) split, or None if absent: Depo (acc at k=K, acc at
    k=K/2), or at the hop counts of ``--k`` (``run["report_k"]``); full copy (whole-copy, per-token accuracy);
    otherwise one number and NaN (generation accuracy, bits per parameter, answer accuracy)."""
    split = run.get("test") or run.get("val")
    if not split:
        return None
    nan = float("nan")
    if "generate" in split:
        return split["generate"]["acc"], nan
    if "bits_per_param" in (split.get("task_metrics") or {}):
        return split["task_metrics"]["bits_per_param"], nan
    ks = depo_ks(run)
    if ks is None:
        o = split.get("overall") or {}
        if o.get("acc") is None:
            return None
        if str(run.get("task")) == "fullcopy" and o.get("token_acc") is not None:
            return o["acc"], o["token_acc"]
        return o["acc"], nan
    by = split.get("by_group") or {}
    hi, lo = by.get(str(ks[0])), by.get(str(ks[1]))
    if hi is None:
        return None
    return hi["acc"], (lo["acc"] if lo else float("nan"))


def cell_kind(run: dict[str, Any]) -> str:
    """What a run's cell shows (the legend under the tables); the same cases as ``cell``. Two numbers are named
    ``first / second (%)``; the colour of a figure cell is the first."""
    split = run.get("test") or run.get("val") or {}
    if "generate" in split:
        return "generation accuracy (%)"
    if "bits_per_param" in (split.get("task_metrics") or {}):
        return "bits per parameter"
    ks = depo_ks(run)
    if ks is not None:
        return "acc@K / acc@K/2 (%)" if not run.get("report_k") else f"acc@{ks[0]} / acc@{ks[1]} (%)"
    if str(run.get("task")) == "fullcopy":
        return "whole-copy acc / per-token acc (%)"
    return "answer accuracy (%)"


# The keys named first in a setting's title (the paper's axes); every other config key is compared too.
IDENTITY = (
    "task.name",
    "model.arch",
    "canon.set",
    "pos.type",
    "pos.fraction",
    "model.qk_norm",
    "model.mlp",
    "model.size",
    "task.N",
    "task.K",
    "task.L",
    "task.grammar",
)
# The keys a cell takes its best run over (``--best-of``): the learning rate and the seeds (training and data), the
# paper's protocol (Part 4.1 Fig. 7: the best of several learning rates).
BEST_OF = ("optim.lr", "seed", "task.seed")
# Keys that cannot change a result (and the nodes below them): where files go, names, logging, checkpoint cadence,
# progress, profiling, sanity checks, caches; the data loader's worker count and the world size (the data stream and
# the global batch are the same for any count; only the reduction order of cross-rank sums changes); activation
# checkpointing and the GLA chunk length (the same math, recomputed or chunked). Backend choices (``ops``,
# ``kernels.*``, ``compile``, ``optim.fused``) stay compared: their numerics differ. ``resolved`` (what a run wrote
# into hparams.json of its machine: the backends its requests resolved to, document masking on or off) is not a
# setting: runs of one config share a cell on any machine, as they did before runs recorded it.
NEUTRAL = (
    "run_name",
    "task_name",
    "tags",
    "paths",
    "logger",
    "callbacks.checkpoint",
    "callbacks.progress",
    "callbacks.lr_monitor",
    "callbacks.preemption",
    "trainer.default_root_dir",
    "trainer.log_every_n_steps",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.profiler",
    "trainer.num_sanity_val_steps",
    "trainer.devices",
    "trainer.num_nodes",
    "data.num_workers",
    "data.gen_eval.batch_size",
    "task.cache_dir",
    "activation_checkpointing",
    "model.chunk_size",
    "resolved",
)
# Keys that cannot change a result at these values only: a fresh start or a resume of the run's own checkpoints
# (another path continues another run).
NEUTRAL_VALUES = {"ckpt_path": (None, "auto")}


def under(key: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    """``key`` is one of ``prefixes`` or a key below one (``a.b`` is under ``a``)."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _flat_keys(d: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out += _flat_keys(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def compared_keys(runs: list[dict[str, Any]], rows: str, cols: str, best_of: tuple[str, ...] = BEST_OF) -> list[str]:
    """The keys whose values must be equal for runs to share a cell: every leaf key of the runs' resolved configs
    (``hparams.json``; :data:`IDENTITY` for runs without one; a node that is a mapping in one run and empty or null
    in another counts by its leaves) except ``rows`` / ``cols``, the ``best_of`` keys and the :data:`NEUTRAL` ones;
    :data:`IDENTITY` first, then the others sorted."""
    every = set(IDENTITY)
    for r in runs:
        every |= set(_flat_keys(r.get("config") or {}))
    leaves = {k for k in every if not any(o.startswith(k + ".") for o in every)}
    keep = [k for k in leaves if not (k in (rows, cols) or under(k, best_of) or under(k, NEUTRAL))]
    return [k for k in IDENTITY if k in keep] + sorted(k for k in keep if k not in IDENTITY)


def auto_axes(runs: list[dict[str, Any]], best_of: tuple[str, ...] = BEST_OF) -> tuple[str, str]:
    """The table layout that compares what a sweep swept (``--rows auto`` / ``--cols auto``): the compared keys
    (:func:`compared_keys`, so never the ``best_of`` keys a cell takes its best over) that take more than one value
    among ``runs``, :data:`IDENTITY` first. Two or more: rows = the first, columns = the second (the paper's Fig. 7:
    rows ``canon.set``, columns ``pos.type``), the rest split tables. One: it is the columns (its values side by side)
    and the rows are ``task.name``. None: rows ``task.N``, columns ``model.size`` (the paper's grid).
    Returns (rows, cols)."""
    keys = compared_keys(runs, "", "", best_of)
    varying = [k for k in keys if len({compared_label(r, k) for r in runs} - {UNKNOWN}) > 1]
    if len(varying) >= 2:
        return varying[0], varying[1]
    if len(varying) == 1:
        return "task.name", varying[0]
    return "task.N", "model.size"


#: What :func:`compared_label` returns for a value an unfinished run's Hydra config leaves unresolved.
UNKNOWN = "(unresolved)"


def compared_label(run: dict[str, Any], key: str) -> str:
    """A run's value of a compared key as it is compared: numbers as floats (``1`` and ``1.0`` are one value),
    :data:`NEUTRAL_VALUES` as one value, :data:`UNKNOWN` for an interpolation (``${...}``) or ``auto`` in a config
    read from ``.hydra/config.yaml`` (``run["config_unresolved"]``: an unfinished run that never wrote
    ``hparams.json``), else :func:`label`."""
    v = value(run, key)
    if run.get("config_unresolved") and isinstance(v, str) and ("${" in v or v == "auto"):
        return UNKNOWN
    if key in NEUTRAL_VALUES and v in NEUTRAL_VALUES[key]:
        return "(neutral)"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = float(v)
    return label(key, v)


def axis_keys(runs: list[dict[str, Any]], keys: list[str], rows: str, cols: str) -> dict[str, str]:
    """``{key: "rows" | "cols"}`` for the keys of ``keys`` that vary among ``runs`` but follow the row or the column
    value (one value per row, or per column): a paper grid's step budget that grows with N (``trainer.max_steps``
    follows ``task.N``), the keys only one architecture has when the columns are ``model.arch``. The
    :data:`IDENTITY` keys never follow an axis. They do not split a table; :func:`protocol` names them."""
    out = {}
    for k in keys:
        if k in IDENTITY:  # the paper's setting keys always split (a GLA column is never a Llama table's column)
            continue
        vals = {compared_label(r, k) for r in runs}
        if len(vals) < 2:
            continue
        for axis, ax in (("rows", rows), ("cols", cols)):
            seen: dict[str, set[str]] = {}
            for r in runs:
                seen.setdefault(label(ax, value(r, ax)), set()).add(compared_label(r, k))
            if all(len(v) == 1 for v in seen.values()):
                out[k] = axis
                break
    return out


# Where results.json keeps an identity key, for runs without hparams.json.
_FROM_RESULTS = {
    "task.name": ("task",),
    "model.arch": ("model", "arch"),
    "canon.set": ("model", "canon"),
    "pos.type": ("model", "pos"),
    "model.qk_norm": ("model", "qk_norm"),
}


def value(run: dict[str, Any], key: str) -> Any:
    """A run's value of ``key``; ``pos.*`` of a linear model (GLA, GDN, Mamba2: no positional encoding, whatever
    the ``pos`` group says) is ``none`` / None, as train.py logs it. The rule is
    ``canonlm.arch.config.position_encoding``'s, restated here because importing ``canonlm.arch`` loads torch (2 s)
    and the report reads JSON only."""
    if key.startswith("pos.") and _raw_value(run, "model.arch") in ("gla", "gdn", "mamba2"):
        return "none" if key == "pos.type" else None
    return _raw_value(run, key)


def _raw_value(run: dict[str, Any], key: str) -> Any:
    if key == "model.size" and run.get("model", {}).get("size"):  # the built size (n_layers / d_model overrides)
        return run["model"]["size"]
    if run.get("config"):
        return _get(run["config"], key)
    if key in _FROM_RESULTS:
        return _get(run, ".".join(_FROM_RESULTS[key]))
    if key.startswith("task."):
        return _get(run.get("task_config") or {}, key[len("task.") :])
    return None


def label(key: str, value: Any) -> str:
    """How a config value is printed: an empty (or null) Canon set is ``none``."""
    if key == "canon.set" and value in (None, ""):
        return "none"
    return str(value)


def label_order(lab: str) -> tuple:
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


def table(
    runs: list[dict[str, Any]], rows: str, cols: str, best_of: tuple[str, ...] = BEST_OF
) -> dict[str, dict[str, dict[str, Any]]]:
    """{row label: {col label: {"acc": (hi, lo), "dir": best run dir, "runs": n, "best_of": {key: labels}}}} of runs
    of ONE setting: best by acc@K then acc@K/2 over the runs of a cell, which may differ only in the ``best_of`` keys
    (learning rate and seeds: the paper's best-of) and the keys that cannot change a result (:data:`NEUTRAL`); runs
    that differ in any other config key (:func:`compared_keys`: Canon set, positions, steps, kernel size, ...) raise
    ValueError naming the keys and values (``tables`` splits a sweep into settings first). NaN (diverged) loses."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    ident: dict[tuple[str, str], tuple[tuple, dict[str, Any]]] = {}
    keys = compared_keys(runs, rows, cols, best_of)
    for r in runs:
        c = cell(r)
        if c is None:
            continue
        rv, cv = label(rows, value(r, rows)), label(cols, value(r, cols))
        sig = tuple(compared_label(r, k) for k in keys)
        prev, first = ident.setdefault((rv, cv), (sig, r))
        if prev != sig:
            diff = [
                f"{k}={label(k, value(first, k))} vs {label(k, value(r, k))}"
                for k, a, b in zip(keys, prev, sig)
                if a != b
            ]
            raise ValueError(f"cell ({rows}={rv}, {cols}={cv}) mixes runs that differ in {', '.join(diff)}")
        best = out.setdefault(rv, {}).get(cv)
        n = 1 + (best["runs"] if best else 0)
        seen = best["best_of"] if best else {k: set() for k in best_of}
        for k in best_of:
            seen[k].add(label(k, value(r, k)))
        if best is None or _rank(c) > best["key"]:
            bits = "bits_per_param" in ((r.get("test") or r.get("val") or {}).get("task_metrics") or {})
            out[rv][cv] = {"acc": c, "key": _rank(c), "dir": r["dir"], "bits": bits, "kind": cell_kind(r)}
        out[rv][cv].update(runs=n, best_of=seen)
    return out


def tables(
    runs: list[dict[str, Any]], rows: str, cols: str, best_of: tuple[str, ...] = BEST_OF
) -> list[dict[str, Any]]:
    """One table per setting: the runs (with a test or val result) are split by the compared keys
    (:func:`compared_keys`) that take more than one value among them, except the keys that follow the rows or the
    columns (:func:`axis_keys`). Each item: ``{"setting": {key: label}, "title": "key=label key=label", "cells":
    table(...), "protocol": protocol(...)}``, in the order none < numbers < strings by length."""
    evaluated = [r for r in runs if cell(r) is not None]
    keys = compared_keys(evaluated, rows, cols, best_of)
    axis = axis_keys(evaluated, keys, rows, cols)
    sigs = [{k: compared_label(r, k) for k in keys} for r in evaluated]
    varying = [k for k in keys if len({s[k] for s in sigs}) > 1 and k not in axis]
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r, s in zip(evaluated, sigs):
        groups.setdefault(tuple(s[k] for k in varying), []).append(r)
    out = []
    for g in sorted(groups, key=lambda t: tuple(label_order(x) for x in t)):
        setting = {k: label(k, value(groups[g][0], k)) for k in varying}
        cells = table(groups[g], rows, cols, best_of)
        out.append(
            {
                "setting": setting,
                "title": " ".join(f"{k}={v}" for k, v in setting.items()),
                "cells": cells,
                "protocol": protocol(groups[g], best_of, cells, rows, cols),
            }
        )
    return out


def _tokens(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _values(labels: set[str] | list[str]) -> str:
    return "{" + ", ".join(sorted(labels, key=label_order)) + "}"


def protocol(
    runs: list[dict[str, Any]],
    best_of: tuple[str, ...],
    cells: dict[str, dict[str, dict[str, Any]]],
    rows: str = "",
    cols: str = "",
) -> dict[str, Any]:
    """What a table's cells are the best of, and its budget, from its finished runs (``cells``: :func:`table`'s):
    ``best_of`` {key: sorted labels over the table}, ``steps`` / ``tokens`` (sorted distinct ``results.json``
    ``steps`` / ``tokens_seen``), ``follows`` {key: {row or column value: label}} (:func:`axis_keys`),
    ``runs_per_cell`` [min, max] and ``text``, e.g. ``600 steps (1.23M tokens) per run; each cell the best of
    optim.lr in {0.001, 0.003} x seed in {1, 2} (4 runs per cell)``; a key whose values differ between cells is
    ``optim.lr in its own set per cell (...)``."""
    if not runs:
        return {
            "best_of": {},
            "steps": [],
            "tokens": [],
            "follows": {},
            "runs_per_cell": [0, 0],
            "text": "no finished run",
        }
    vals = {k: sorted({label(k, value(r, k)) for r in runs}, key=label_order) for k in best_of}
    steps = sorted({int(r["steps"]) for r in runs if isinstance(r.get("steps"), int)})
    tokens = sorted({int(r["tokens_seen"]) for r in runs if isinstance(r.get("tokens_seen"), int)})
    entries = [e for row in cells.values() for e in row.values()]
    counts = [e["runs"] for e in entries] or [0]
    per = [min(counts), max(counts)]
    budget = " or ".join(str(x) for x in steps) + " steps" if steps else "steps unknown"
    if tokens:
        budget += f" ({' or '.join(_tokens(t) for t in tokens)} tokens)"
    unknown = sum(1 for r in runs if not isinstance(r.get("steps"), int))
    if steps and unknown:
        budget += f" (unknown for {unknown} run{'s' if unknown > 1 else ''})"
    parts, fixed = [], []
    for k in best_of:
        per_cell = {frozenset(e["best_of"][k]) for e in entries if "best_of" in e}
        if len(per_cell) > 1:
            sets = sorted(per_cell, key=lambda v: (len(v), sorted(label_order(x) for x in v)))
            parts.append(f"{k} in its own set per cell ({' / '.join(_values(v) for v in sets)})")
        elif len(vals[k]) > 1:
            parts.append(f"{k} in {_values(vals[k])}")
        elif vals[k] and vals[k][0] != "None":
            fixed.append(f"{k}={vals[k][0]}")
    n = f"{per[0]} run{'s' if per[0] != 1 else ''}" if per[0] == per[1] else f"{per[0]}-{per[1]} runs"
    what = ("each cell the best of " + " x ".join(parts) if parts else "one setting per cell") + f" ({n} per cell)"
    if fixed:
        what += "; " + ", ".join(fixed)
    follows: dict[str, dict[str, str]] = {}
    keys = compared_keys(runs, rows, cols, best_of) if rows and cols else []
    for k, axis in axis_keys(runs, keys, rows, cols).items():
        ax = rows if axis == "rows" else cols
        follows[k] = {label(ax, value(r, ax)): label(k, value(r, k)) for r in runs}
        what += (
            f"; {k} follows {ax} ("
            + ", ".join(f"{a}: {b}" for a, b in sorted(follows[k].items(), key=lambda t: label_order(t[0])))
            + ")"
        )
    return {
        "best_of": vals,
        "steps": steps,
        "tokens": tokens,
        "follows": follows,
        "runs_per_cell": per,
        "text": f"{budget} per run; {what}",
    }
