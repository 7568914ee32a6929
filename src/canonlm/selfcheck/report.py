"""The self-check's markdown report: header, versions table, checks table and summary, written atomically and never
over an existing file without ``--force``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from canonlm.selfcheck.verdict import FAIL, PASS, SKIP, Result


def _cell(s: str) -> str:
    return " ".join(str(s).split()).replace("|", "\\|")


def render(results: list[Result], vers: list[tuple[str, str]], header: dict) -> str:
    """The markdown report: header, versions table, checks table (status, check, detail, seconds), summary."""
    n = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    lines = ["# canonlm self-check", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += [f"- result: **{'FAIL' if n[FAIL] else 'PASS'}** ({n[PASS]} PASS, {n[FAIL]} FAIL, {n[SKIP]} SKIP)", ""]
    lines += ["## Versions", "", "| component | version |", "|---|---|"]
    lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in vers]
    lines += ["", "## Checks", "", "| status | check | detail | s |", "|---|---|---|---:|"]
    lines += [f"| {r.status} | {_cell(r.name)} | {_cell(r.detail)} | {r.seconds:.1f} |" for r in results]
    lines += ["", "Errors are max |fast - ref| / max |ref| per tensor against a float64 reference of the same rounded "
              "inputs (dX = gradient of a random projection w.r.t. X). \"ran op=backend:n\" counts the calls of each "
              "backend's entry point during the check; a kernel, model or training line passes only if the fast "
              "kernels were the ones called.", ""]
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
