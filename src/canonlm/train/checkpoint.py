"""Checkpoints that survive faults: atomic writes, discovery, validation before training, run-dir checks.

* :class:`AtomicCheckpointIO` (single file, DDP / one device) and :class:`AtomicModelParallelStrategy` (FSDP2's
  distributed-checkpoint *directory*) write to a hidden temporary name and rename it into place, so a kill in the
  middle of a save never damages the previous checkpoint.
* :func:`remove_stale_temps` deletes what an interrupted save left behind (``.<name>.ckpt.tmp-<pid>`` files and
  directories), and puts back a directory checkpoint whose swap was interrupted.
* :func:`find_resume_checkpoint` is ``ckpt_path=auto``: the newest *loadable* checkpoint of the run directory (by
  the optimizer step stored in it), saying which one and why others were skipped.
* :func:`inspect_checkpoint` reads a checkpoint without unpickling code (``torch.load(weights_only=True)``) and
  :func:`check_compatible` compares it with the model and task about to be trained; every problem is one
  :class:`CheckpointError` that names the file and the mismatch.
* :func:`check_run_dir` refuses a run directory that cannot be written or has no room for one checkpoint, before
  any training step.

Checkpoint files are Lightning's (``torch.save`` of a dict; under FSDP2 a ``torch.distributed.checkpoint``
directory with ``.metadata``, ``__<rank>_0.distcp`` shards and ``meta.pt``). canonlm adds the key ``"canonlm"``:
``{"format": 1, "model": <ModelConfig as a dict>, "task": <task config>, "train_time_s": float, "attempts": int,
"nonfinite_steps": int}`` (written by :meth:`canonlm.train.module.LMModule.on_save_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

from canonlm.errors import ConfigError

log = logging.getLogger("canonlm")

CKPT_FORMAT = 1
_TMP_RE = re.compile(r"^\.(?P<name>.+\.ckpt)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")
# Model-config fields that do not change what a checkpoint holds (backend choices, run-time switches).
_RUNTIME_MODEL_KEYS = {"ops", "kernels", "max_seq_len", "chunk_size"}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed: unreadable, truncated, or made by another model or task.

    ``str(e)`` names the file and what is wrong; raised before any training step."""

    def __init__(self, path: str | os.PathLike, problem: str, hint: str = ""):
        self.path, self.problem = str(path), problem
        self.key, self.value, self.allowed = "ckpt_path", str(path), hint or problem
        ValueError.__init__(self, f"checkpoint {path}: {problem}" + (f"; {hint}" if hint else ""))

    def __str__(self) -> str:  # ConfigError formats key/value/allowed; this one is a plain sentence
        return self.args[0]


# --------------------------------------------------------------------------------------------- atomic writes
def _tmp_name(path: Path, kind: str = "tmp", token: int | None = None) -> Path:
    return path.with_name(f".{path.name}.{kind}-{os.getpid() if token is None else token}")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=None)
