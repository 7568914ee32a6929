"""No citation of the project's private specification in anything users get.

Docs, docstrings, comments and configs cite the paper (section, figure, equation, result), the official release's
file (facebookresearch/PhysicsLM4), another paper, or a library function. Users do not have the specification the
project was built from, so a "models.md §4.3", "tasks.md §5", "engineering.md P20", "spec §1.6" or a path into
``shared/spec`` tells them nothing. This test scans every git-tracked text file of the shipped tree and fails with the
``file:line`` of each such citation. Mentions of the project's own pages (``docs/models.md``, a Markdown link
``](tasks.md)``) are not citations of the specification and pass.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

#: What is scanned: these folders and top-level files (git-tracked files only).
SCANNED = ("src/", "docs/", "conf/", "bench/", "scripts/", "slurm/", "tests/", "README.md", "train.py")

#: A citation of the specification: one of its three files (not the project's docs/ page of the same name, not a
#: Markdown link to it), a path into shared/spec, or "spec §".
CITATION = re.compile(r"(?<!docs/)(?<!\]\()\b(?:models|tasks|engineering)\.md\b|shared/spec|\bspec\s+§")


def _scanned(path: str) -> bool:
    if path == SELF:
        return False
    return any(path == s or (s.endswith("/") and path.startswith(s)) for s in SCANNED)


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked-file list is unavailable")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def _citations(path: str) -> list[str]:
    data = (ROOT / path).read_bytes()
    if b"\0" in data:
        return []  # binary
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return []
    return [f"{path}:{n}: {line.strip()[:100]}" for n, line in enumerate(text.splitlines(), 1) if CITATION.search(line)]


def test_the_pattern_tells_citations_from_the_projects_own_pages():
    for cited in (
        "(spec models.md §4.3)",
        "(models.md §1.2)",
        "tasks.md §5",
        "engineering.md P20",
        "../shared/spec/tasks.md",
        "(spec §1.6)",
    ):
        assert CITATION.search(cited), cited
    for fine in (
        "see docs/models.md",
        "[docs/tasks.md](tasks.md)",
        "../shared/data/physicslm4/lano",
        "the paper's App. A.2",
        "a spec-compliant file",
    ):
        assert not CITATION.search(fine), fine


def test_no_file_cites_the_private_specification():
    files = [p for p in _tracked_files() if _scanned(p) and (ROOT / p).is_file()]
    assert any(p.startswith("src/") for p in files) and any(p.startswith("conf/") for p in files)
    found = [hit for p in files for hit in _citations(p)]
    assert not found, "citations of the private spec (cite the paper, the release or the library):\n" + "\n".join(found)
