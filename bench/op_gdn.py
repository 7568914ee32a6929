"""GDN op micro-benchmark (Yang et al. 2025): fwd+bwd time of one gated-delta-rule call
on CPU, fp32, at [B, T, H, K/V], measured in one run:

* canonlm ``chunk_gated_delta_rule_reference`` (chunked WY/UT form, chunk 64),
* fla ``naive_recurrent_gated_delta_rule`` (token loop; the baseline the >= 10x target refers to),
* fla ``naive_chunk_gated_delta_rule`` (for information).

fla's naive references are loaded by file path (no triton needed, ``canonlm.ops._fla_naive``); they do not
L2-normalise q/k, so every implementation gets the same pre-normalised keys and ``use_qk_l2norm=False``. Prints the
median (and min) ms of ``--reps`` timed calls after one warm-up (fla's naive_recurrent: ``--naive-reps`` calls, the first one timed too, since
one call takes seconds), the ratios, and a max-abs-diff sanity line (o, final
state and all input gradients vs the naive recurrent reference). The box may be shared: the load average is printed.

    .venv/bin/python bench/op_gdn.py [--T 2048] [--B 2] [--H 4] [--K 64] [--V 64] [--reps 5] [--naive-reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from canonlm.ops._fla_naive import fla_version, load_fla_naive
from canonlm.ops.gdn import chunk_gated_delta_rule_reference


def _time(fn, reps: int, warmup: bool = True) -> tuple[float, float, object]:
    """(median ms, min ms, result of the first call) over ``reps`` timed calls; the first call is an untimed warm-up
    unless ``warmup`` is False (then it is timed too)."""
    ts = []
    t0 = time.perf_counter()
    first = fn()
    if not warmup:
        ts.append(time.perf_counter() - t0)
    for _ in range(reps - len(ts)):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, min(ts) * 1e3, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--naive-reps",
        type=int,
        default=3,
        help="timed calls of fla's naive_recurrent (no separate warm-up: a pure Python token loop; ~10-30 s "
        "per call at T=2048 on 2 cores)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--no-naive-chunk", action="store_true", help="skip fla's naive_chunk_gated_delta_rule")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    B, T, H, K, V = a.B, a.T, a.H, a.K, a.V
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(B, H, K, V, generator=gen) * 0.1
    do = torch.randn(B, T, H, V, generator=gen)
    dS = torch.randn(B, H, K, V, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]

    def runner(call):
        def f():
            for t in leaves:
                t.grad = None
            o, S = call(*leaves)
            torch.autograd.backward([o, S], [do, dS])
            return [o.detach(), S.detach()] + [t.grad.clone() for t in leaves]

        return f

    impls = {
        "canonlm chunk (reference)": runner(
            lambda q, k, v, g, b, h: chunk_gated_delta_rule_reference(
                q, k, v, g, b, initial_state=h, output_final_state=True, use_qk_l2norm=False, chunk_size=a.chunk_size
            )
        )
    }
    m = load_fla_naive("gated_delta_rule")
    if m is not None:
        impls["fla naive_recurrent"] = runner(
            lambda q, k, v, g, b, h: m.naive_recurrent_gated_delta_rule(
                q, k, v, b, g, initial_state=h * 1.0, output_final_state=True
            )
        )
        if not a.no_naive_chunk:
            impls["fla naive_chunk"] = runner(
                lambda q, k, v, g, b, h: m.naive_chunk_gated_delta_rule(
                    q, k, v, g, b, chunk_size=64, initial_state=h * 1.0, output_final_state=True
                )
            )
    else:
        print("fla-core gated_delta_rule/naive.py not available: timing canonlm only")

    print(
        f"GDN fwd+bwd, fp32 CPU, B={B} T={T} H={H} K={K} V={V}, threads={a.threads}, median (min) ms, "
        f"chunk={a.chunk_size}, fla-core {fla_version()}, torch {torch.__version__}"
    )
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    times, mins, results = {}, {}, {}
    for name, fn in impls.items():
        slow = name == "fla naive_recurrent"
        reps = a.naive_reps if slow else a.reps
        med, mn, results[name] = _time(fn, reps, warmup=not slow)
        times[name], mins[name] = med, mn
        print(f"  {name:28s} {med:10.1f} ms  (min {mn:.1f}, {reps} reps)", flush=True)
    print(f"load average after:  {os.getloadavg()[0]:.2f}")
    base = "canonlm chunk (reference)"
    for name in times:
        if name != base:
            print(
                f"  speed-up of canonlm chunk vs {name}: {times[name] / times[base]:.1f}x by median, "
                f"{mins[name] / mins[base]:.1f}x by min (min is robust to other processes on a shared box)"
            )
    if "fla naive_recurrent" in results:
        labels = ("o", "S", "dq", "dk", "dv", "dg", "dbeta", "dh0")
        for name in results:
            if name == "fla naive_recurrent":
                continue
            diffs = [(x - y).abs().max().item() for x, y in zip(results[name], results["fla naive_recurrent"])]
            print(f"  max |{name} - naive_recurrent|: " + ", ".join(f"{lbl} {d:.1e}" for lbl, d in zip(labels, diffs)))


if __name__ == "__main__":
    main()
