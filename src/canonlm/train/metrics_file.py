"""Read a run's ``metrics.jsonl`` back, across requeues and resumes.

File format (written by :class:`canonlm.train.loggers.JSONLLogger`, rank 0 only): one JSON object per line, one
line per ``log_metrics`` call, appended in the order logged::

    {"step": 200, "time": 1795553110.112, "train/loss": 2.95, "lr-AdamW": 0.002}
    {"step": 200, "time": 1795553131.870, "val/loss": 2.91, "val/acc": 0.031}
    {"step": 210, "time": 1795553133.004, "train/loss": "nan"}

``step`` is the trainer's global (optimizer) step, ``time`` unix seconds, every other key a metric. A non-finite
value is written as the string ``"nan"``, ``"inf"`` or ``"-inf"`` (strict JSON has no such numbers); several lines
may share a step (training metrics, validation metrics, the learning rate).

A resumed run appends to the same file, so after a job is killed and resumed from its last checkpoint the file
holds the steps between that checkpoint and the kill twice, first from the attempt that was killed, then from the
attempt that redid them. A process killed mid-write leaves a truncated last line, and since the next attempt
appends without a newline in between, its first line can be glued onto that fragment.

:func:`read_metrics` merges all of this into one row per step: for every (step, metric) the value of the **last**
line that has it wins (a later attempt supersedes an earlier one), and unreadable lines or fragments are skipped
and counted.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "infinity": math.inf, "-infinity": -math.inf}
_ROW_START = '{"step"'


class MetricRows(list):
    """``read_metrics``'s result: a list of one dict per step, sorted by step; ``skipped`` counts the unreadable
    lines and line fragments (a truncated write, a line that is not a JSON object with an integer ``step``)."""

    skipped: int = 0


def _value(v: Any) -> Any:
    if isinstance(v, str) and v.strip().lower() in _NONFINITE:
        return _NONFINITE[v.strip().lower()]
    return v


def _row(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    step = obj.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    return obj


def _rows_of_line(line: str) -> tuple[list[dict[str, Any]], int]:
    """The rows of one physical line and the number of unreadable pieces in it. A line that does not parse is split
    where each logger row starts (``{"step"``): a truncated fragment followed by the next attempt's first row."""
    row = _row(line)
    if row is not None:
        return [row], 0
    starts = [i for i in range(len(line)) if line.startswith(_ROW_START, i)]
    if not starts or starts[0] != 0:
        starts = [0] + starts
    rows, bad = [], 0
    for a, b in zip(starts, starts[1:] + [len(line)]):
        piece = line[a:b].strip()
        if not piece:
            continue
        r = _row(piece)
        if r is None:
            bad += 1
        else:
            rows.append(r)
    return rows, bad


def read_metrics(path: str | os.PathLike[str]) -> MetricRows:
    """One merged dict per step of ``metrics.jsonl`` at ``path``, sorted by step.

    Each dict holds ``"step"``, ``"time"`` and every metric logged at that step; for each (step, key) the value comes
    from the last line of the file that has that key at that step, so the attempt that redid a step after a resume
    supersedes the killed one (a metric only the earlier attempt logged is kept). ``"nan"`` / ``"inf"`` / ``"-inf"``
    strings become floats again. Truncated or invalid lines are skipped; their count is ``result.skipped``.
    """
    merged: dict[int, dict[str, Any]] = {}
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip().replace("\x00", "")  # a crash can leave NUL padding where a write was lost
            if not line:
                continue
            rows, bad = _rows_of_line(line)
            skipped += bad
            for r in rows:
                dst = merged.setdefault(r["step"], {"step": r["step"]})
                for k, v in r.items():
                    if k != "step":
                        dst[k] = _value(v)
    out = MetricRows(merged[s] for s in sorted(merged))
    out.skipped = skipped
    return out


def metric_series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[Any]]:
    """``(steps, values)`` of metric ``key`` over ``rows`` (``read_metrics``' output), only the steps that have it,
    in row order (by step)."""
    steps, values = [], []
    for r in rows:
        if key in r:
            steps.append(r["step"])
            values.append(r[key])
    return steps, values