def _classes() -> dict[str, type]:
    """The Lightning subclasses, built on first use so that importing this module (config and checkpoint checks
    before training) does not import Lightning."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy

    class AtomicCheckpointIO(TorchCheckpointIO):
        """Lightning ``CheckpointIO`` that writes each checkpoint to ``.<name>.tmp-<pid>`` in the same folder, fsyncs
        it, then ``os.replace``-s it into place: a crash or preemption mid-write leaves the previous file intact (and a
        temp file that :func:`remove_stale_temps` deletes at the next start). Loads use ``weights_only=True`` unless
        the caller asks otherwise (no pickled code is executed)."""

        def save_checkpoint(
            self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
        ) -> None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = _tmp_name(path)
            try:
                with open(tmp, "wb") as f:
                    torch.save(checkpoint, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                _fsync_dir(path.parent)
            finally:
                if tmp.exists():
                    tmp.unlink()

        def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only: bool | None = True):
            return super().load_checkpoint(
                path, map_location=map_location, weights_only=True if weights_only is None else weights_only
            )

    class AtomicModelParallelStrategy(ModelParallelStrategy):
        """Lightning's ``ModelParallelStrategy`` (FSDP2) whose distributed checkpoints are written atomically: all
        ranks write the ``torch.distributed.checkpoint`` directory under ``.<name>.tmp-<token>``, then rank 0 swaps
        it into place (old -> ``.<name>.old-<token>``, tmp -> name, old removed). A kill at any point leaves either
        the old or the new checkpoint under its name, or (between the two renames) the old one under ``.old-``,
        which :func:`remove_stale_temps` moves back."""

        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            if not self._save_distributed_checkpoint:
                return super().save_checkpoint(checkpoint, filepath, storage_options)
            path = Path(self.broadcast(filepath))
            token = int(self.broadcast(os.getpid()))
            tmp, old = _tmp_name(path, "tmp", token), _tmp_name(path, "old", token)
            if self.global_rank == 0 and tmp.exists():
                shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
            self.barrier("canonlm_ckpt_tmp")
            super().save_checkpoint(checkpoint, tmp, storage_options)
            self.barrier("canonlm_ckpt_written")
            if self.global_rank == 0:
                if path.exists():
                    os.replace(path, old)
                os.replace(tmp, path)
                _fsync_dir(path.parent)
                if old.exists():
                    shutil.rmtree(old) if old.is_dir() else old.unlink()
            self.barrier("canonlm_ckpt_swapped")

    return {"AtomicCheckpointIO": AtomicCheckpointIO, "AtomicModelParallelStrategy": AtomicModelParallelStrategy}


def __getattr__(name: str) -> type:
    if name in ("AtomicCheckpointIO", "AtomicModelParallelStrategy"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------- start-up cleanup
def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(ckpt_dir: str | os.PathLike) -> list[str]:
    """Clean what interrupted saves left in ``ckpt_dir``; returns what was done, one line per file.

    ``.<name>.ckpt.tmp-<pid>`` (file or directory) is deleted unless process ``pid`` is alive on this host (a save
    in progress); ``.<name>.ckpt.old-<pid>`` (an FSDP2 swap interrupted between its renames) is moved back to
    ``<name>.ckpt`` when that name is missing, else deleted. Call it on one rank only."""
    d = Path(ckpt_dir)
    done: list[str] = []
    if not d.is_dir():
        return done
    for p in sorted(d.iterdir()):
        m = _TMP_RE.match(p.name)
        if not m:
            continue
        if m["kind"] == "tmp" and _pid_alive(int(m["pid"])):
            continue
        target = d / m["name"]
        if m["kind"] == "old" and not target.exists():
            os.replace(p, target)
            done.append(f"restored {target} from the interrupted save {p.name}")
            continue
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
        shutil.rmtree(p) if p.is_dir() else p.unlink()
        done.append(f"removed {p} ({size / 2**20:.1f} MiB left by an interrupted save)")
    return done


# --------------------------------------------------------------------------------------------- reading
@dataclasses.dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` read: ``path``; ``step`` (optimizer steps done, Lightning's
    ``global_step``); ``meta`` (the ``"canonlm"`` entry, None for checkpoints written before it existed);
    ``shapes`` ({state-dict key: shape} of the model weights, keys without Lightning's ``model.`` prefix)."""

    path: str
    step: int
    meta: dict[str, Any] | None
    shapes: dict[str, tuple[int, ...]]


