"""Kernel lines: every fast kernel against its pure-PyTorch reference in float64 from the same rounded inputs, forward
and backward and on its decode path (CUDA by default), the compile-friendly Canon path compiled by inductor, and the
CPU's own fast paths (the native Canon kernel, SDPA).

The inputs of each line come from :func:`canon_case`, :func:`gla_case`, :func:`gdn_case` and :func:`ssd_case`
(looked up at call time, so a caller can shrink them). What ran is counted by :func:`canonlm.ops.backend_calls`. The
first call of each fast-path variant in a line is timed as compile time (:func:`~canonlm.selfcheck.verdict.compiling`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable, Iterable, Optional

from canonlm.ops import backend_calls
from canonlm.selfcheck import environment as env
from canonlm.selfcheck.numerics import compare, dtype_of, fwd_bwd, gen, kernel_tol, rel_err, tol_note
from canonlm.selfcheck.verdict import FAIL, Fail, Result, Skip, Verdict, compiling, judge_kernel, run_check, short


def kernel_prelude(op: str, fast: str, dtype, device: str) -> str:
    """Skip/fail early when the fast path cannot run on ``device``; return the backend ``auto`` picks (or the explicit
    one when ``fast`` is not ``auto``'s first choice: canon ``fla`` beside ``dao``, attention ``flash``)."""
    env.need_cuda(device)
    bad = env.fast_unavailable(op, fast, device, dtype)
    if bad is not None:
        if bad[0] == FAIL:
            raise Fail(bad[1])
        raise Skip(bad[1])
    auto = env.resolve(op, "auto", device, dtype)
    secondary = (op == "canon" and fast == "fla" and auto == "dao") or (op == "attention" and fast == "flash")
    return env.resolve(op, fast, device, dtype) if secondary else auto


# ----------------------------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------------------------


def canon_case(dtype, dev, seed=0, B=2, T=200, C=64, K=4):
    """``[x (B, T, C), w (C, K), b (C,), h0 (B, C, K-1)]`` in ``dtype`` on ``dev``."""
    import torch

    g = gen(seed)
    x = torch.randn(B, T, C, generator=g)
    w = torch.rand(C, K, generator=g) - 0.5
    b = torch.randn(C, generator=g) * 0.1
    h0 = torch.randn(B, C, K - 1, generator=g)
    return [t.to(dtype).to(dev) for t in (x, w, b, h0)]


def gla_case(dtype, dev, seed=0, B=2, T=300, H=4, K=64, V=64):
    """``[q, k (B, T, H, K), v (B, T, H, V)`` in ``dtype``; ``g (B, T, H, K) = logsigmoid / 16``, ``h0 (B, H, K, V)``
    in float32] on ``dev``."""
    import torch
    import torch.nn.functional as F

    g = gen(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, K, generator=g)) / 16
    h0 = torch.randn(B, H, K, V, generator=g)
    return [q.to(dtype).to(dev), k.to(dtype).to(dev), v.to(dtype).to(dev), gate.to(dev), h0.to(dev)]


def gdn_case(dtype, dev, seed=0, B=2, T=300, H=4, K=64, V=64):
    """``[q, k (B, T, H, K), v (B, T, H, V)`` in ``dtype``; ``g (B, T, H)`` log-decay, ``beta (B, T, H)``, ``h0
    (B, H, K, V)`` in float32] on ``dev``."""
    import torch
    import torch.nn.functional as F

    g = gen(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, generator=g) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    h0 = torch.randn(B, H, K, V, generator=g)
    return [q.to(dtype).to(dev), k.to(dtype).to(dev), v.to(dtype).to(dev), gate.to(dev), beta.to(dev), h0.to(dev)]


