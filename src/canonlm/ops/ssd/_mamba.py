"""CUDA fast paths for the Mamba2 SSD scan: the mamba-ssm Triton kernels (spec models.md §3.3, §5.2).

mamba-ssm is optional at run time and imported here lazily (inside functions, only for CUDA tensors), never when
canonlm is imported (spec engineering.md §6.3: it does not install usably without a CUDA build, and
``mamba_ssm/__init__.py`` imports the compiled ``selective_scan_cuda``, so even its pure-Triton SSD kernel is not
importable from a CPU-only install). Shapes follow :func:`canonlm.ops.ssd.ssd_scan`: x (B, T, H, P), dt (B, T, H),
A (H,), B/C (B, T, G, N), D (H,) or (H, P), dt_bias (H,), state (B, H, P, N).

* prefill / training: ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size,
  D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
  dt_limit=(0, inf), return_final_states=False, ...)`` -> out (B, T, H, P) [, final_states (B, H, P, N)];
  differentiable (its own autograd.Function). Time step: ``clamp(softplus(dt + dt_bias), *dt_limit)`` (the clamp is
  always applied, also with the default (0, inf)) -- the same Δ as the reference.
* decode (one token, no autograd): ``mamba_ssm.ops.triton.selective_state_update.selective_state_update(state
  (B, H, P, N), x (B, H, P), dt (B, H, P), A (H, P, N), B (B, G, N), C (B, G, N), D (H, P), z=None, dt_bias (H, P),
  dt_softplus)`` updates ``state`` in place and returns (B, H, P). The per-head scalars are passed as stride-0
  expansions (A over (P, N), dt/dt_bias/D over P), which the kernel detects ("tie_hdim") and reads once per head.
  The kernel has no ``dt_limit`` and, in some releases, a softplus without the overflow threshold, so Δ is computed
  here in float32 (softplus, clamp) and passed as ``dt`` with a zero ``dt_bias`` and ``dt_softplus=False``.
* fused mixer: ``mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight (C, W), conv1d_bias, dt_bias, A, D,
  chunk_size, initial_states=None, seq_idx=None, dt_limit, return_final_states=False, activation, rmsnorm_weight,
  rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups, norm_before_gate)`` (calls the causal-conv1d CUDA
  extension internally, so it needs that package too).
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from canonlm.ops._dispatch import probe



def _load_chunk():
    mod = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    return mod.mamba_chunk_scan_combined


def _load_state_update():
    mod = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    return mod.selective_state_update


def _load_split():
    importlib.import_module("causal_conv1d")  # the fused path calls the causal-conv1d CUDA extension
    mod = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    return mod.mamba_split_conv1d_scan_combined


def chunk_scan_function():
    """(mamba_chunk_scan_combined or None, import error message or None)."""
    return probe("ssd.chunk", _load_chunk)


def state_update_function():
    """(selective_state_update or None, import error message or None)."""
    return probe("ssd.state_update", _load_state_update)


def split_function():
    """(mamba_split_conv1d_scan_combined or None, import error message or None); needs causal_conv1d as well."""
    return probe("ssd.split", _load_split)


def _need(fn_err, what: str):
    fn, err = fn_err
    if fn is None:
        raise RuntimeError(f"canonlm ssd: {what} is unavailable ({err})")
    return fn


def chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Optional[Tensor],
               dt_bias: Optional[Tensor], dt_softplus: bool, dt_limit: tuple[float, float],
               initial_state: Optional[Tensor], output_final_state: bool) -> tuple[Tensor, Optional[Tensor]]:
    """SSD scan with ``mamba_chunk_scan_combined`` (differentiable). B and C are cast to x.dtype, A/D/dt_bias and the
    initial state to float32. Returns (y (B, T, H, P) in x.dtype, final state (B, H, P, N) float32 or None)."""
    fn = _need(chunk_scan_function(), "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined")
    out = fn(x.contiguous(), dt.contiguous(), A.float(), B.to(x.dtype).contiguous(), C.to(x.dtype).contiguous(),
             int(chunk_size), D=None if D is None else D.float(),
             dt_bias=None if dt_bias is None else dt_bias.float(),
             initial_states=None if initial_state is None else initial_state.float().contiguous(),
             dt_softplus=bool(dt_softplus), dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
             return_final_states=bool(output_final_state))
    if output_final_state:
        y, final = out
        return y.to(x.dtype), final.float()
    y = out[0] if isinstance(out, (tuple, list)) else out
    return y.to(x.dtype), None


def state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                 dt_bias: Optional[Tensor], dt_softplus: bool, dt_limit: tuple[float, float],
                 initial_state: Optional[Tensor], output_final_state: bool) -> tuple[Tensor, Optional[Tensor]]:
    """One decode step (T == 1, no autograd) with ``selective_state_update`` on a float32 copy of the state.

    Args as :func:`chunk_scan` with T == 1. Returns (y (B, 1, H, P) in x.dtype, new state (B, H, P, N) float32 or
    None); ``initial_state`` is not modified.
    """
    fn = _need(state_update_function(), "mamba_ssm.ops.triton.selective_state_update.selective_state_update")
    Bsz, _, H, P = x.shape
    N = B.shape[-1]
    d = dt[:, 0].float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if dt_softplus:
        d = F.softplus(d)
    d = d.clamp(float(dt_limit[0]), float(dt_limit[1]))                 # (B, H) = Δ
    if initial_state is None:
        state = torch.zeros(Bsz, H, P, N, device=x.device, dtype=torch.float32)
    else:
        state = initial_state.to(torch.float32).contiguous().clone()
    A_e = A.float()[:, None, None].expand(H, P, N)                         # tie_hdim: stride 0 over (P, N)
    dt_e = d[:, :, None].expand(Bsz, H, P)                                 # stride 0 over P
    bias_e = torch.zeros(H, device=x.device, dtype=torch.float32)[:, None].expand(H, P)
    D_e = None if D is None else D.float().reshape(H, -1).expand(H, P)
    xt = x[:, 0].contiguous()
    y = fn(state, xt, dt_e, A_e, B[:, 0].to(x.dtype).contiguous(), C[:, 0].to(x.dtype).contiguous(), D=D_e, z=None,
           dt_bias=bias_e, dt_softplus=False)
    return y.to(x.dtype).unsqueeze(1), (state if output_final_state else None)


def split_conv1d_scan(zxbcdt: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], dt_bias: Tensor, A: Tensor,
                      D: Tensor, *, chunk_size: int, activation: Optional[str], rmsnorm_weight: Optional[Tensor],
                      rmsnorm_eps: float, outproj_weight: Optional[Tensor], headdim: int, ngroups: int,
                      norm_before_gate: bool, dt_limit: tuple[float, float]) -> Tensor:
    """Fused Mamba2 mixer core with ``mamba_split_conv1d_scan_combined`` (conv + SSD + gated RMSNorm + out-proj)."""
    fn = _need(split_function(), "mamba_ssm mamba_split_conv1d_scan_combined (needs mamba_ssm and causal_conv1d)")
    return fn(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, int(chunk_size), initial_states=None, seq_idx=None,
              dt_limit=(float(dt_limit[0]), float(dt_limit[1])), return_final_states=False, activation=activation,
              rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=float(rmsnorm_eps), outproj_weight=outproj_weight,
              outproj_bias=None, headdim=int(headdim), ngroups=int(ngroups), norm_before_gate=bool(norm_before_gate))
