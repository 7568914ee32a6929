"""Atomic file writes: a reader never sees a half-written file, and a crash leaves the old file (or none)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _atomic_write(path: str | os.PathLike, data: str | bytes, mode: str) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=str(p.parent))
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            f.write(data)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder and ``os.replace``.

    Creates missing parent folders; removes the temporary file on any failure. Returns the path.
    Raises OSError if the folder cannot be created or written.
    """
    return _atomic_write(path, text, "w")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """:func:`atomic_write_text` for ``bytes`` (images, binary files). Returns the path; raises OSError."""
    return _atomic_write(path, data, "wb")


__all__ = ["atomic_write_bytes", "atomic_write_text"]


def remove_empty_dirs(start: str | os.PathLike, stop: str | os.PathLike) -> None:
    """Remove ``start`` and then each parent folder while it is empty, stopping below ``stop`` (never removed) or at
    the first folder that is not empty or cannot be removed (``os.rmdir`` semantics: nothing with content is ever
    deleted). For a refused run: the folders Hydra made for it, and only those left empty."""
    p, stop = Path(start), Path(stop)
    while p != stop and p != p.parent:
        try:
            p.rmdir()
        except OSError:
            break
        p = p.parent