def ssd_case(dtype, dev, seed=0, B=2, T=300, H=4, P=64, G=1, N=64):
    """``[x (B, T, H, P), dt (B, T, H), A (H,), B, C (B, T, G, N), D (H,), dt_bias (H,), h0 (B, H, P, N)]`` on
    ``dev``; x, B, C in ``dtype``, the rest float32."""
    import torch

    g = gen(seed)
    x = torch.randn(B, T, H, P, generator=g)
    dt = torch.randn(B, T, H, generator=g)
    A = -torch.exp(torch.rand(H, generator=g) * 2.0)
    Bm, Cm = torch.randn(B, T, G, N, generator=g), torch.randn(B, T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    h0 = torch.randn(B, H, P, N, generator=g)
    return [
        x.to(dtype).to(dev),
        dt.to(dev),
        A.to(dev),
        Bm.to(dtype).to(dev),
        Cm.to(dtype).to(dev),
        D.to(dev),
        dt_bias.to(dev),
        h0.to(dev),
    ]


#: The two Canon-op uses checked: the Canon layer (residual, no activation) and a mixer's short conv (SiLU).
CANON_KINDS = {"canon.": (True, False), "shortconv.": (False, True)}
#: Decode segments of the GLA / GDN lines: a 20-token prefill, ten 1-token steps, then a 100-token chunk.
DECODE_SEGMENTS = [(0, 20)] + [(t, t + 1) for t in range(20, 30)] + [(30, 130)]


def _segments(fn, seqs: list, state, segments) -> tuple:
    """``fn(*[s[:, a:b] for s in seqs], state) -> (out, state)`` over ``segments`` (no_grad), the state carried;
    returns (outputs concatenated over time, final state). The first segment of each length is timed as compile
    time (a prefill and a one-token step run different kernels)."""
    import torch

    outs, seen = [], set()
    with torch.no_grad():
        for a, b in segments:
            first = (b - a) not in seen
            seen.add(b - a)
            with compiling() if first else contextlib.nullcontext():
                o, state = fn(*[s[:, a:b] for s in seqs], state)
            outs.append(o)
    return torch.cat(outs, 1), state


def _canon_fwd_bwd(fast_fn, x, w, b, h0, errors: dict) -> dict:
    """Both Canon uses (:data:`CANON_KINDS`) through ``fast_fn`` (counted) vs ``causal_conv1d_reference`` in float64,
    forward and backward; fills ``errors``, returns the counted calls."""
    from canonlm.ops.canon import causal_conv1d_reference

    def conv(fn, residual, act):
        return lambda x, w, b, h: (fn(x, w, b, residual=residual, activation=act, initial_state=h),)

    with backend_calls(["canon"]) as ran, compiling():
        got = {tag: fwd_bwd(conv(fast_fn, *ra), [x, w, b, h0]) for tag, ra in CANON_KINDS.items()}
    for tag, ra in CANON_KINDS.items():
        ref = fwd_bwd(conv(causal_conv1d_reference, *ra), [t.double() for t in (x, w, b, h0)])
        compare(["y"], ["x", "w", "b", "init"], got[tag], ref, errors, tag)
    return ran


# ----------------------------------------------------------------------------------------------------------------
# fast kernels vs references (CUDA by default)
# ----------------------------------------------------------------------------------------------------------------


def check_canon_kernel(fast: str, dt: str, mode: str, device: str = "cuda") -> Verdict:
    """Canon ``dao`` / ``fla`` vs ``causal_conv1d_reference``: the Canon layer (residual) and the short conv (SiLU,
    no residual), with bias and an initial state; ``mode`` ``fwd+bwd`` or ``decode`` (``causal_conv1d_step`` for
    40 tokens from a zero state vs the full reference, and the final state)."""
    import torch

    from canonlm.ops.canon import causal_conv1d, causal_conv1d_reference, causal_conv1d_state, causal_conv1d_step

    dtype = dtype_of(dt)
    resolved = kernel_prelude("canon", fast, dtype, device)
    x, w, b, h0 = canon_case(dtype, device)
    errors: dict[str, float] = {}
    if mode == "fwd+bwd":
        ran = _canon_fwd_bwd(functools.partial(causal_conv1d, backend=fast), x, w, b, h0, errors)
    else:
        x = x[:, :40]

        def steps(residual, act):
            state, ys = torch.zeros(x.shape[0], x.shape[2], w.shape[1], device=device, dtype=dtype), []
            for t in range(x.shape[1]):
                with compiling() if t == 0 else contextlib.nullcontext():
                    y, state = causal_conv1d_step(x[:, t], state, w, b, residual=residual, activation=act, backend=fast)
                ys.append(y)
            return torch.stack(ys, 1), state

        with torch.no_grad():
            with backend_calls(["canon"]) as ran:
                got = {tag: steps(*ra) for tag, ra in CANON_KINDS.items()}
            for tag, (residual, act) in CANON_KINDS.items():
                ref = causal_conv1d_reference(x.double(), w.double(), b.double(), residual=residual, activation=act)
                errors[tag + "y_steps"] = rel_err(got[tag][0], ref)
                errors[tag + "state"] = rel_err(got[tag][1], causal_conv1d_state(x, w.shape[1]))
    return judge_kernel("canon", fast, resolved, ran, errors, kernel_tol("canon", fast, dt))


def check_attention_kernel(fast: str, dt: str, mode: str, device: str = "cuda") -> Verdict:
    """Attention ``sdpa`` / ``flash`` vs ``attention_reference`` (GQA 8 query / 2 kv heads, head dim 64, causal):
    ``fwd+bwd`` at T = 256, or ``decode`` (1 and 5 new queries against a 256-key cache, bottom-right causal)."""
    import torch

    from canonlm.ops.attention import attention, attention_reference

    dtype = dtype_of(dt)
    if fast == "flash" and dtype not in (torch.float16, torch.bfloat16):
        raise Skip("flash-attn has no fp32 kernel")
    if fast == "flash":
        resolved = kernel_prelude("attention", "flash", dtype, device)
    else:
        env.need_cuda(device)
        resolved = env.resolve("attention", "auto", device, dtype)
    g = gen(3)
    B, S, H, Hkv, D = 2, 256, 8, 2, 64
    q = torch.randn(B, S, H, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, S, Hkv, D, generator=g).to(dtype).to(device)
    errors: dict[str, float] = {}
    if mode == "fwd+bwd":
        with backend_calls(["attention"]) as ran, compiling():
            got = fwd_bwd(lambda q, k, v: (attention(q, k, v, backend=fast),), [q, k, v])
        ref = fwd_bwd(lambda q, k, v: (attention_reference(q, k, v),), [q.double(), k.double(), v.double()])
        compare(["o"], ["q", "k", "v"], got, ref, errors)
    else:
        with torch.no_grad():
            with backend_calls(["attention"]) as ran:
                outs = {}
                for T in (1, 5):
                    with compiling():
                        outs[T] = attention(q[:, -T:].contiguous(), k, v, backend=fast)
            for T, o in outs.items():
                errors[f"o_T{T}"] = rel_err(o, attention_reference(q[:, -T:].double(), k.double(), v.double()))
    return judge_kernel("attention", fast, resolved, ran, errors, kernel_tol("attention", fast, dt))


def _linear_kernel(op: str, dt: str, mode: str, device: str, fast_fn, ref_fn, make_case, names: list) -> Verdict:
    """GLA / GDN line: ``make_case(dtype, device)`` gives the inputs, those with a time axis first (one per name of
    ``names`` but the state), the state (B, H, K, V) last. ``fwd+bwd``: outputs and gradients vs ``ref_fn`` in
    float64; ``decode``: the :data:`DECODE_SEGMENTS` under no_grad, the state carried, vs one reference call over
    the first 130 tokens."""
    import torch

    dtype = dtype_of(dt)
    resolved = kernel_prelude(op, "fla", dtype, device)
    case = make_case(dtype, device)
    seqs = len(case) - 1
    errors: dict[str, float] = {}
    if mode == "fwd+bwd":
        with backend_calls([op]) as ran, compiling():
            got = fwd_bwd(fast_fn, case)
        ref = fwd_bwd(ref_fn, [t.double() for t in case])
        compare(["o", "S"], names, got, ref, errors)
    else:
        with backend_calls([op]) as ran:
            o, S = _segments(fast_fn, case[:seqs], case[-1], DECODE_SEGMENTS)
        with torch.no_grad():
            eo, eS = ref_fn(*[t[:, :130].double() for t in case[:seqs]], case[-1].double())
        errors["o"], errors["S"] = rel_err(o, eo), rel_err(S, eS)
    return judge_kernel(op, "fla", resolved, ran, errors, kernel_tol(op, "fla", dt), tol_note(op, "fla", dt))


def check_gla_kernel(dt: str, mode: str, device: str = "cuda") -> Verdict:
    """GLA ``fla`` vs ``chunk_gla_reference`` (B=2, T=300, H=4, K=V=64, initial and final state): ``fwd+bwd``
    (``chunk_gla``), or ``decode`` under no_grad (a 20-token prefill and ten 1-token steps on
    ``fused_recurrent_gla``, then a 100-token chunk, the state carried) vs one reference call."""
    from canonlm.ops.gla import chunk_gla, chunk_gla_reference

    def ref_fn(q, k, v, g, h):
        return chunk_gla_reference(q, k, v, g, initial_state=h, output_final_state=True)

    def fast_fn(q, k, v, g, h):
        return chunk_gla(q, k, v, g, initial_state=h, output_final_state=True, backend="fla")

    return _linear_kernel("gla", dt, mode, device, fast_fn, ref_fn, gla_case, ["q", "k", "v", "g", "h0"])


def check_gdn_kernel(dt: str, mode: str, device: str = "cuda") -> Verdict:
    """GDN ``fla`` vs ``chunk_gated_delta_rule_reference`` (q/k L2-normalised in the kernel, B=2, T=300, H=4,
    K=V=64, g and beta fp32 as the mixer passes them): ``fwd+bwd``, or ``decode`` (no_grad: a 20-token prefill and
    ten 1-token steps on ``fused_recurrent_gated_delta_rule``, then a 100-token chunk) vs one reference call."""
    from canonlm.ops.gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_reference

    def ref_fn(q, k, v, g, beta, h):
        return chunk_gated_delta_rule_reference(q, k, v, g, beta, initial_state=h, output_final_state=True)

    def fast_fn(q, k, v, g, beta, h):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h, output_final_state=True, backend="fla")

    return _linear_kernel("gdn", dt, mode, device, fast_fn, ref_fn, gdn_case, ["q", "k", "v", "g", "beta", "h0"])


