"""CUDA fast paths for the Canon op: Dao-AILab ``causal_conv1d`` and fla's Triton ``causal_conv1d``.

Both libraries are optional at run time and imported here lazily (inside functions), never when canonlm is imported
(a missing library or an ABI mismatch = unavailable). Shapes follow :func:`canonlm.ops.canon.causal_conv1d`:
x (B, T, C) channel-last, weight (C, K), bias (C,) or None, initial_state (B, C, K-1) = the previous K-1 raw inputs.

* ``dao``: ``causal_conv1d.causal_conv1d_fn(x (B, C, T), weight (C, K), bias, seq_idx=None, initial_states
  (B, C, K-1), return_final_states=False, final_states_out=None, activation=None|"silu")``
  (``causal_conv1d/causal_conv1d_interface.py``, causal-conv1d 1.4 - 1.6). x is passed as the channel-last *view*
  ``x.transpose(1, 2)`` (stride(1) == 1): initial_states are only supported in that layout. The C++ op
  (``csrc/causal_conv1d.cpp``) then needs C % 8 == 0, K in {2, 3, 4}, and x.stride(0), x.stride(2) of the view
  (= the (B, T, C) tensor's stride(0) and stride(1)) multiples of 8; its channel-last kernel reads 16-byte vectors,
  so the data pointer must be 16-byte aligned. x is copied only when it misses one of these
  (:func:`dao_channel_last_ok`); views of a wider tensor whose strides qualify go in without a copy. initial_states
  must be channel-last (stride(1) == 1), of x's dtype, with the same stride and alignment rules; the bias must have
  the weight's dtype. Without an activation the residual is folded into the weight (``weight + e_{K-1}``,
  :func:`~canonlm.ops.canon.fold_residual`); with SiLU it is added outside. Decode: ``causal_conv1d_update(x (B, C),
  conv_state (B, C, K), weight, bias, activation)`` updates ``conv_state`` in place (roll left, write x as the last
  column).
* ``fla``: ``causal_conv1d(x (B, T, D), weight (D, W), bias, residual (B, T, D), initial_state (N, D, W),
  output_final_state, activation) -> (y, final_state)`` (fla-core 0.6, ``fla/modules/causal_conv1d/ops.py``; older
  releases: ``fla.modules.convolution``). fla-core 0.6.0 checks neither D nor W on these paths (its Triton tiles
  are ``BD`` channels by ``triton.next_power_of_2(W)`` taps, masked), so it takes the shapes dao refuses. fla's
  state is K wide with column 0 unused, so the (B, C, K-1) history is left-padded by one zero column and the
  gradient of that column is dropped. Decode: ``causal_conv1d_update(x, cache (N, D, W), residual, weight, bias,
  activation) -> (y, cache)`` (in place).
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from canonlm.ops._dispatch import probe

from ._fold import fold_residual

DAO_WIDTHS = (2, 3, 4)  # causal_conv1d_fwd / _bwd / _update: TORCH_CHECK(width >= 2 && width <= 4)


def _load_dao():
    mod = importlib.import_module("causal_conv1d")
    return mod.causal_conv1d_fn, mod.causal_conv1d_update


def _load_fla():
    errors = []
    for path in (
        "fla.modules.causal_conv1d.ops",
        "fla.modules.causal_conv1d",
        "fla.modules.conv.causal_conv1d",
        "fla.modules.conv",
        "fla.modules.convolution",
    ):
        try:
            mod = importlib.import_module(path)
        except ImportError as e:
            errors.append(f"{path}: {e}")
            continue
        fn = getattr(mod, "causal_conv1d", None)
        if callable(fn):
            return fn, getattr(mod, "causal_conv1d_update", None)
    raise ImportError("fla causal_conv1d not found (" + "; ".join(errors) + ")")


def dao_functions():
    """(causal_conv1d_fn, causal_conv1d_update) or None; second item: the import error message."""
    return probe("canon.dao", _load_dao)


def fla_functions():
    """(causal_conv1d, causal_conv1d_update or None) or None; second item: the import error message."""
    return probe("canon.fla", _load_fla)


def dao_supports_shape(C: Optional[int], K: Optional[int], dtype: torch.dtype) -> Optional[str]:
    """None if Dao's channel-last kernel accepts C channels, kernel size K and x dtype, else the reason (a None size is
    not checked). The limits of ``causal_conv1d_fwd`` / ``_bwd`` (``csrc/causal_conv1d.cpp``, causal-conv1d 1.5.1 -
    1.6): ``TORCH_CHECK(width >= 2 && width <= 4)``, and on the channel-last layout ``TORCH_CHECK(dim % 8 == 0)``; the
    input and weight dtypes must be float32, float16 or bfloat16."""
    if K is not None and K not in DAO_WIDTHS:
        return f"supports kernel size K in {DAO_WIDTHS} (got K={K})"
    if C is not None and C % 8 != 0:
        return f"needs channels C % 8 == 0 on its channel-last path (got C={C})"
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"supports float32, float16, bfloat16 (got {dtype})"
    return None


def dao_supports(x: Tensor, weight: Tensor) -> Optional[str]:
    """None if Dao's channel-last kernel accepts these tensors, else the reason."""
    return dao_supports_shape(weight.shape[0], weight.shape[1], x.dtype)


