"""The self-check's markdown report: header, versions table, checks table and summary, written atomically and never
over an existing file without ``--force``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from canonlm.selfcheck.verdict import FAIL, PASS, SKIP, Result


def _cell(s: str) -> str:
    return " ".join(str(s).split()).replace("|", "\\|")


def _kernels(r: Result) -> str:
    k = r.kernels or {}
    parts = [f"{k[n]} {label}" for n, label in (("built", "built"), ("loaded", "from cache")) if k.get(n)]
    return ", ".join(parts)


def timing(r: Result) -> str:
    """``compile 12.3 s [6 kernels built], check 0.4 s``; ``not run`` (a line that did not run: no CUDA, the budget);
    ``stopped after 41.0 s`` (a line the budget stopped)."""
    if r.compile_s is None:
        return "not run" if r.seconds == 0 else f"stopped after {r.seconds:.1f} s"
    if r.status == SKIP and r.seconds == 0:
        return "not run"
    k = _kernels(r)
    return f"compile {r.compile_s:.1f} s{f' [{k}]' if k else ''}, check {r.check_s:.1f} s"


def format_line(r: Result) -> str:
    """The line printed as a result arrives: ``[PASS] name (compile 12.3 s, check 0.4 s): detail``."""
    return f"[{r.status}] {r.name} ({timing(r)}): {r.detail}"


def render(results: list[Result], vers: list[tuple[str, str]], header: dict) -> str:
    """The markdown report: header, versions table, checks table (status, line, compile s, check s, Triton kernels,
    detail), summary. A line that did not run has empty times."""
    n = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    lines = ["# canonlm self-check", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += [f"- result: **{'FAIL' if n[FAIL] else 'PASS'}** ({n[PASS]} PASS, {n[FAIL]} FAIL, {n[SKIP]} SKIP)", ""]
    lines += ["## Versions", "", "| component | version |", "|---|---|"]
    lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in vers]
    lines += [
        "",
        "## Checks",
        "",
        "| status | line | compile s | check s | Triton kernels | detail |",
        "|---|---|---:|---:|---|---|",
    ]
    for r in results:
        if r.compile_s is None or (r.status == SKIP and r.seconds == 0):
            c = k = ""  # did not run, or stopped by the budget (its detail says after how long)
        else:
            c, k = f"{r.compile_s:.1f}", f"{r.check_s:.1f}"
        lines.append(f"| {r.status} | {_cell(r.name)} | {c} | {k} | {_cell(_kernels(r))} | {_cell(r.detail)} |")
    lines += [
        "",
        "Errors are max |fast - ref| / max |ref| per tensor against a float64 reference of the same rounded "
        'inputs (dX = gradient of a random projection w.r.t. X). "ran op=backend:n" counts the calls of each '
        "backend's entry point during the check; a kernel, model or training line passes only if the fast "
        "kernels were the ones called. Compile time is the first call of each fast-path variant in a line "
        "(Triton compiles and autotuning, inductor, a training run's start-up up to its first optimizer step); "
        "check time is the rest. Triton kernels: compiled in the line, or loaded from the kernel cache.",
        "",
    ]
    return "\n".join(lines)


def write_report(path: Path, text: str, force: bool) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, then rename). Without ``force`` an
    existing file is never replaced: the new file is hard-linked into place, which fails if the name exists.
    Raises FileExistsError (exists, no ``force``) or OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # file systems without hard links: check, then rename
                if path.exists():
                    raise FileExistsError(str(path)) from None
                os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