def _strip(key: str) -> str:
    for prefix in ("state_dict.", "model."):
        if key.startswith(prefix):
            key = key[len(prefix) :]
    return key


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Read a checkpoint's step, canonlm metadata and weight shapes without unpickling code.

    A file is read with ``torch.load(weights_only=True, mmap=True)`` (tensors are not copied into memory); a
    directory (FSDP2) by its ``.metadata`` (``torch.distributed.checkpoint.FileSystemReader``) and ``meta.pt``.
    Raises :class:`CheckpointError` for a missing, empty, truncated or otherwise unreadable checkpoint, naming the
    file and the reader's message."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(p, "does not exist")
    try:
        if p.is_dir():
            from torch.distributed.checkpoint import FileSystemReader

            if not (p / ".metadata").is_file():
                raise CheckpointError(
                    p, "is a directory without a distributed-checkpoint .metadata file (an interrupted or foreign save)"
                )
            md = FileSystemReader(str(p)).read_metadata()
            shapes = {
                _strip(k): tuple(v.size)
                for k, v in md.state_dict_metadata.items()
                if k.startswith("state_dict.") and hasattr(v, "size")
            }
            meta_file = p / "meta.pt"
            rest = torch.load(meta_file, map_location="cpu", weights_only=True) if meta_file.is_file() else {}
        else:
            if p.stat().st_size == 0:
                raise CheckpointError(p, "is empty (0 bytes): the save that wrote it was interrupted")
            rest = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(rest, Mapping) or "state_dict" not in rest:
                raise CheckpointError(p, "is not a Lightning training checkpoint (no 'state_dict' entry)")
            shapes = {_strip(k): tuple(v.shape) for k, v in rest["state_dict"].items() if hasattr(v, "shape")}
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- any reader failure is "unreadable", reported with its message
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        msg = msg.split(". ")[0]  # the reader's first sentence (torch adds a paragraph of advice)
        raise CheckpointError(
            p,
            f"cannot be read ({type(e).__name__}: {msg[:300]}); it is truncated or damaged"
            if msg
            else f"cannot be read ({type(e).__name__}); it is truncated or damaged",
        ) from None
    step = rest.get("global_step")
    if not isinstance(step, int):
        raise CheckpointError(p, "has no 'global_step' (not a Lightning training checkpoint)")
    meta = rest.get("canonlm")
    return CheckpointInfo(str(p), step, dict(meta) if isinstance(meta, Mapping) else None, shapes)


def model_signature(model_cfg: Any) -> dict[str, Any]:
    """The model config as a plain dict of what determines the weights (backend switches dropped)."""
    d = dataclasses.asdict(model_cfg) if dataclasses.is_dataclass(model_cfg) else dict(model_cfg)
    return {k: v for k, v in d.items() if k not in _RUNTIME_MODEL_KEYS}


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, Mapping):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: list(d) if isinstance(d, tuple) else d}