def check_ssd_kernel(dt: str, mode: str, device: str = "cuda") -> Verdict:
    """SSD ``mamba_ssm`` vs ``ssd_scan_reference`` (B=2, T=300, H=4, P=64, G=1, N=64, chunk 64, D, dt_bias,
    initial state): ``fwd+bwd`` (``mamba_chunk_scan_combined``), or ``decode`` (no_grad: a 20-token prefill, then
    ten 1-token steps on ``selective_state_update``) vs one reference call."""
    import torch

    from canonlm.ops.ssd import ssd_scan, ssd_scan_reference

    dtype = dtype_of(dt)
    resolved = kernel_prelude("ssd", "mamba_ssm", dtype, device)
    x, dtv, A, Bm, Cm, D, db, h0 = ssd_case(dtype, device)
    errors: dict[str, float] = {}
    kw = dict(chunk_size=64, output_final_state=True)

    def fast_fn(x, d, B, C, h, A=A, D=D, db=db):
        return ssd_scan(x, d, A, B, C, D=D, dt_bias=db, initial_state=h, backend="mamba_ssm", **kw)

    def ref_fn(x, d, B, C, h, A=A, D=D, db=db):
        return ssd_scan_reference(x, d, A, B, C, D=D, dt_bias=db, initial_state=h, **kw)

    if mode == "fwd+bwd":
        with backend_calls(["ssd"]) as ran, compiling():
            got = fwd_bwd(fast_fn, [x, dtv, Bm, Cm, h0, A, D, db])
        ref = fwd_bwd(ref_fn, [t.double() for t in (x, dtv, Bm, Cm, h0, A, D, db)])
        compare(["y", "S"], ["x", "dt", "B", "C", "h0", "A", "D", "dt_bias"], got, ref, errors)
    else:
        T = 30
        with backend_calls(["ssd"]) as ran:
            y, S = _segments(fast_fn, [x, dtv, Bm, Cm], h0, [(0, 20)] + [(t, t + 1) for t in range(20, T)])
        with torch.no_grad():
            ey, eS = ref_fn(
                *[t[:, :T].double() for t in (x, dtv, Bm, Cm)], h0.double(), A.double(), D.double(), db.double()
            )
        errors["y"], errors["S"] = rel_err(y, ey), rel_err(S, eS)
    return judge_kernel(
        "ssd", "mamba_ssm", resolved, ran, errors, kernel_tol("ssd", "mamba_ssm", dt), tol_note("ssd", "mamba_ssm", dt)
    )


