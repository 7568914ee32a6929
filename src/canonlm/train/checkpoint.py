"""Atomic checkpoint files and checkpoint discovery."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file in the same folder, fsync it, then ``os.replace`` it into place,
    so a crash or preemption mid-write never leaves a truncated ``.ckpt`` (the previous file stays intact)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()


def find_last(run_dir: str | os.PathLike) -> str | None:
    """``<run_dir>/checkpoints/last.ckpt`` (file, or DCP directory under FSDP2) if it exists, else None."""
    p = Path(run_dir) / "checkpoints" / "last.ckpt"
    return str(p) if p.exists() else None