_VEC_BYTES = 16  # causal-conv1d's channel-last kernel loads kNElts * sizeof(elt) = 16 bytes per thread


def dao_channel_last_ok(t: Tensor) -> bool:
    """True when ``t`` (B, L, C) -- time (or state column) before channels -- can be passed to causal-conv1d as the
    channel-last (B, C, L) view ``t.transpose(1, 2)`` without a copy: unit channel stride, stride(0) and stride(1)
    multiples of 8 (``TORCH_CHECK`` in ``causal_conv1d_fwd`` / ``_bwd``, causal-conv1d 1.4 - 1.6; checked for size-1
    dims too), stride(1) > 1 (else the op does not see the channel-last layout) and a 16-byte aligned data pointer
    (the kernel's vector loads). Strides are checked as they are, since ``Tensor.contiguous()`` returns a tensor
    unchanged when only the strides of its size-1 dims are odd."""
    s0, s1, s2 = t.stride()
    return s2 == 1 and s1 > 1 and s1 % 8 == 0 and s0 % 8 == 0 and (t.data_ptr() % _VEC_BYTES == 0 or t.numel() == 0)


def _channel_last(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` (B, L, C) in ``dtype`` as it goes to causal-conv1d: itself when :func:`dao_channel_last_ok`, else a fresh
    densely packed copy (new allocation: aligned, strides (L·C, C, 1))."""
    if t.dtype == dtype and dao_channel_last_ok(t):
        return t
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    return out.copy_(t)


def _at_least_fp32(weight: Tensor) -> Tensor:
    """``weight`` in float32 (float64 stays): the fold's ``w[:, K-1] + 1`` lands in [0.5, 2) for the usual taps, where a
    bf16 weight would round it by up to 2^-8; in fp32 the fold is exact to 2^-24, like the fp32 residual add it
    replaces (both kernels load the weight as fp32: fla ``b_w ... .to(tl.float32)``, Dao dispatches the weight type
    apart from x's). The cast is differentiable: the weight's gradient returns in its own dtype."""
    return weight.to(torch.promote_types(weight.dtype, torch.float32))


def dao_forward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    residual: bool,
    activation: bool,
    initial_state: Optional[Tensor],
    seq_idx: Optional[Tensor] = None,
) -> Tensor:
    """Canon via ``causal_conv1d_fn`` on the channel-last view of x; differentiable (the library's autograd).

    Args: x (B, T, C) with C % 8 == 0, any strides (copied only when :func:`dao_channel_last_ok` fails); weight (C, K)
    with K in {2, 3, 4}; bias (C,) or None (cast to the weight's dtype); initial_state (B, C, K-1) or None (passed as
    a channel-last tensor of x's dtype, copied only when needed); seq_idx (B, T) or None: document masking -- each
    token's document index within its row, passed as a contiguous int32 tensor (``causal_conv1d_fwd`` checks
    ``seq_idx.scalar_type() == torch::kInt32``, contiguity and shape (batch, seqlen), channel-last layout only); the
    kernel reads a tap only when its token has the output token's ``seq_idx`` (``causal_conv1d_channellast_fwd_kernel``
    / ``_bwd_kernel``), which is the conv restarted at every document; not with ``initial_state`` (the library
    asserts it). Returns (B, T, C) in x.dtype.
    Raises RuntimeError (causal_conv1d not importable) or ValueError (shape / dtype the kernel refuses)."""
    fns, err = dao_functions()
    if fns is None:
        raise RuntimeError(f"causal_conv1d unavailable: {err}")
    fn = fns[0]
    reason = dao_supports(x, weight)
    if reason is not None:
        raise ValueError(f"causal_conv1d: backend 'dao' {reason}")
    xt = _channel_last(x, x.dtype).transpose(1, 2)  # (B, C, T) view, stride(1) == 1
    init = None
    if initial_state is not None:
        init = _channel_last(initial_state.transpose(1, 2), x.dtype).transpose(1, 2)  # (B, C, K-1), stride(1) == 1
    fold = residual and not activation  # the residual as part of tap K-1: one kernel, no add (fwd or bwd)
    w = fold_residual(_at_least_fp32(weight)) if fold else weight
    b = None if bias is None else bias.to(w.dtype)  # causal-conv1d wants the bias in the weight's dtype
    seq = None if seq_idx is None else seq_idx.to(device=x.device, dtype=torch.int32).contiguous()
    y = fn(xt, w, b, seq, init, False, None, "silu" if activation else None).transpose(1, 2)
    return x + y if residual and not fold else y


def fla_forward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    residual: bool,
    activation: bool,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
) -> Tensor:
    """Canon via fla's Triton ``causal_conv1d``; differentiable.

    Without an activation the residual is folded into the weight (:func:`fold_residual`: one kernel pass; fla's own
    ``residual=x`` would make autograd add the kernel's dx and the residual's dy in a separate kernel). With SiLU
    (a residual short conv) x goes in as fla's ``residual`` argument, added after the activation.

    Document masking: ``cu_seqlens`` / ``cu_seqlens_cpu`` (N + 1,) int64, the documents of the B rows flattened
    row-major (:func:`canonlm.ops.varlen.cu_seqlens_of`), or None. With them x runs as one (1, B·T, C) sequence
    (a view when x's rows are evenly strided, as a (B, T, C) tensor or a channel slice of one is) through fla's
    ``IS_VARLEN`` kernels (fla-core 0.6.0 ``causal_conv1d_fwd_kernel`` / ``_bwd_kernel``: each time tile reads only
    ``[bos, eos)`` of its document, so the conv restarts at every document, forward and backward); no
    ``initial_state`` then. Returns (B, T, C)."""
    fns, err = fla_functions()
    if fns is None:
        raise RuntimeError(f"fla causal_conv1d unavailable: {err}")
    fn = fns[0]
    state = None
    if initial_state is not None:
        state = F.pad(initial_state.to(x.dtype), (1, 0))  # (B, C, K): column 0 unused by fla
    fold = residual and not activation
    B, T, C = x.shape
    xin = x if cu_seqlens is None else x.reshape(1, B * T, C)
    varlen = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    if cu_seqlens is not None and cu_seqlens_cpu is not None and _takes(fn, "cu_seqlens_cpu"):
        varlen["cu_seqlens_cpu"] = cu_seqlens_cpu  # fla-core >= 0.5: chunk indices without a device-host sync
    out = fn(
        xin,
        weight=fold_residual(_at_least_fp32(weight)) if fold else weight,
        bias=bias,
        residual=xin if residual and not fold else None,
        initial_state=state,
        output_final_state=False,
        activation="silu" if activation else None,
        **varlen,
    )
    y = out[0] if isinstance(out, (tuple, list)) else out
    return y if cu_seqlens is None else y.view(B, T, C)


_TAKES: dict = {}


def _takes(fn, name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` (or ``**kwargs``); memoised per function."""
    key = (fn, name)
    if key not in _TAKES:
        import inspect

        try:
            params = inspect.signature(fn).parameters
            _TAKES[key] = name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            _TAKES[key] = False
    return _TAKES[key]


def dao_step(
    x_t: Tensor, state: Tensor, weight: Tensor, bias: Optional[Tensor], residual: bool, activation: bool
) -> tuple[Tensor, Tensor]:
    """One decode step with ``causal_conv1d_update`` on a copy of ``state`` (B, C, K)."""
    fns, err = dao_functions()
    if fns is None:
        raise RuntimeError(f"causal_conv1d unavailable: {err}")
    upd = fns[1]
    new_state = state.to(x_t.dtype).contiguous().clone()
    b = None if bias is None else bias.to(weight.dtype)
    y = upd(x_t, new_state, weight, b, "silu" if activation else None)
    return (x_t + y if residual else y), new_state


def fla_step(
    x_t: Tensor, state: Tensor, weight: Tensor, bias: Optional[Tensor], residual: bool, activation: bool
) -> tuple[Tensor, Tensor]:
    """One decode step with fla's ``causal_conv1d_update`` on a copy of ``state`` (B, C, K)."""
    fns, err = fla_functions()
    if fns is None or fns[1] is None:
        raise RuntimeError(f"fla causal_conv1d_update unavailable: {err or 'not exported by this fla version'}")
    upd = fns[1]
    new_state = state.to(x_t.dtype).contiguous().clone()
    y, new_state = upd(x_t, new_state, x_t if residual else None, weight, bias, "silu" if activation else None)
    return y, new_state