# ----------------------------------------------------------------------------------------------------------------
# document masking: the varlen kernels against each document run alone
# ----------------------------------------------------------------------------------------------------------------


def doc_lengths(T: int, row: int) -> list[int]:
    """Document lengths (tokens) of row ``row`` of a document-masking line's (B, T) window, T >= 12: even rows
    ``[T//8, 1, T//2, rest]``, odd rows ``[T - T//3 - 3, 3, T//3]`` -- a 1-token and a 3-token document (shorter than
    a conv's taps), documents across chunk boundaries, and boundaries at other places in the two rows."""
    if T < 12:
        raise ValueError(f"doc_lengths: T={T}; allowed: T >= 12")
    if row % 2 == 0:
        return [T // 8, 1, T // 2, T - T // 8 - 1 - T // 2]
    return [T - T // 3 - 3, 3, T // 3]


def doc_ids_of(B: int, T: int, device):
    """(B, T) int64 document ids, row b holding the documents of :func:`doc_lengths` ``(T, b)`` (0, 0, ..., 1, ...):
    the ``doc_ids`` of ``CanonLM.forward`` and of :mod:`canonlm.ops.varlen`."""
    import torch

    lengths = [doc_lengths(T, b) for b in range(B)]
    return torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths]).to(device)


def doc_spans(B: int, T: int) -> list[tuple[int, int, int]]:
    """``[(row, start, end)]`` of every document of :func:`doc_ids_of` ``(B, T)``, row by row, in time order."""
    out = []
    for b in range(B):
        a = 0
        for n in doc_lengths(T, b):
            out.append((b, a, a + n))
            a += n
    return out


