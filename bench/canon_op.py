"""Canon op micro-benchmark: fwd+bwd ms of one Canon at [B, T, C] per backend.

Backends: reference (F.conv1d), torch (shift-and-add), cpu (native C kernel) and, for scale, a same-width
nn.Linear(C, C). Widths default to the 4L/256D Llama's Canon widths (A/C 256, B 768, D 1408); fp32 and bf16 (x in
bf16, weight fp32 as under autocast; the Linear runs under bf16 autocast). Prints ms (min or median of --reps) and the
ratios measured in this run, plus the native kernel's effective memory traffic (fwd reads x, writes y; bwd reads
dy and x, writes dx).

    .venv/bin/python bench/canon_op.py [--threads 2] [--reps 20] [--widths 256 768 1408] [--rows] [--stat median]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from canonlm.ops.canon import _native, causal_conv1d


STAT = "min"


def _time(fn, reps: int, warmup: int = 3) -> float:
    """ms per call: min (default; robust to other processes on a shared box) or median of ``reps`` calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return (min(ts) if STAT == "min" else statistics.median(ts)) * 1e3


def bench_width(B: int, T: int, C: int, K: int, dtype: torch.dtype, reps: int, impls) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, C, generator=g).to(dtype).requires_grad_()
    w = (torch.rand(C, K, generator=g) - 0.5).requires_grad_()
    dy = torch.randn(B, T, C, generator=g).to(dtype)
    out = {}

    def run(backend):
        def f():
            x.grad = w.grad = None
            y = causal_conv1d(x, w, backend=backend)
            y.backward(dy)

        return f

    out["reference"] = _time(run("reference"), reps)
    out["torch"] = _time(run("torch"), reps)
    if _native.available():
        for impl in impls:
            _native.IMPL = impl
            name = "cpu" if impl == 0 else "cpu_rows"
            out[name] = _time(run("cpu"), reps)
            with torch.no_grad():  # fwd only, for the fwd/bwd split
                out[name + "_fwd"] = _time(lambda: causal_conv1d(x, w, backend="cpu"), reps)
        _native.IMPL = 0

    lin = torch.nn.Linear(C, C)
    xl = torch.randn(B, T, C, generator=g).requires_grad_()
    dyl = torch.randn(B, T, C, generator=g).to(dtype)

    def f_lin():
        xl.grad = None
        lin.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = lin(xl.to(dtype) if dtype != torch.bfloat16 else xl)
        y.backward(dyl.to(y.dtype))

    out["linear"] = _time(f_lin, reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--kernel", type=int, default=4)
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 768, 1408])
    ap.add_argument(
        "--rows", action="store_true", help="also time the native row (ring-buffer) kernel, impl 1, as 'cpu_rows'"
    )
    ap.add_argument(
        "--subblock", type=int, default=_native.SUBBLOCK, help="time rows per sub-block of the register-window kernel"
    )
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--stat", choices=["min", "median"], default="min")
    args = ap.parse_args()
    global STAT
    STAT = args.stat
    torch.set_num_threads(args.threads)
    _native.set_subblock(args.subblock)
    impls = [0, 1] if args.rows else [0]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, native kernel: "
        f"{'yes' if _native.available() else _native.unavailable_reason()}"
        f"{' (OpenMP)' if _native.has_openmp() else ''}; [B, T, C] = [{args.batch}, {args.seq}, C], K={args.kernel}"
    )
    print(f"fwd+bwd ms, {args.stat} of {args.reps}")
    # per-call overhead of the custom op path (tiny input: dispatch + ctypes, no real work)
    xt = torch.randn(1, 4, 8, requires_grad=True)
    wt = torch.randn(8, args.kernel, requires_grad=True)
    if _native.available():

        def tiny():
            causal_conv1d(xt, wt, backend="cpu").sum().backward()

        print(f"native op overhead, tiny [1, 4, 8] fwd+bwd+sum: {_time(tiny, 200) * 1e3:.0f} us")
    results: dict[str, dict[int, dict[str, float]]] = {}
    for dn in args.dtypes:
        dt = dtypes[dn]
        for C in args.widths:
            r = bench_width(args.batch, args.seq, C, args.kernel, dt, args.reps, impls)
            results.setdefault(dn, {})[C] = r
            line = f"{dn} C={C:5d}: " + "  ".join(f"{k} {v:7.2f}" for k, v in r.items())
            if "cpu" in r:
                n = args.batch * args.seq * C * (2 if dt == torch.bfloat16 else 4)
                bw = 5 * n / (r["cpu"] * 1e-3) / 1e9
                line += (
                    f"\n    ratios: reference/cpu {r['reference'] / r['cpu']:.1f}x  torch/cpu "
                    f"{r['torch'] / r['cpu']:.1f}x  cpu/linear {r['cpu'] / r['linear']:.2f}  "
                    f"(native fwd {r['cpu_fwd']:.2f} ms, bwd ~{r['cpu'] - r['cpu_fwd']:.2f} ms; "
                    f"~{bw:.1f} GB/s moved)"
                )
            print(line, flush=True)
    if {256, 768, 1408} <= set(args.widths):
        # Canon-ABCD of the 4L/256D Llama: 4 layers x (A 256 + B 768 + C 256 + D 1408)
        print("Canon-ABCD op time of one 4L/256D step, 4 x (2 x C256 + C768 + C1408), fwd+bwd ms:")
        for dn, per_w in results.items():
            keys = [k for k in per_w[256] if not k.endswith("_fwd")]
            est = {k: 4 * (2 * per_w[256][k] + per_w[768][k] + per_w[1408][k]) for k in keys}
            print(f"  {dn}: " + "  ".join(f"{k} {v:6.1f}" for k, v in est.items()))


if __name__ == "__main__":
    main()
