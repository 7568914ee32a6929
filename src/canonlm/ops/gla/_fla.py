"""CUDA fast path for GLA: fla's Triton ``chunk_gla`` (training / prefill) and ``fused_recurrent_gla`` (decode).

fla-core (and triton) are optional at run time and imported here lazily, inside functions, never when canonlm is
imported. Shapes follow :func:`canonlm.ops.gla.chunk_gla`: q, k, g (B, T, H, K) with g the
log-space forget gate, v (B, T, H, V), state (B, H, K, V).

Calls (checked against the installed fla-core 0.6.0, ``fla/ops/gla/chunk.py`` and
``fla/ops/gla/fused_recurrent.py``)::

    fla.ops.gla.chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                          state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None) -> (o, final_state | None)
    fla.ops.gla.fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None,
                                    output_final_state=False, reverse=False, state_v_first=False,
                                    cu_seqlens=None) -> (o, final_state | None)

fla-core >= 0.5 asserts ``initial_state.dtype == torch.float32`` and ``q.shape == k.shape == g.shape`` in
``chunk_gla``; both are ensured here (the caller validates the shapes). Both functions are differentiable w.r.t.
q, k, v, g and initial_state (fla's autograd Functions). On CPU tensors they fail with ``RuntimeError: 0 active
drivers``, which is why :func:`canonlm.ops.gla.resolve_backend` refuses ``fla`` off CUDA.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch import Tensor

from canonlm.ops._dispatch import probe

# decode path: fused_recurrent_gla is used for T <= this when no gradient is being recorded
FUSED_RECURRENT_MAX_T = 64


def _load_fla():
    mod = importlib.import_module("fla.ops.gla")
    chunk = mod.chunk_gla
    fused = getattr(mod, "fused_recurrent_gla", None)
    return chunk, fused


def fla_functions() -> tuple[Optional[tuple], Optional[str]]:
    """``((chunk_gla, fused_recurrent_gla or None), None)`` when ``fla.ops.gla`` imports, else ``(None, reason)``.

    Probed once per process (the import pulls in triton and every fla kernel, several seconds)."""
    return probe("gla.fla", _load_fla)


def fla_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, initial_state: Optional[Tensor], output_final_state: bool
) -> tuple[Tensor, Optional[Tensor]]:
    """GLA through fla's kernels (CUDA tensors; shapes already validated by the caller).

    ``fused_recurrent_gla`` when ``T <= 64`` and ``torch.is_grad_enabled()`` is False (decode / short no-grad
    prefill), else ``chunk_gla``. Returns ``(o (B, T, H, V) in v.dtype, final_state (B, H, K, V) float32 or None)``.

    Raises:
        RuntimeError: fla.ops.gla is not importable (callers resolve the backend first, so this is a safety net).
    """
    fns, err = fla_functions()
    if fns is None:
        raise RuntimeError(f"fla chunk_gla unavailable: {err}")
    chunk, fused = fns
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    T = q.shape[1]
    if fused is not None and T <= FUSED_RECURRENT_MAX_T and not torch.is_grad_enabled():
        o, ht = fused(q, k, v, gk=g, scale=scale, initial_state=h0, output_final_state=output_final_state)
    else:
        o, ht = chunk(q, k, v, g, scale=scale, initial_state=h0, output_final_state=output_final_state)
    ht = ht.to(torch.float32) if (output_final_state and ht is not None) else None
    return o.to(v.dtype), ht


def fla_forward_varlen(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, cu_seqlens: Tensor, cu_seqlens_cpu: Tensor
) -> Tensor:
    """GLA over sequences concatenated in a batch of 1, the state restarting at each ``cu_seqlens[n]``:
    ``chunk_gla(q, k, v, g, scale=scale, cu_seqlens=cu_seqlens (int64, q's device), cu_seqlens_cpu=...)``
    (fla-core 0.6.0 ``fla/ops/gla/chunk.py``: "for variable-length inputs, the batch size `B` is expected to be 1";
    ``cu_seqlens_cpu`` feeds ``prepare_chunk_indices`` without a device sync). Always the chunk kernel (also without
    autograd). Returns o (1, T, H, V) in v.dtype."""
    fns, err = fla_functions()
    if fns is None:
        raise RuntimeError(f"fla chunk_gla unavailable: {err}")
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    o, _ = fns[0](
        q,
        k,
        v,
        g,
        scale=scale,
        cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.int64),
        cu_seqlens_cpu=cu_seqlens_cpu.to(torch.int64),
    )
    return o.to(v.dtype)