def check_doc_mask_kernel(op: str, dt: str, device: str = "cuda") -> Verdict:
    """Document masking in the fast kernels: ``op``'s varlen call, forward and backward, against the float64
    reference run on each document alone (the oracle of tests/test_doc_mask.py; independent of
    :func:`canonlm.ops.varlen.pack`), two rows packing the documents of :func:`doc_lengths`.

    * ``gla``: ``chunk_gla(q, k, v, g, cu_seqlens=, cu_seqlens_cpu=, backend="fla")`` on the B rows flattened to a
      batch of 1 (:func:`canonlm.ops.varlen.cu_seqlens_of`; fla's ``IS_VARLEN`` kernels) vs ``chunk_gla_reference``
      per document, at :func:`gla_case`'s shape;
    * ``gdn``: ``chunk_gated_delta_rule(..., cu_seqlens=, cu_seqlens_cpu=, backend="fla")`` vs
      ``chunk_gated_delta_rule_reference`` per document (q/k L2-normalised), at :func:`gdn_case`'s shape;
    * ``ssd``: ``ssd_scan(..., seq_idx=, backend="mamba_ssm")`` ((B, T) segment ids,
      :func:`canonlm.ops.varlen.segment_ids`; ``mamba_chunk_scan_combined(seq_idx=...)``, chunk 64, D, dt_bias) vs
      ``ssd_scan_reference`` per document, at :func:`ssd_case`'s shape.

    No initial or final state (document masking starts every document from zero). The line passes only when the fast
    backend was the one called (:func:`~canonlm.selfcheck.verdict.judge_kernel`) and every output and input gradient
    is within :func:`~canonlm.selfcheck.numerics.kernel_tol`. Raises ValueError for another ``op``."""
    import torch

    from canonlm.ops import varlen

    if op not in ("gla", "gdn", "ssd"):
        raise ValueError(f"check_doc_mask_kernel: op={op!r}; allowed: gla, gdn, ssd")
    fast = "mamba_ssm" if op == "ssd" else "fla"
    dtype = dtype_of(dt)
    resolved = kernel_prelude(op, fast, dtype, device)
    errors: dict[str, float] = {}
    if op in ("gla", "gdn"):
        if op == "gla":
            from canonlm.ops.gla import chunk_gla as fast_op
            from canonlm.ops.gla import chunk_gla_reference as ref_op

            case, names = gla_case(dtype, device)[:4], ["q", "k", "v", "g"]
        else:
            from canonlm.ops.gdn import chunk_gated_delta_rule as fast_op
            from canonlm.ops.gdn import chunk_gated_delta_rule_reference as ref_op

            case, names = gdn_case(dtype, device)[:5], ["q", "k", "v", "g", "beta"]
        B, T = case[0].shape[:2]
        cu, cu_cpu = varlen.cu_seqlens_of(doc_ids_of(B, T, device))
        flat = [t.reshape(1, B * T, *t.shape[2:]) for t in case]
        spans = list(zip(cu_cpu[:-1].tolist(), cu_cpu[1:].tolist()))

        def fast_fn(*xs):
            return (fast_op(*xs, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, backend=fast)[0],)

        def ref_fn(*xs):
            return (torch.cat([ref_op(*[x[:, a:e] for x in xs])[0] for a, e in spans], 1),)
    else:
        from canonlm.ops.ssd import ssd_scan, ssd_scan_reference

        x, dtv, A, Bm, Cm, D, db, _ = ssd_case(dtype, device)
        B, T = x.shape[:2]
        seq_idx = varlen.segment_ids(doc_ids_of(B, T, device))
        flat, names = [x, dtv, Bm, Cm, A, D, db], ["x", "dt", "B", "C", "A", "D", "dt_bias"]
        kw = dict(chunk_size=64)

        def fast_fn(x, d, Bm, Cm, A, D, db):
            return (ssd_scan(x, d, A, Bm, Cm, D=D, dt_bias=db, seq_idx=seq_idx, backend=fast, **kw)[0],)

        def ref_fn(x, d, Bm, Cm, A, D, db):
            rows = [
                torch.cat(
                    [
                        ssd_scan_reference(
                            x[b : b + 1, a:e],
                            d[b : b + 1, a:e],
                            A,
                            Bm[b : b + 1, a:e],
                            Cm[b : b + 1, a:e],
                            D=D,
                            dt_bias=db,
                            **kw,
                        )[0]
                        for r, a, e in doc_spans(B, T)
                        if r == b
                    ],
                    1,
                )
                for b in range(B)
            ]
            return (torch.cat(rows, 0),)

    with backend_calls([op]) as ran, compiling():
        got = fwd_bwd(fast_fn, flat)
    ref = fwd_bwd(ref_fn, [t.double() for t in flat])
    compare(["o" if op != "ssd" else "y"], names, got, ref, errors)
    v = judge_kernel(op, fast, resolved, ran, errors, kernel_tol(op, fast, dt), tol_note(op, fast, dt))
    v.detail += f"; {len(doc_spans(B, T))} documents in {B} rows of {T} tokens"
    return v


# The fused-split line's shape (batch, time, heads, head dim, groups, state size, conv width, out-projection width):
# every width a multiple of 8, as causal-conv1d's channel-last kernel needs.
SPLIT_SHAPE = dict(B=2, T=130, H=8, P=8, G=1, N=32, W=4, out=48)


