"""Mamba2 SSD op micro-benchmark (Dao & Gu 2024): fwd+bwd time of canonlm's chunked
``ssd_scan_reference`` against a naive step-by-step recurrence of the same op, fp32 on the CPU, in one run.

fla has no naive Mamba2 op, but SSD *is* "simple GLA": fla's ``naive_recurrent_simple_gla(q, k, v, g, scale)`` with
q = C, k = B (each group's B/C repeated over its H/G heads), v = Δ·x, g = Δ·A (per-head scalar log decay), scale = 1,
plus ``D·x`` -- so the baseline is the full op (softplus(dt + dt_bias), the discretisation and the skip included),
stepped one token at a time (fla-core's ``simple_gla/naive.py``, loaded by file path; needs fla-core installed).

Prints the median fwd+bwd wall time per implementation (chunked reference: ``--reps`` calls after one warm-up;
naive loop: ``--naive-reps`` calls, default 1, no warm-up -- it has nothing to warm up, and fla's loop writes each
step into a preallocated output in place, so its backward copies the whole output gradient once per step and grows
as T²; 5-20 s per call at the defaults on a shared 2-core box), the ratio, and a max-abs-diff sanity line (y and dx)
from the timed calls. The load average is printed because other processes on a 2-core box skew 2-thread timings.

    .venv/bin/python bench/op_ssd.py [--T 2048] [--B 2] [--H 8] [--P 32] [--N 64] [--G 1] [--chunk 64 256]
                                     [--reps 5] [--naive-reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from canonlm.ops._fla_naive import fla_version, load_fla_naive
from canonlm.ops.ssd import ssd_scan_reference


def _median_ms(fn, reps: int, warmup: int) -> tuple[float, object]:
    """(median ms over ``reps`` calls after ``warmup`` calls, the last call's result)."""
    for _ in range(warmup):
        fn()
    ts, out = [], None
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--P", type=int, default=32, help="head dim")
    ap.add_argument("--N", type=int, default=64, help="state size")
    ap.add_argument("--G", type=int, default=1, help="B/C groups (H % G == 0)")
    ap.add_argument("--chunk", type=int, nargs="+", default=[64, 256], help="SSD chunk size(s) to time")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--naive-reps", type=int, default=3, help="0 skips the naive baseline")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Bsz, T, H, P, N, G = args.B, args.T, args.H, args.P, args.N, args.G
    R = H // G

    g = torch.Generator().manual_seed(0)
    x = torch.randn(Bsz, T, H, P, generator=g).requires_grad_()
    dt = torch.randn(Bsz, T, H, generator=g).requires_grad_()
    A = (-torch.exp(torch.rand(H, generator=g) * 4.0)).requires_grad_()
    B = torch.randn(Bsz, T, G, N, generator=g).requires_grad_()
    C = torch.randn(Bsz, T, G, N, generator=g).requires_grad_()
    D = torch.randn(H, generator=g).requires_grad_()
    dt_bias = (torch.randn(H, generator=g) * 0.5).requires_grad_()
    gy = torch.randn(Bsz, T, H, P, generator=g)
    leaves = (x, dt, A, B, C, D, dt_bias)

    def zero():
        for t in leaves:
            t.grad = None

    def ours(Q):
        def f():
            zero()
            y, _ = ssd_scan_reference(x, dt, A, B, C, chunk_size=Q, D=D, dt_bias=dt_bias)
            (y * gy).sum().backward()
            return y.detach(), x.grad.clone()

        return f

    mod = load_fla_naive("simple_gla")

    def naive():
        zero()
        delta = F.softplus(dt + dt_bias)  # dt_limit (0, inf) is a no-op after softplus
        o, _ = mod.naive_recurrent_simple_gla(
            C.repeat_interleave(R, 2),
            B.repeat_interleave(R, 2),
            x * delta[..., None],
            delta * A,
            scale=1.0,
            output_final_state=False,
        )
        y = o + D[:, None] * x
        (y * gy).sum().backward()
        return y.detach(), x.grad.clone()

    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, fp32 CPU; B={Bsz} T={T} H={H} P={P} N={N} "
        f"G={G}; fwd+bwd wall ms (median); load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    res, outs = {}, {}
    for Q in args.chunk:
        res[Q], outs[Q] = _median_ms(ours(Q), args.reps, warmup=1)
        print(f"  ssd_scan_reference (chunked SSD, chunk {Q:4d}, median of {args.reps}): {res[Q]:10.1f} ms", flush=True)
    if args.naive_reps <= 0:
        print("  naive baseline skipped (--naive-reps 0)")
        return
    if mod is None or not hasattr(mod, "naive_recurrent_simple_gla"):
        print("  naive baseline skipped: fla-core (fla/ops/simple_gla/naive.py) is not installed")
        return
    t_naive, (y_n, dx_n) = _median_ms(naive, args.naive_reps, warmup=0)
    print(
        f"  fla {fla_version()} naive_recurrent_simple_gla = the same op (q=C, k=B, v=softplus(dt+dt_bias)*x, "
        f"g=Δ·A, scale=1, + D·x), one step per token, median of {args.naive_reps}: {t_naive:10.1f} ms",
        flush=True,
    )
    for Q, t in res.items():
        print(f"  speed-up chunk {Q:4d}: {t_naive / t:6.1f}x  (naive / chunked)")
    # sanity: same outputs and input gradients (from the timed calls)
    Q = args.chunk[0]
    y_c, dx_c = outs[Q]
    print(
        f"  sanity (chunk {Q}): max|y_chunked - y_naive| = {(y_c - y_n).abs().max().item():.2e} "
        f"(max|y| {y_n.abs().max().item():.1f}), max|dx_chunked - dx_naive| = "
        f"{(dx_c - dx_n).abs().max().item():.2e} (max|dx| {dx_n.abs().max().item():.1f})"
    )


if __name__ == "__main__":
    main()
