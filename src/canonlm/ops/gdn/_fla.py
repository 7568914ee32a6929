"""CUDA fast path for the GDN op: fla's Triton ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``.

fla (flash-linear-attention, ``fla-core``) is optional at run time and imported here lazily (inside functions), never
when canonlm is imported (on a machine without triton ``import fla.ops...`` fails, and
with triton the import alone costs 5-10 s). Shapes follow :func:`canonlm.ops.gdn.chunk_gated_delta_rule`:
q, k (B, T, H, K); v (B, T, H, V); g, beta (B, T, H); state (B, H, K, V) in the ``[K, V]`` convention.

Calls (fla-core 0.6.0, ``fla/ops/gated_delta_rule/{chunk,fused_recurrent}.py``):

* ``chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
  use_qk_l2norm_in_kernel=False, ...) -> (o (B, T, H, V) in q.dtype, final_state (N, H, K, V) fp32 or None)``;
  differentiable (its own autograd Function). Training must use this chunk mode.
* ``fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
  output_final_state=False, use_qk_l2norm_in_kernel=False, ...) -> (o, final_state)``; forward only (its backward
  raises ``NotImplementedError`` by design), so it is used only for short inputs (decode) without autograd.

Both normalise q and k inside the kernel as ``x / sqrt(sum(x**2) + 1e-6)`` when ``use_qk_l2norm_in_kernel=True``
(``fla/modules/norm/l2norm.py::l2norm_fwd`` eps=1e-6; ``fused_recurrent.py`` line ``b_q / tl.sqrt(tl.sum(b_q * b_q)
+ 1e-6)``), the same formula as canonlm's reference.

dtypes: fla-core 0.6.0's ``chunk_gated_delta_rule`` accepts float16/bfloat16/float32 (its ``ChunkGatedDeltaRuleFunction``
has no dtype check; only the optional FlashQLA backend declines fp32 and the dispatcher then falls back to Triton).
Older releases (the 0.2/0.3 line the official Canon code pins) assert ``q.dtype != torch.float32,
"ChunkGatedDeltaRuleFunction does not support float32. Please use bfloat16."`` and ``q.dtype == k.dtype ==
v.dtype``. :func:`chunk_refuses_fp32` therefore inspects the installed source for that refusal instead of trusting a
version number; q, k and v are always passed in one common dtype. float64 is never accepted (Triton ``tl.dot``).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Optional

import torch
from torch import Tensor

from canonlm.ops._dispatch import probe

#: dtypes the fla GDN kernels may accept (fp32 only if :func:`chunk_refuses_fp32` is False).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: at most this many tokens go to ``fused_recurrent_gated_delta_rule`` when autograd is off (as the official GDN2).
RECURRENT_MAX_T = 64

_probe_cache: dict = {}


def _load():
    mod = importlib.import_module("fla.ops.gated_delta_rule")
    chunk = mod.chunk_gated_delta_rule
    recurrent = getattr(mod, "fused_recurrent_gated_delta_rule", None)
    return chunk, recurrent


def functions():
    """((chunk_gated_delta_rule, fused_recurrent_gated_delta_rule or None) or None, import error message or None).

    Imported once and cached; any exception (ImportError without triton, undefined symbols, a Triton driver error)
    counts as "not importable"."""
    return probe("gdn.fla", _load)


def chunk_refuses_fp32() -> bool:
    """True if the installed fla's ``chunk_gated_delta_rule`` refuses float32 q/k/v.

    Reads the source of ``fla.ops.gated_delta_rule.chunk`` for the refusal message ("does not support float32");
    fla-core 0.6.0 has none (False). If the source cannot be read, assume it refuses (auto then stays on the
    reference path for fp32 instead of failing inside the kernel)."""
    if "fp32" not in _probe_cache:
        refuses = True
        try:
            src = inspect.getsource(importlib.import_module("fla.ops.gated_delta_rule.chunk"))
            refuses = "does not support float32" in src
        except Exception:  # noqa: BLE001 -- the probe reads fla's source; unreadable means it does not refuse fp32
            pass
        _probe_cache["fp32"] = refuses
    return _probe_cache["fp32"]


def dtype_reason(dtype: torch.dtype) -> Optional[str]:
    """None if the fla chunk kernel accepts q/k/v of ``dtype``, else why not."""
    if dtype not in KERNEL_DTYPES:
        return f"the fla kernels accept float16/bfloat16/float32 inputs, not {dtype}"
    if dtype == torch.float32 and chunk_refuses_fp32():
        return (
            'the installed fla chunk_gated_delta_rule refuses float32 inputs ("ChunkGatedDeltaRuleFunction does '
            'not support float32")'
        )
    return None


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    output_final_state: bool,
    use_qk_l2norm: bool,
) -> tuple[Tensor, Optional[Tensor]]:
    """GDN via fla. Uses ``fused_recurrent_gated_delta_rule`` when T <= :data:`RECURRENT_MAX_T` and autograd is off
    (decode / short prefill), else ``chunk_gated_delta_rule`` (differentiable).

    q, k, v are cast to one common dtype (``promote_types``); g and beta are passed as given (fla loads them in
    fp32); initial_state is passed as float32. Returns (o (B, T, H, V) in v.dtype, final_state (B, H, K, V) float32
    or None)."""
    fns, err = functions()
    if fns is None:
        raise RuntimeError(f"fla chunk_gated_delta_rule unavailable: {err}")
    chunk, recurrent = fns
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    qc, kc, vc = q.to(dt), k.to(dt), v.to(dt)
    h0 = None if initial_state is None else initial_state.to(torch.float32)
    T = q.shape[1]
    if recurrent is not None and T <= RECURRENT_MAX_T and not torch.is_grad_enabled():
        o, s = recurrent(
            qc,
            kc,
            vc,
            g=g,
            beta=beta,
            scale=scale,
            initial_state=h0,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )
    else:
        o, s = chunk(
            qc,
            kc,
            vc,
            g,
            beta,
            scale=scale,
            initial_state=h0,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )
    return o.to(v.dtype), (s if output_final_state else None)


def forward_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    use_qk_l2norm: bool,
    cu_seqlens: Tensor,
    cu_seqlens_cpu: Tensor,
) -> Tensor:
    """The gated delta rule over sequences concatenated in a batch of 1, the state restarting at each
    ``cu_seqlens[n]``: ``chunk_gated_delta_rule(q, k, v, g, beta, scale=, use_qk_l2norm_in_kernel=, cu_seqlens=
    (int64, q's device), cu_seqlens_cpu=)`` (fla-core 0.6.0 ``fla/ops/gated_delta_rule/chunk.py``: batch 1 with
    ``cu_seqlens``). Always the chunk kernel. q, k, v are cast to one common dtype.
    Returns o (1, T, H, V) in v.dtype."""
    fns, err = functions()
    if fns is None:
        raise RuntimeError(f"fla chunk_gated_delta_rule unavailable: {err}")
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    o, _ = fns[0](
        q.to(dt),
        k.to(dt),
        v.to(dt),
        g,
        beta,
        scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.int64),
        cu_seqlens_cpu=cu_seqlens_cpu.to(torch.int64),
    )
    return o.to(v.dtype)