def check_ssd_split_kernel(dt: str, device: str = "cuda") -> Verdict:
    """Mamba2's fused ``mamba_split_conv1d_scan_combined`` (conv + SSD + gated RMSNorm + out-proj) vs
    ``split_conv1d_scan_reference``, forward and backward at :data:`SPLIT_SHAPE` (B=2, T=130, H=8, P=8, G=1, N=32,
    width 4, SiLU). SKIP with the reason when
    ``canonlm.ops.ssd.fused_split_reason`` says the installed mamba-ssm / causal-conv1d pair cannot run it (the
    mixer then runs the conv and the scan separately, which the other SSD lines check)."""
    import torch

    from canonlm.ops import ssd

    dtype = dtype_of(dt)
    kernel_prelude("ssd", "split", dtype, device)
    Bsz, T, H, P, G, N, W, out = (SPLIT_SHAPE[k] for k in ("B", "T", "H", "P", "G", "N", "W", "out"))
    d_inner, conv_dim = H * P, H * P + 2 * G * N
    why = ssd.fused_split_reason(device, dtype, W, d_inner=d_inner, conv_dim=conv_dim, nheads=H)
    if why is not None:
        raise Skip(f"fused split cannot run with this mamba-ssm / causal-conv1d: {short(why, 200)}")
    fused = ssd.use_fused_split("auto", device, dtype, W, d_inner, conv_dim, H)
    resolved = "split" if fused else "separate conv + scan"
    g = gen(42)
    zx = torch.randn(Bsz, T, 2 * d_inner + 2 * G * N + H, generator=g)
    conv_w, conv_b = torch.rand(conv_dim, W, generator=g) - 0.5, torch.randn(conv_dim, generator=g) * 0.1
    dt_bias, A = torch.randn(H, generator=g) * 0.5, -torch.exp(torch.rand(H, generator=g) * 2.0)
    D, norm_w = torch.randn(H, generator=g), 1.0 + 0.1 * torch.randn(d_inner, generator=g)
    out_w = torch.randn(out, d_inner, generator=g) / math.sqrt(d_inner)
    leaves = [zx.to(dtype), conv_w, conv_b, dt_bias, A, D, norm_w, out_w.to(dtype)]
    kw = dict(chunk_size=64, activation="silu", rmsnorm_eps=1e-5, headdim=P, ngroups=G)

    def run(fn):
        return lambda zx, cw, cb, db, A, D, nw, ow: (
            fn(zx, cw, cb, db, A, D, rmsnorm_weight=nw, outproj_weight=ow, **kw),
        )

    with backend_calls(["ssd"]) as ran, compiling():
        got = fwd_bwd(run(ssd.split_conv1d_scan_combined), [t.to(device) for t in leaves])
    ref = fwd_bwd(run(ssd.split_conv1d_scan_reference), [t.double().to(device) for t in leaves])
    errors: dict[str, float] = {}
    compare(["out"], ["zxbcdt", "conv_w", "conv_b", "dt_bias", "A", "D", "norm_w", "out_w"], got, ref, errors)
    return judge_kernel(
        "ssd", "split", resolved, ran, errors, kernel_tol("ssd", "split", dt), tol_note("ssd", "split", dt)
    )


