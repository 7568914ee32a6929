"""Which backend of each sequence op ran: :func:`backend_calls` counts the calls of every backend's entry point.

A backend *name* says what a dispatch point was asked for or resolved to; only a call of the function through which
that backend runs shows that it ran. :data:`ENTRY_POINTS` lists those functions for every op, next to the ops that
call them, so a rename here is a rename there (tests/test_backend_contract.py checks that every entry point exists
and that each op's dispatch calls it). ``python -m canonlm.selfcheck`` judges its kernel, model and training lines
by these counts.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Iterable, Iterator

__all__ = ["ENTRY_POINTS", "INLINE_PATHS", "OPS", "backend_calls"]

#: The sequence ops whose calls can be counted.
OPS = ("canon", "attention", "gla", "gdn", "ssd")

_CANON, _SSD = "canonlm.ops.canon", "canonlm.ops.ssd"
#: ``(op, backend) -> ((module, function), ...)``: the functions through which each backend of each op runs, as the
#: ops call them (module attributes looked up at call time). Fast backends: canonlm's thin wrappers around the library
#: calls (``canonlm/ops/*/_cuda.py``, ``_fla.py``, ``_mamba.py``) or the library function itself (SDPA, flash-attn).
#: SSD's ``split`` is Mamba2's fused conv + scan + norm + out-proj kernel. Canon's plain-torch decode step is inline
#: code of ``causal_conv1d_step``: see :data:`INLINE_PATHS`.
ENTRY_POINTS: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    ("canon", "dao"): ((f"{_CANON}._cuda", "dao_forward"), (f"{_CANON}._cuda", "dao_step")),
    ("canon", "fla"): ((f"{_CANON}._cuda", "fla_forward"), (f"{_CANON}._cuda", "fla_step")),
    ("canon", "cpu"): ((f"{_CANON}._native", "canon_conv"),),
    ("canon", "torch"): ((_CANON, "causal_conv1d_torch"),),
    ("canon", "reference"): ((_CANON, "causal_conv1d_reference"),),
    ("attention", "sdpa"): (("torch.nn.functional", "scaled_dot_product_attention"),),
    ("attention", "flash"): (("flash_attn", "flash_attn_func"), ("flash_attn", "flash_attn_varlen_func")),
    ("attention", "reference"): (("canonlm.ops.attention", "attention_reference"),),
    ("gla", "fla"): (("canonlm.ops.gla._fla", "fla_forward"), ("canonlm.ops.gla._fla", "fla_forward_varlen")),
    ("gla", "reference"): (("canonlm.ops.gla", "chunk_gla_reference"),),
    ("gdn", "fla"): (("canonlm.ops.gdn._fla", "forward"), ("canonlm.ops.gdn._fla", "forward_varlen")),
    ("gdn", "reference"): (("canonlm.ops.gdn", "chunk_gated_delta_rule_reference"),),
    ("ssd", "mamba_ssm"): ((f"{_SSD}._mamba", "chunk_scan"), (f"{_SSD}._mamba", "state_update")),
    ("ssd", "split"): ((f"{_SSD}._mamba", "split_conv1d_scan"),),
    ("ssd", "reference"): ((_SSD, "ssd_scan_reference"), (_SSD, "split_conv1d_scan_reference")),
}
#: ``(op, backend, module, function)``: a dispatch function with an inline path; a call of it during which no entry
#: point of ``op`` was called counts as ``backend`` (Canon's decode step in plain torch).
INLINE_PATHS = (("canon", "torch", _CANON, "causal_conv1d_step"),)


def _resolve_entry(module: str, attr: str, op: str, backend: str):
    """``(module object, function)`` of one entry point; None when ``module`` is a library that does not import
    (its backend cannot have run). Raises RuntimeError when a canonlm module or the function is missing."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # ImportError, or an ABI mismatch raising OSError (canonlm modules re-raise)
        if module.startswith("canonlm."):
            raise
        return None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise RuntimeError(
            f"canonlm.ops.backend_calls: {module}.{attr} (the entry point of {op} backend "
            f"{backend!r}) does not exist; without it nobody can tell whether that backend ran "
            f"(renamed? update canonlm.ops.calls.ENTRY_POINTS)"
        )
    return mod, fn


@contextlib.contextmanager
def backend_calls(ops: Iterable[str]) -> Iterator[dict[str, dict[str, int]]]:
    """Count which backends of the sequence ops ``ops`` (names of :data:`OPS`) run inside the ``with`` block.

    Every function of :data:`ENTRY_POINTS` of those ops is replaced by a pass-through that counts its calls (the
    original runs unchanged; nothing is mocked), plus the dispatch functions of :data:`INLINE_PATHS`. Calls made while
    another counted call is running (a backend's own internals) are not counted, so each count is one choice of a
    dispatch point. Restored on exit. Counts are Python calls: a ``torch.compile``-d region is counted when it is
    traced, not each time it runs.

    Yields:
        ``{op: {backend: calls}}``, filled while the block runs (only backends that were called appear).
    Raises:
        ValueError: an unknown op name. RuntimeError: an entry point of a canonlm module does not exist (a renamed
        wrapper would otherwise make a fast path look as if it never ran, or a fallback invisible); raised on entry,
        before the block runs, with every entry point wrapped so far restored.
    """
    ops = set(ops)
    unknown = sorted(ops - set(OPS))
    if unknown:
        raise ValueError(f"backend_calls: ops={unknown}; allowed: {', '.join(OPS)}")
    counts: dict[str, dict[str, int]] = {}
    depth = [0]
    patched: list[tuple[Any, str, Any]] = []

    def add(op: str, backend: str) -> None:
        counts.setdefault(op, {})[backend] = counts.get(op, {}).get(backend, 0) + 1

    def counted(fn, op: str, backend: str, inline: bool):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if depth[0]:  # inside another counted call: that backend's own internals
                return fn(*args, **kwargs)
            if inline:  # a dispatch function: its inline path ran when no entry point of the op did
                before = sum(counts.get(op, {}).values())
                out = fn(*args, **kwargs)
                if sum(counts.get(op, {}).values()) == before:
                    add(op, backend)
                return out
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                add(op, backend)

        return wrapper

    entries = [(op, be, m, a, False) for (op, be), points in ENTRY_POINTS.items() for m, a in points]
    entries += [(op, be, m, a, True) for op, be, m, a in INLINE_PATHS]
    try:
        for op, be, module, attr, inline in entries:
            if op not in ops:
                continue
            found = _resolve_entry(module, attr, op, be)
            if found is None:
                continue
            mod, fn = found
            patched.append((mod, attr, fn))
            setattr(mod, attr, counted(fn, op, be, inline))
        yield counts
    finally:
        for mod, attr, fn in reversed(patched):
            setattr(mod, attr, fn)
