"""Causal (GQA) softmax attention behind one dispatch point (``F.scaled_dot_product_attention``, flash-attn).

Layout everywhere is flash-attn's **(B, T, H, D)** (time before heads); ``F.scaled_dot_product_attention`` wants
(B, H, T, D), so the ``sdpa`` backend passes transposed *views* (no copy) and transposes the result back.

Backends:

* ``"reference"`` -- explicit math in float32 (autocast disabled): ``softmax(q k^T * scale + causal mask) v`` with
  the k/v heads repeated for GQA; the result is cast back to ``q.dtype``. O(T^2) memory; the CPU oracle.
* ``"sdpa"``      -- ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=causal, enable_gqa=...)``:
  the default on CPU and GPU (fused flash / memory-efficient / cuDNN / CPU-flash kernels chosen by PyTorch).
* ``"flash"``     -- ``flash_attn.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)`` (FA2; imported
  inside the call, never at package import). flash-attn >= 2.7 registers its kernels as ``torch.library`` custom ops
  (``flash_attn::_flash_attn_forward``), so it traces under compile. Limits (flash-attn 2.8,
  ``csrc/flash_attn/flash_api.cpp`` ``mha_fwd`` / ``mha_bwd``): fp16/bf16 only ("FlashAttention only support fp16
  and bf16 data type"), an Ampere or newer GPU (compute capability >= 8.0), head dim <= 256 ("FlashAttention
  forward only supports head dimension at most 256"; backward the same), head dim a multiple of 8 -- which
  ``FlashAttnFunc`` (``flash_attn_interface.py``) meets by zero-padding q/k/v to the next multiple of 8 (a copy),
  so any head dim <= 256 runs -- and a unit stride on the last dim. :func:`flash_reason` checks these before any
  work; :func:`resolve_backend` takes the head dim to refuse a pinned ``flash`` that cannot run.

``"auto"`` and ``"fused"`` both mean ``"sdpa"`` (always available; it *is* a fused kernel on every device).

Document masking (:func:`attention` with ``doc_mask`` / ``cu_seqlens``; several documents packed in one window, no
token attending across a document boundary). The choice, and what it costs beyond unmasked attention:

* ``sdpa`` (and ``auto`` / ``fused``): ONE additive block-causal mask ``(B, 1, T, T)`` (0 where query t may attend key
  s, -inf elsewhere) in q's dtype, built once per forward (:func:`canonlm.ops.varlen.block_causal_bias`) and passed to
  every layer. SDPA uses a floating mask as it is (only a boolean one is converted, per call, into a new float tensor
  by ``convert_boolean_attn_mask``), and the kernels that take a mask (memory-efficient / cuDNN on CUDA, CPU-flash or
  math on CPU) keep a reference to that same tensor for their backward: **B·T²·itemsize bytes per forward, whatever
  the number of layers** (6 x 4096² x 2 bytes = 192 MiB under bf16). PyTorch's flash kernel takes no mask, so SDPA
  runs the memory-efficient one, which supports no grouped-query k/v (only flash and math do, per
  ``F.scaled_dot_product_attention``'s docs; with ``enable_gqa`` it would fall back to the math kernel and keep a
  (B, H, T, T) fp32 score matrix per layer): k and v are therefore repeated to H heads first (two (B, T, H, D) copies
  per layer instead).
* ``flash``: ``flash_attn.flash_attn_varlen_func`` on the flattened (B·T, H, D) tokens with the documents'
  ``cu_seqlens`` (int32) and ``causal=True`` (flash-attn 2.x ``flash_attn_interface.py``: q (total_q, nheads, headdim),
  k/v (total_k, nheads_k, headdim), ``cu_seqlens_q`` / ``cu_seqlens_k`` (batch + 1,) int32, ``max_seqlen_q`` /
  ``max_seqlen_k`` ints, ``softmax_scale``, ``causal``): no mask, nothing beyond unmasked attention.
* ``reference``: adds the same additive mask to its fp32 score matrix (the O(T²) oracle).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from canonlm.errors import ConfigError

BACKENDS = ("auto", "fused", "reference", "sdpa", "flash")


@functools.lru_cache(maxsize=None)
def flash_available() -> bool:
    """True when ``flash_attn.flash_attn_func`` can be imported (result cached; no CUDA check)."""
    try:
        from flash_attn import flash_attn_func  # noqa: F401 -- imported to check that flash-attn loads
    except Exception:  # noqa: BLE001 -- ImportError, or an ABI mismatch raising OSError/RuntimeError
        return False
    return True


FLASH_MAX_HEAD_DIM = 256  # flash-attn 2.8 mha_fwd / mha_bwd: "only supports head dimension at most 256"
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MIN_CAPABILITY = (8, 0)  # "FlashAttention only supports Ampere GPUs or newer."


def flash_shape_reason(head_dim: int | None) -> str | None:
    """None when flash-attn 2.8 takes this head dim (<= 256; not a multiple of 8 is padded by ``flash_attn_func``),
    else why not. ``head_dim=None``: not checked."""
    if head_dim is not None and not 1 <= int(head_dim) <= FLASH_MAX_HEAD_DIM:
        return f"flash-attn supports head dim 1..{FLASH_MAX_HEAD_DIM} (got {head_dim})"
    return None


def flash_reason(device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """None when ``flash`` can run on ``device`` with compute ``dtype`` and ``head_dim``, else why not.

    Checks a CUDA device, ``flash_attn`` importable, an Ampere or newer GPU, fp16/bf16 and :func:`flash_shape_reason`
    (the rules of flash-attn 2.8's ``mha_fwd`` / ``mha_bwd``). The ``meta`` device is not checked (None)."""
    device = torch.device(device)
    if device.type == "meta":
        return flash_shape_reason(head_dim)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"flash needs a CUDA device; got {device}"
    if not flash_available():
        return "flash_attn is not importable; see the GPU install"
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < FLASH_MIN_CAPABILITY:
        return f"flash-attn needs an Ampere or newer GPU (compute capability >= 8.0; this one: {cap[0]}.{cap[1]})"
    if dtype not in FLASH_DTYPES:
        return f"flash needs fp16/bf16 compute, got {dtype}; enable bf16 mixed precision"
    return flash_shape_reason(head_dim)


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None) -> str:
    """Concrete backend for ``name`` on ``device`` with compute dtype ``dtype``; call once, before any work.

    Args:
        name: one of ``auto | fused | reference | sdpa | flash``.
        device: device the model runs on (``meta`` skips availability checks of ``flash``).
        dtype: compute dtype of q/k/v (under autocast: the autocast dtype).
        head_dim: the per-head dim D of q/k/v, or None (not checked). ``flash`` needs D <= 256.
    Returns:
        ``"reference"``, ``"sdpa"`` or ``"flash"``. ``auto`` / ``fused`` are always ``"sdpa"`` (any head dim and
        dtype; never flash, so nothing to fall back from).
    Raises:
        canonlm.errors.ConfigError("model.kernels.attention", name, ...): unknown name, or ``flash`` requested
        where :func:`flash_reason` says it cannot run (no CUDA, no ``flash_attn``, a pre-Ampere GPU, a dtype other
        than fp16/bf16, head dim > 256); the message carries the reason.
    """
    key = "model.kernels.attention"
    if name not in BACKENDS:
        raise ConfigError(key, name, " | ".join(BACKENDS))
    if name in ("auto", "fused"):
        return "sdpa"
    if name == "flash":
        why = flash_reason(device, dtype, head_dim)
        if why is not None:
            raise ConfigError(key, name, f"auto | reference | sdpa ({why})")
    return name


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "auto",
    doc_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Multi-head softmax attention with grouped-query k/v.

    Args:
        q: ``(B, T, H, D)``; k, v: ``(B, S, H_kv, D)`` with ``H % H_kv == 0`` (query head h uses kv head
            ``h // (H / H_kv)``, as HF ``repeat_kv`` and flash-attn). Float tensors of one dtype and device; any
            strides with a unit-stride last dim (views of a fused qkv projection are fine). ``S == T`` in training;
            ``S > T`` when decoding with a KV cache (the T queries are the last T positions).
        causal: query i sees keys ``0 .. i + S - T`` (bottom-right aligned, as flash-attn; = ``j <= i`` when S == T).
        scale: softmax scale, default ``D ** -0.5``.
        backend: ``auto | fused | reference | sdpa | flash`` (module docstring); resolve it once with
            :func:`resolve_backend`.
        doc_mask: document masking for ``sdpa`` / ``reference`` (/ ``auto`` / ``fused``): the additive
            block-causal mask ``(B, 1, T, T)`` in q's dtype, 0 where query t may attend key s (causality included) and
            -inf elsewhere (:func:`canonlm.ops.varlen.block_causal_bias`), built once per forward and given to every
            layer (module docstring: its memory); needs ``causal=True`` and S == T (no KV cache).
        cu_seqlens, max_seqlen: document masking for ``flash``: the documents of the B rows flattened into one
            sequence (:func:`canonlm.ops.varlen.cu_seqlens_of`; any integer dtype, passed as int32) and an upper
            bound on their lengths (T is one). ``flash`` with ``doc_mask`` but no ``cu_seqlens`` raises.
    Returns:
        ``(B, T, H, D)`` tensor of ``q.dtype``.
    Raises:
        ValueError: bad ranks/shapes, ``H % H_kv != 0``, unknown backend, or ``flash`` on CPU / fp32 tensors / head
            dim > 256; with document masking: ``doc_mask`` / ``cu_seqlens`` without ``causal=True`` or with S != T, a
            ``doc_mask`` that is not a floating (B, 1, T, T) tensor of q's dtype, ``flash`` without ``cu_seqlens``,
            another backend without ``doc_mask``.
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; expected "
            "q (B, T, H, D) and k, v (B, T, H_kv, D)"
        )
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    S = k.shape[1]
    if k.shape[0] != B or k.shape[3] != D or H % Hkv or (causal and S < T):
        raise ValueError(
            f"attention: q {tuple(q.shape)} and k/v {tuple(k.shape)} do not match (same B and D, "
            f"H % H_kv == 0, and S >= T when causal)"
        )
    masked = doc_mask is not None or cu_seqlens is not None
    if masked and (not causal or S != T):
        raise ValueError(
            f"attention: document masking needs causal=True and S == T (no KV cache); got causal={causal}, T={T}, S={S}"
        )
    if doc_mask is not None and (tuple(doc_mask.shape) != (B, 1, T, T) or doc_mask.dtype != q.dtype):
        raise ValueError(
            f"attention: doc_mask {tuple(doc_mask.shape)} {doc_mask.dtype}; expected the additive mask "
            f"(B, 1, T, T) = {(B, 1, T, T)} in q's dtype {q.dtype} (canonlm.ops.varlen.block_causal_bias)"
        )
    if masked and backend == "flash":
        if cu_seqlens is None:
            raise ValueError("attention backend='flash': document masking needs cu_seqlens (flash_attn_varlen_func)")
        return _flash_varlen(q, k, v, cu_seqlens, T if max_seqlen is None else int(max_seqlen), scale)
    if masked and doc_mask is None:
        raise ValueError(f"attention backend={backend!r}: document masking needs doc_mask (B, 1, T, T)")
    if backend in ("auto", "fused", "sdpa") and doc_mask is not None:
        if Hkv != H:  # the kernels that take a mask have no GQA (module docstring): repeat k/v rather than math
            k, v = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=doc_mask, scale=scale
        )
        return out.transpose(1, 2)
    if backend == "reference" and doc_mask is not None:
        return attention_reference(q, k, v, causal=causal, scale=scale, bias=doc_mask)
    if backend in ("auto", "fused", "sdpa"):
        # is_causal must be a Python bool: under torch.compile with dynamic shapes ``S == T`` is a SymBool, which
        # SDPA refuses (TypeError under fullgraph, else a graph break at every new length); a branch on it is decided
        # at trace time with a guard on the sizes
        mask, is_causal = None, False
        if causal and S == T:
            is_causal = True
        if causal and S > T and T > 1:  # cached decode of several tokens: bottom-right aligned causal mask
            mask = _causal_mask(T, S, q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=Hkv != H,
        )
        return out.transpose(1, 2)
    if backend == "reference":
        return attention_reference(q, k, v, causal=causal, scale=scale)
    if backend == "flash":
        if q.device.type != "cuda" or q.dtype not in FLASH_DTYPES or flash_shape_reason(D) is not None:
            raise ValueError(
                f"attention backend='flash': needs fp16/bf16 CUDA tensors with head dim <= "
                f"{FLASH_MAX_HEAD_DIM}, got {q.dtype} on {q.device}, head dim {D}"
            )
        from flash_attn import flash_attn_func

        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    raise ValueError(f"attention: backend={backend!r}; allowed {' | '.join(BACKENDS)}")


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Explicit-math attention in float32 (float64 for float64 inputs); same shapes and semantics as
    :func:`attention`. ``bias`` (B, 1, T, S) additive mask (0 = may attend, -inf = may not), when given, is added to
    the scores instead of the causal mask (document masking: it already holds causality).

    Materialises the ``(B, H, T, S)`` score matrix; autocast is disabled inside so the math stays in fp32.
    Causal masking is bottom-right aligned (query i sees keys ``0 .. i + S - T``; top-left = the same when S == T).
    """
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    cd = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    with torch.autocast(q.device.type, enabled=False):
        qf = q.to(cd).transpose(1, 2)  # (B, H, T, D)
        kf = k.to(cd).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # (B, H, S, D)
        vf = v.to(cd).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
        scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # (B, H, T, S)
        if bias is not None:
            scores = scores + bias.to(cd)
        elif causal:
            S = k.shape[1]
            scores = scores.masked_fill(~_causal_mask(T, S, q.device), -math.inf)
        out = torch.matmul(scores.softmax(dim=-1), vf)  # (B, H, T, D)
    return out.transpose(1, 2).to(q.dtype)


def _flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None
) -> torch.Tensor:
    """Document-masked causal attention via ``flash_attn.flash_attn_varlen_func`` on the (B·T, H, D) flattened tokens
    (flash-attn 2.x; GQA by the kv head count as in ``flash_attn_func``). Returns (B, T, H, D) in q.dtype."""
    B, T, H, D = q.shape
    if q.device.type != "cuda" or q.dtype not in FLASH_DTYPES or flash_shape_reason(D) is not None:
        raise ValueError(
            f"attention backend='flash': needs fp16/bf16 CUDA tensors with head dim <= "
            f"{FLASH_MAX_HEAD_DIM}, got {q.dtype} on {q.device}, head dim {D}"
        )
    from flash_attn import flash_attn_varlen_func

    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = flash_attn_varlen_func(
        q.reshape(B * T, H, D),
        k.reshape(B * T, k.shape[2], D),
        v.reshape(B * T, v.shape[2], D),
        cu,
        cu,
        max_seqlen,
        max_seqlen,
        softmax_scale=scale,
        causal=True,
    )
    return out.view(B, T, H, D)


def _causal_mask(T: int, S: int, device) -> torch.Tensor:
    """Boolean ``(T, S)`` mask, True = may attend: query i (the (S - T + i)-th position) sees keys ``j <= i + S - T``."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril_(S - T)