def check_canon_compiled(dt: str, device: str = "cuda") -> Verdict:
    """The compile-friendly Canon path, ``causal_conv1d_torch`` (what ``CanonLM.place(..., compiled=True)`` resolves an
    ``auto`` Canon request to on CUDA), compiled by ``torch.compile(fullgraph=True, dynamic=False)`` with inductor, vs
    ``causal_conv1d_reference`` in float64, forward and backward.

    One compiled function holds both Canon uses of :data:`CANON_KINDS` (the Canon layer, whose residual the torch
    path folds into the weight, and the SiLU short conv) with bias and an initial state, at :func:`canon_case`'s
    shape: one graph, one inductor compile of its forward and (at the first backward) its backward. The line passes
    only when inductor compiled exactly one graph (``fullgraph``: a graph break is an error, never a silent eager
    fallback), the traced Canon calls went to the torch path alone (:func:`canonlm.ops.backend_calls`; a compiled
    region's calls are counted when it is traced) and every output and gradient is within :func:`kernel_tol`
    (``canon``/``torch``: 2e-4 fp32, 6e-2 bf16). The first call (trace, inductor's fused kernels, one run) is the
    line's compile time. ``torch._dynamo.reset()`` first, so each line compiles its own graph; inductor compiles its
    few kernels in this process (``compile_threads=1``: no pool of compile subprocesses per worker)."""
    import torch

    from canonlm.ops import canon
    from canonlm.ops.canon import causal_conv1d_reference

    env.need_cuda(device)
    dtype = dtype_of(dt)
    resolved = env.resolve("canon", "torch", device, dtype)
    x, w, b, h0 = canon_case(dtype, device)
    graphs: list[int] = []

    def inductor(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(len(gm.graph.nodes))
        return compile_fx(gm, example_inputs)

    def both(conv, **kw):
        return lambda x, w, b, h: tuple(
            conv(x, w, b, residual=r, activation=a, initial_state=h, **kw) for r, a in CANON_KINDS.values()
        )

    import torch._inductor.config as inductor_config

    with backend_calls(["canon"]) as ran, compiling(), inductor_config.patch(compile_threads=1):
        torch._dynamo.reset()
        compiled = torch.compile(
            both(canon.causal_conv1d, backend="torch"), backend=inductor, fullgraph=True, dynamic=False
        )
        got = fwd_bwd(compiled, [x, w, b, h0])
    ref = fwd_bwd(both(causal_conv1d_reference), [t.double() for t in (x, w, b, h0)])
    errors: dict[str, float] = {}
    compare([k + "y" for k in CANON_KINDS], ["x", "w", "b", "init"], got, ref, errors)
    v = judge_kernel("canon", "torch", resolved, ran, errors, kernel_tol("canon", "torch", dt))
    if len(graphs) != 1:
        return Verdict(
            FAIL,
            f"inductor compiled {len(graphs)} graphs, want 1 ({v.detail})",
            **{k: getattr(v, k) for k in ("op", "backend", "ran", "errors", "tol")},
        )
    v.detail += "; inductor: 1 graph (fullgraph, both Canon uses)"
    return v


#: The kernel lines of one dtype: ``(name pattern, op, fast backend, check function of this module, its arguments
#: before ``device``)``; ``{dt}`` in the name is the dtype.
KERNEL_LINES = (
    [
        (f"kernel canon/{fast} {{dt}} {mode}", "canon", fast, "check_canon_kernel", (fast, "{dt}", mode))
        for fast in ("dao", "fla")
        for mode in ("fwd+bwd", "decode")
    ]
    + [("kernel canon/torch compiled {dt} fwd+bwd", "canon", "torch", "check_canon_compiled", ("{dt}",))]
    + [
        (f"kernel attention/{fast} {{dt}} {mode}", "attention", fast, "check_attention_kernel", (fast, "{dt}", mode))
        for fast in ("sdpa", "flash")
        for mode in ("fwd+bwd", "decode")
    ]
    + [
        (f"kernel {op}/{fast} {{dt}} {mode}", op, fast, fn, ("{dt}", mode))
        for op, fast, fn in (
            ("gla", "fla", "check_gla_kernel"),
            ("gdn", "fla", "check_gdn_kernel"),
            ("ssd", "mamba_ssm", "check_ssd_kernel"),
        )
        for mode in ("fwd+bwd", "decode")
    ]
    + [("kernel ssd/mamba_ssm fused split {dt} fwd+bwd", "ssd", "split", "check_ssd_split_kernel", ("{dt}",))]
    + [
        (f"kernel {op}/{fast} {{dt}} doc-mask ({how}) fwd+bwd", op, fast, "check_doc_mask_kernel", (op, "{dt}"))
        for op, fast, how in (
            ("gla", "fla", "cu_seqlens"),
            ("gdn", "fla", "cu_seqlens"),
            ("ssd", "mamba_ssm", "seq_idx"),
        )
    ]
)


def kernel_lines(dtypes: Iterable[str] = ("fp32", "bf16")) -> list[tuple[str, str, str, str, tuple, str, str]]:
    """Every kernel line as ``(name, op, fast backend, function name in this module, arguments before device, dtype,
    mode)`` (mode ``fwd+bwd``, ``decode`` or ``doc-mask``), dtype by dtype (flash-attn has no fp32 kernel: its fp32
    lines are left out)."""
    out = []
    for dt in dtypes:
        for name, op, fast, fn, args in KERNEL_LINES:
            if fast == "flash" and dt == "fp32":
                continue
            mode = "doc-mask" if fn == "check_doc_mask_kernel" else "decode" if "decode" in args else "fwd+bwd"
            out.append((name.format(dt=dt), op, fast, fn, tuple(a.format(dt=dt) for a in args), dt, mode))
    return out


def kernel_checks(
    device: str = "cuda", dtypes: Iterable[str] = ("fp32", "bf16")
) -> list[tuple[str, str, str, Callable[[], Verdict]]]:
    """Every kernel line as ``(name, op, fast backend, fn)`` for ``device`` (names are known without running)."""
    return [
        (name, op, fast, functools.partial(globals()[fn], *args, device=device))
        for name, op, fast, fn, args, _, _ in kernel_lines(dtypes)
    ]


def run_kernel_checks(
    device: str = "cuda",
    dtypes: Iterable[str] = ("fp32", "bf16"),
    ops: Optional[Iterable[str]] = None,
    backends: Optional[Iterable[str]] = None,
    autotune: str = "first",
) -> list[Result]:
    """Run the kernel lines (fast kernel vs float64 reference) on ``device`` in this process, one after the other.

    Args:
        device: where the tensors live (``"cuda"``; another device runs the lines whose fast backends resolve there,
            the others SKIP with the reason).
        dtypes: ``"fp32"`` and/or ``"bf16"``.
        ops: only these ops (``canon``, ``attention``, ``gla``, ``gdn``, ``ssd``); None: all.
        backends: only these fast backends (``dao``, ``fla``, ``torch`` (the compiled Canon line), ``sdpa``,
            ``flash``, ``mamba_ssm``, ``split``); None: all.
        autotune: ``"first"`` (Triton autotuners take the first config that runs,
            :func:`~canonlm.selfcheck.triton_hooks.first_config_autotune`) or ``"full"``.
    Returns:
        One :class:`~canonlm.selfcheck.verdict.Result` per line, in the report's order: ``status`` PASS / FAIL /
        SKIP, ``detail``, ``seconds`` and ``compile_s``, ``op`` / ``backend`` under test, ``ran`` (``{op: {backend:
        calls}}`` observed by :func:`canonlm.ops.backend_calls`), ``errors`` (``{tensor: max |fast - ref| / max
        |ref|}``) and ``tol``. Never raises for a failing check.
    Raises:
        ValueError: an unknown ``autotune``.
    """
    from canonlm.selfcheck.triton_hooks import AUTOTUNE_MODES, first_config_autotune

    if autotune not in AUTOTUNE_MODES:
        raise ValueError(f"run_kernel_checks: autotune={autotune!r}; allowed: {', '.join(AUTOTUNE_MODES)}")
    keep = None if ops is None else set(ops)
    keep_b = None if backends is None else set(backends)
    results = []
    lines = [
        (n, op, fast, fn)
        for n, op, fast, fn in kernel_checks(device, dtypes)
        if (keep is None or op in keep) and (keep_b is None or fast in keep_b)
    ]
    with first_config_autotune() if autotune == "first" and lines else contextlib.nullcontext():
        for name, op, fast, fn in lines:
            r = run_check(name, fn)
            results.append(dataclasses.replace(r, op=op, backend=fast))
    return results


# ----------------------------------------------------------------------------------------------------------------
# the CPU's fast paths
# ----------------------------------------------------------------------------------------------------------------


def check_cpu_canon_native(dt: str) -> Verdict:
    """The native CPU Canon kernel (``auto`` on CPU must pick ``cpu``, and it must be the one called) vs
    ``causal_conv1d_reference`` in float64, forward and backward, Canon layer and short conv (B=2, T=64, C=48, K=4,
    bias, initial state)."""
    from canonlm.ops.canon import available_backends, causal_conv1d

    dtype = dtype_of(dt)
    why = available_backends("cpu", dtype)["cpu"]
    if why is not None:
        raise Skip(f"native kernel unavailable: {why}")
    resolved = env.resolve("canon", "auto", "cpu", dtype)
    x, w, b, h0 = canon_case(dtype, "cpu", B=2, T=64, C=48, K=4)
    errors: dict[str, float] = {}
    ran = _canon_fwd_bwd(functools.partial(causal_conv1d, backend="cpu"), x, w, b, h0, errors)
    return judge_kernel("canon", "cpu", resolved, ran, errors, 1e-5 if dt == "fp32" else 2e-2)


def check_cpu_attention() -> Verdict:
    """SDPA (``auto`` on CPU, and the function called) vs ``attention_reference`` (float64), fp32, GQA 4 / 2 heads,
    T = 64, forward and backward, plus decode (1 and 5 queries against the 64-key cache)."""
    import torch

    from canonlm.ops.attention import attention, attention_reference

    resolved = env.resolve("attention", "auto", "cpu", torch.float32)
    g = gen(5)
    q = torch.randn(2, 64, 4, 32, generator=g)
    k, v = torch.randn(2, 64, 2, 32, generator=g), torch.randn(2, 64, 2, 32, generator=g)
    errors: dict[str, float] = {}
    with backend_calls(["attention"]) as ran:
        with compiling():
            got = fwd_bwd(lambda q, k, v: (attention(q, k, v, backend="sdpa"),), [q, k, v])
        with torch.no_grad():
            steps = {T: attention(q[:, -T:], k, v, backend="sdpa") for T in (1, 5)}
    ref = fwd_bwd(lambda q, k, v: (attention_reference(q, k, v),), [q.double(), k.double(), v.double()])
    compare(["o"], ["q", "k", "v"], got, ref, errors)
    with torch.no_grad():
        for T, o in steps.items():
            errors[f"o_decode_T{T}"] = rel_err(o, attention_reference(q[:, -T:].double(), k.double(), v.double()))
    return judge_kernel("attention", "sdpa", resolved, ran, errors, 1e-4)
