"""GLA op micro-benchmark (Yang et al. 2024): fwd+bwd ms of canonlm's chunked reference vs fla's naive
recurrent loop on CPU, fp32, measured in one run.

For each T: median over --reps of one forward + backward (o and the final state both feed the loss, with an
initial state, so every input gets a gradient) for ``canonlm.ops.gla.chunk_gla_reference`` (chunk 64) and for fla's
``naive_recurrent_gla`` (loaded by path, ``canonlm.ops._fla_naive``; skipped when fla-core is missing). Prints both
times, their ratio, and the max abs differences of o, the final state and the input gradients (sanity).

fla's loop writes ``o[:, :, i] = ...`` per step, so its backward copies the whole output gradient once per step
(O(T^2) memory traffic); its time grows faster than linearly in T and depends on the allocator (the first call is
often slower). canonlm's reference gets one warm-up call; the naive loop (seconds per call at T=2048) gets none,
to keep the default run short -- the median of --reps absorbs a slow first call. On a shared machine both times
swing with the load of other processes (2 OpenMP threads wait for each other at every small op), so the load
average is printed before and after.

    .venv/bin/python bench/op_gla.py [--T 512 2048] [--B 2] [--H 4] [--K 64] [--V 64] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from canonlm.ops._fla_naive import fla_version, load_fla_naive
from canonlm.ops.gla import chunk_gla_reference


def _inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen)) / 16
    h0 = torch.randn(B, H, K, V, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    dh = torch.randn(B, H, K, V, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, h0)], do, dh


def _fwd_bwd(fn, leaves, do, dh):
    for t in leaves:
        t.grad = None
    o, ht = fn(*leaves)
    ((o * do).sum() + (ht * dh).sum()).backward()
    return o.detach(), ht.detach(), [t.grad.clone() for t in leaves]


def _time(fn, leaves, do, dh, reps: int, warmup: bool) -> tuple[float, float, tuple]:
    """(median ms, min ms of ``reps`` fwd+bwd calls [after one warm-up call], results of the last call)."""
    if warmup:
        _fwd_bwd(fn, leaves, do, dh)
    ts, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = _fwd_bwd(fn, leaves, do, dh)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, min(ts) * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[2048], help="sequence lengths (default 2048)")
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=64, help="chunk_size of the reference")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    naive = load_fla_naive("gla")
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, fla-core {fla_version()}, fp32 CPU, "
        f"B={args.B} H={args.H} K={args.K} V={args.V}, chunk {args.chunk}, median of {args.reps} fwd+bwd"
    )

    def ours(q, k, v, g, h0):
        return chunk_gla_reference(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=args.chunk)

    def theirs(q, k, v, g, h0):  # fixed scale K**-0.5 = our default; returns (o, final_state)
        return naive.naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)

    print(f"load average {os.getloadavg()[0]:.2f}")
    print(
        f"{'T':>6} {'chunk_gla_reference ms':>23} {'naive_recurrent_gla ms':>23} {'ratio':>7}  max|diff| o, state, "
        f"dq, dk, dv, dg, dh0   [min ms: reference, naive]"
    )
    for T in args.T:
        leaves, do, dh = _inputs(args.B, T, args.H, args.K, args.V)
        t_ours, m_ours, r_ours = _time(ours, leaves, do, dh, args.reps, warmup=True)
        if naive is None:
            print(f"{T:>6} {t_ours:>23.1f} {'(fla-core missing)':>23}")
            continue
        t_naive, m_naive, r_naive = _time(theirs, leaves, do, dh, args.reps, warmup=False)
        diffs = [
            (a - b).abs().max().item()
            for a, b in zip([r_ours[0], r_ours[1], *r_ours[2]], [r_naive[0], r_naive[1], *r_naive[2]])
        ]
        print(
            f"{T:>6} {t_ours:>23.1f} {t_naive:>23.1f} {t_naive / t_ours:>6.1f}x  "
            + ", ".join(f"{d:.1e}" for d in diffs)
            + f"   [{m_ours:.1f}, {m_naive:.1f}]",
            flush=True,
        )
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
