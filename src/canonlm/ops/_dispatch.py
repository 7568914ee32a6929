"""Plumbing shared by the sequence ops' dispatch points (canon, gla, gdn, ssd): backend memoisation that stays a
constant under ``torch.compile`` (and :func:`forget_backend_choices` to empty it), the reference paths' compute dtype
and autocast guard, and the CUDA checks."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Optional

import torch
from torch import Tensor

from canonlm.errors import ConfigError


def assume_constant(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` when canonlm is imported (that
    import alone costs ~1.7 s): if dynamo is not loaded yet, set the marker its decorator sets
    (``torch/_dynamo/decorators.py``); tests/test_canon_op.py compiles with fullgraph=True to catch a change."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


_memos: list[dict] = []


def memo_table() -> dict:
    """A new, empty memo of backend choices, registered so that :func:`forget_backend_choices` empties it."""
    table: dict = {}
    _memos.append(table)
    return table


def forget_backend_choices() -> None:
    """Empty every memo of backend choices (the per-call dispatch of canon, gla, gdn and ssd, and Mamba2's fused-path
    choice): the next call of each op resolves its backend again.

    For tests and tools that change what can run in this process (fake a library, hide a kernel). A model's placed
    backends (``CanonLM.place``) and graphs already compiled by ``torch.compile`` (the choice is a constant there) are
    not changed."""
    for table in _memos:
        table.clear()


def make_selector(
    resolve: Callable[[str, torch.device, torch.dtype], str], meta_auto: Optional[str] = None
) -> Callable[[str, str, torch.dtype], str]:
    """``select(backend, device_str, dtype) -> concrete backend``: ``resolve`` memoised per (backend, device, dtype)
    and treated as a constant by torch.compile (no tracing into import probes). ``meta_auto``: what an ``auto``
    that ``resolve`` leaves unresolved (the ``meta`` device) becomes. The memo is ``select.cache``
    (:func:`memo_table`)."""
    cache = memo_table()

    @assume_constant
    def select(backend: str, device: str, dtype: torch.dtype) -> str:
        key = (backend, device, dtype)
        hit = cache.get(key)
        if hit is None:
            hit = resolve(backend, torch.device(device), dtype)
            if hit == "auto" and meta_auto is not None:
                hit = meta_auto
            cache[key] = hit
        return hit

    select.cache = cache
    return select


def compute_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    """float64 when any given tensor is float64, else float32: the reference paths' accumulation dtype."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def no_autocast(device: torch.device):
    """A context that disables autocast on ``device`` (CPU / CUDA), so a reference computes in its own dtype."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def cuda_reason(device: torch.device) -> Optional[str]:
    """None on a usable CUDA device, else why a CUDA-only kernel cannot run there."""
    if device.type != "cuda":
        return f"needs a CUDA device (tensors are on {device.type})"
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    return None


def shape_of(t) -> object:
    """``tuple(t.shape)`` for a tensor, else the type name (for error messages)."""
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


_probes: dict[str, tuple[Optional[object], Optional[str]]] = {}


def probe(name: str, loader: Callable[[], object]) -> tuple[Optional[object], Optional[str]]:
    """``(loader(), None)``, or ``(None, "<Error>: <message>")`` if it raises; run once per ``name`` per process.

    Used for the optional CUDA libraries (imported lazily, never when canonlm is imported): an
    ImportError, an undefined symbol of an ABI mismatch (OSError) or a Triton driver error all mean "unavailable"."""
    if name not in _probes:
        try:
            _probes[name] = (loader(), None)
        except Exception as e:  # noqa: BLE001 -- a kernel library that fails to load for any reason is reported, not raised
            _probes[name] = (None, f"{type(e).__name__}: {e}")
    return _probes[name]


def resolve_fast_or_reference(
    name: str,
    device,
    dtype: torch.dtype,
    *,
    key: str,
    fast: str,
    reason: Callable[[torch.device, torch.dtype], Optional[str]],
    hint: str = "",
) -> str:
    """Backend choice of an op with one fast kernel beside its reference (GLA: fla, GDN: fla, SSD: mamba_ssm).

    Args:
        name: ``auto`` | ``reference`` | ``fast``; device / dtype: where and in which compute dtype the op runs.
        key: config key named in errors (``model.kernels.<op>``); fast: the fast backend's name.
        reason: ``reason(device, dtype)`` -> None when the fast kernel can run there, else why not.
        hint: appended to the refusal of an explicit ``fast`` request (e.g. how to make it runnable).
    Returns:
        ``auto`` -> ``fast`` when it can run, else ``reference``; ``reference`` -> itself; ``fast`` -> itself when it
        can run. On the ``meta`` device ``name`` is returned unchecked (``auto`` stays ``auto``).
    Raises:
        canonlm.errors.ConfigError(key, name, allowed): unknown name, or ``fast`` where it cannot run; ``allowed``
        says what runs here and why ``fast`` does not.
    """
    allowed = ("auto", "reference", fast)
    if name not in allowed:
        raise ConfigError(key, name, "one of " + ", ".join(allowed))
    device = torch.device(device)
    if device.type == "meta" or name == "reference":
        return name
    why = reason(device, dtype)
    if name == "auto":
        return fast if why is None else "reference"
    if why is not None:
        raise ConfigError(key, name, f"auto or reference here ({device.type}, {dtype}) ['{fast}' {why}{hint}]")
    return name