def _diff(saved: Mapping[str, Any], now: Mapping[str, Any], what: str) -> list[str]:
    a, b = _flat(saved), _flat(now)
    return [
        f"{what}.{k}: checkpoint {a.get(k)!r}, config {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def check_compatible(
    info: CheckpointInfo, model_cfg: Any, task_cfg: Mapping[str, Any], expected_shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Raise :class:`CheckpointError` unless ``info`` was made by this model and task.

    Compares the stored model config (architecture, Canon set and kernel, widths, heads, positions, ...) and task
    config field by field when the checkpoint has canonlm metadata, and always the weight names and shapes against
    ``expected_shapes`` (the model about to be trained, e.g. built on the ``meta`` device). The message names up to
    five differences."""
    problems: list[str] = []
    if info.meta is not None:
        problems += _diff(model_signature(info.meta.get("model", {})), model_signature(model_cfg), "model")
        problems += _diff(dict(info.meta.get("task", {})), dict(task_cfg), "task")
    if not problems:
        missing = sorted(set(expected_shapes) - set(info.shapes))
        extra = sorted(set(info.shapes) - set(expected_shapes))
        wrong = sorted(
            k for k in set(expected_shapes) & set(info.shapes) if tuple(expected_shapes[k]) != tuple(info.shapes[k])
        )
        problems += [f"weight {k} missing from the checkpoint" for k in missing]
        problems += [f"weight {k} not in the model" for k in extra]
        problems += [
            f"weight {k}: checkpoint shape {tuple(info.shapes[k])}, model {tuple(expected_shapes[k])}" for k in wrong
        ]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(
            info.path,
            "was made by a different model or task: " + "; ".join(problems[:5]) + more,
            "resume it with the config it was trained with, or start a new run (a fresh run_name)",
        )


def _candidates(run_dir: Path) -> list[Path]:
    d = run_dir / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.name.endswith(".ckpt") and not p.name.startswith("."))


def has_checkpoints(run_dir: str | os.PathLike) -> bool:
    """True if ``<run_dir>/checkpoints`` holds any ``*.ckpt`` file or directory."""
    return bool(_candidates(Path(run_dir)))


def find_resume_checkpoint(run_dir: str | os.PathLike, check=None) -> CheckpointInfo | None:
    """``ckpt_path=auto``: the newest loadable checkpoint of ``<run_dir>/checkpoints`` (highest stored step;
    ``last.ckpt`` wins a tie), or None when the folder holds no checkpoint.

    Unreadable ones (truncated, empty, interrupted) are skipped with a warning naming each; ``check(info)``, if
    given, is called on the chosen one (e.g. :func:`check_compatible`) and its error propagates: a checkpoint from
    another model is never skipped silently. Raises :class:`CheckpointError` when checkpoints exist but none can be
    read."""
    cands = _candidates(Path(run_dir))
    if not cands:
        return None
    good: list[CheckpointInfo] = []
    bad: list[str] = []
    for p in cands:
        try:
            good.append(inspect_checkpoint(p))
        except CheckpointError as e:
            bad.append(str(e))
    for msg in bad:
        log.warning("ckpt_path=auto skips %s", msg)
    if not good:
        raise CheckpointError(
            Path(run_dir) / "checkpoints",
            "holds checkpoints but none can be read: " + " | ".join(bad),
            "delete the damaged files or start a new run (a fresh run_name)",
        )
    best = max(good, key=lambda i: (i.step, Path(i.path).name == "last.ckpt"))
    if check is not None:
        check(best)
    return best


# --------------------------------------------------------------------------------------------- run directory
def estimate_checkpoint_bytes(n_params: int) -> int:
    """Bytes of one training checkpoint: fp32 weights + AdamW's two fp32 moments (12 bytes per parameter) plus 1 MiB
    of loop and callback state."""
    return 12 * int(n_params) + 2**20


def check_run_dir(run_dir: str | os.PathLike, need_bytes: int) -> None:
    """Fail before training if ``<run_dir>/checkpoints`` cannot be created and written, or its file system has less
    than ``need_bytes`` free (room for one checkpoint). Raises :class:`canonlm.errors.ConfigError` naming the folder.
    Writes (and removes) one empty probe file."""
    d = Path(run_dir) / "checkpoints"
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            "paths.output_dir", str(run_dir), f"a folder this user can write ({type(e).__name__}: {e.strerror or e})"
        ) from None
    free = shutil.disk_usage(d).free
    if free < need_bytes:
        raise ConfigError(
            "paths.output_dir",
            str(run_dir),
            f"a file system with room for one checkpoint: {need_bytes / 2**20:.1f} MiB needed, "
            f"{free / 2**20:.1f} MiB free",
        )


__all__ = [
    "AtomicCheckpointIO",  # noqa: F822 -- made by the module __getattr__ (Lightning imported on first use)
    "AtomicModelParallelStrategy",  # noqa: F822 -- made by the module __getattr__
    "CheckpointError",
    "CheckpointInfo",
    "check_compatible",
    "check_run_dir",
    "estimate_checkpoint_bytes",
    "find_resume_checkpoint",
    "has_checkpoints",
    "inspect_checkpoint",
    "model_signature",
    "remove_stale_temps",
]
