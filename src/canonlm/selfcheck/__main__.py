"""``python -m canonlm.selfcheck``: the lists of checks (GPU, CPU) and the command line (see the package docstring)."""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import canonlm.selfcheck as package
from canonlm.selfcheck.environment import NO_CUDA, NO_CUDA_MESSAGE, need_cuda, versions
from canonlm.selfcheck.kernels import check_cpu_attention, check_cpu_canon_native, kernel_checks
from canonlm.selfcheck.models import CANON_SETS, PRESETS, check_model_decode, check_model_fast_vs_reference
from canonlm.selfcheck.numerics import precision_note
from canonlm.selfcheck.references import check_cpu_canon_reference_loop, check_cpu_linear_reference
from canonlm.selfcheck.report import render, write_report
from canonlm.selfcheck.training import TrainSpec, run_training
from canonlm.selfcheck.verdict import FAIL, SKIP, Result, Skip, run_check


def gpu_checks(args, workdir: Path) -> list[tuple[str, Callable[[], tuple[str, str]]]]:
    """Every GPU check as ``(name, fn)`` (names are known without CUDA, so they can be listed as SKIP)."""
    dts = ["bf16"] if args.quick else ["fp32", "bf16"]
    out: list = [(name, fn) for name, _, _, fn in kernel_checks("cuda", dts)]
    for arch in PRESETS:
        if not args.quick:
            out.append((f"model {arch} fast vs reference (cuda, bf16)",
                        functools.partial(check_model_fast_vs_reference, arch)))
        out.append((f"model {arch} decode == full forward (cuda, fp32)", functools.partial(check_model_decode, arch)))
    bs = args.batch
    common = [f"model.size={args.size}", "task=depo1", "trainer=gpu", "trainer.devices=1",
              "trainer.log_every_n_steps=5", f"data.batch_size={bs}"]
    for arch, sets in CANON_SETS.items():
        for canon in (sets[1:] if args.quick else sets):
            label = f"train {arch} canon={canon} {args.size} {args.steps} steps (1 GPU, bf16-mixed)"
            spec = TrainSpec(label, arch, canon, common, args.steps, 1, "cuda", 1200)
            out.append((label, lambda s=spec: _gpu_train(s, workdir)))
    for arch in (("llama",) if args.quick else ("llama", "gla")):
        canon = CANON_SETS[arch][1]
        label = f"fsdp2 {arch} canon={canon} {args.size} {args.steps} steps (all GPUs)"
        out.append((label, lambda a=arch, c=canon, lb=label: _fsdp2(a, c, lb, args, workdir)))
    return out


def _gpu_train(spec: TrainSpec, workdir: Path) -> tuple[str, str]:
    need_cuda("cuda")
    return run_training(spec, workdir)


def _fsdp2(arch: str, canon: str, label: str, args, workdir: Path) -> tuple[str, str]:
    import torch

    need_cuda("cuda")
    n = torch.cuda.device_count()
    if n < 2:
        raise Skip(f"needs >= 2 GPUs ({n} visible)")
    over = [f"model.size={args.size}", "task=depo1", "trainer=gpu", f"trainer.devices={n}",
            "trainer.precision=32-true", "strategy=fsdp2", "trainer.log_every_n_steps=5",
            f"data.batch_size={args.batch * n}"]
    return run_training(TrainSpec(label, arch, canon, over, args.steps, n, "cuda", 1800), workdir)


def cpu_checks(args, workdir: Path) -> list[tuple[str, Callable[[], tuple[str, str]]]]:
    """The checks that run on the CPU (always run; on a CUDA machine they are the CPU half of the report)."""
    out: list = [("cpu canon/cpu native kernel fp32 fwd+bwd", lambda: check_cpu_canon_native("fp32"))]
    if not args.quick:
        out.append(("cpu canon/cpu native kernel bf16 fwd+bwd", lambda: check_cpu_canon_native("bf16")))
    out += [("cpu canon reference + decode step vs loop (fp64)", check_cpu_canon_reference_loop),
            ("cpu attention sdpa fp32 fwd+bwd + decode", check_cpu_attention)]
    for op in ("gla", "gdn", "ssd"):
        out.append((f"cpu {op} chunked reference vs recurrence (fp64) fwd+bwd",
                    lambda o=op: check_cpu_linear_reference(o)))
    for arch in PRESETS:
        out.append((f"cpu model {arch} decode == full forward (fp32)",
                    functools.partial(check_model_decode, arch, "cpu", "2L64D", fast=False)))
    tiny = ["model.size=2L64D", "task=depo1_cpu", "task.N=8", "task.K=4", "task.vocab_V=6", "task.context=128",
            "data.batch_size=4", "trainer=cpu", "trainer.log_every_n_steps=1"]
    for arch, sets in CANON_SETS.items():
        if args.quick and arch != "llama":
            continue
        canon = sets[1]
        label = f"cpu train {arch} canon={canon} 2L64D 5 steps"
        spec = TrainSpec(label, arch, canon, tiny, 5, 1, "cpu", 300)
        out.append((label, lambda s=spec: run_training(s, workdir)))
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m canonlm.selfcheck", description=package.__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="report path (default: selfcheck-<date>.md in the current directory)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing --out")
    ap.add_argument("--quick", action="store_true",
                    help="fewer checks: bf16 kernels only, decode model checks, Canon runs only, FSDP2 llama only")
    ap.add_argument("--steps", type=int, default=30, help="training steps per GPU run (default 30)")
    ap.add_argument("--size", default="12L768D", help="model size of the GPU training runs (default 12L768D)")
    ap.add_argument("--batch", type=int, default=8, help="windows of 2048 tokens per GPU per step (default 8)")
    ap.add_argument("--keep", action="store_true", help="keep the training run directories (default: removed "
                    "unless a training line failed)")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    """Command line entry point; returns the exit code (0 no FAIL, 1 a FAIL, 2 refused)."""
    args = _parser().parse_args(argv)
    if args.steps < 2 or args.batch < 1:
        print("selfcheck: error: --steps must be >= 2 and --batch >= 1", file=sys.stderr)
        return 2
    started = datetime.datetime.now()
    out = Path(args.out) if args.out else Path.cwd() / f"selfcheck-{started:%Y-%m-%d}.md"
    if out.exists() and not args.force:
        print(f"selfcheck: error: {out} exists; pass --force to overwrite it or --out to choose another file",
              file=sys.stderr)
        return 2

    import torch

    cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if cuda else 0
    if not cuda:
        print(NO_CUDA_MESSAGE, flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="canonlm-selfcheck-"))
    results: list[Result] = []
    t0 = time.perf_counter()

    def emit(r: Result) -> None:
        results.append(r)
        print(f"[{r.status}] {r.name} ({r.seconds:.1f} s): {r.detail}", file=sys.stderr, flush=True)

    try:
        for name, fn in gpu_checks(args, workdir):
            emit(run_check(name, fn) if cuda else Result(SKIP, NO_CUDA, name=name, seconds=0.0))
        for name, fn in cpu_checks(args, workdir):
            emit(run_check(name, fn))
    finally:
        failed_train = any(r.status == FAIL and ("train" in r.name or "fsdp2" in r.name) for r in results)
        if args.keep or failed_train:
            print(f"selfcheck: training run directories kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    header = {"date": started.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node() or "unknown",
              "command": "python -m canonlm.selfcheck " + " ".join(sys.argv[1:] if argv is None else argv),
              "mode": (f"CUDA, {n_gpu} GPU(s) visible" if cuda else NO_CUDA_MESSAGE + "; CPU subset only")
              + (", --quick" if args.quick else ""),
              "fp32 precision of Triton tl.dot": precision_note(),
              "wall time": f"{time.perf_counter() - t0:.0f} s"}
    text = render(results, versions(), header)
    print(text, flush=True)
    try:
        write_report(out, text, args.force)
    except FileExistsError:
        print(f"selfcheck: error: {out} appeared while the checks ran; not overwritten (use --force)",
              file=sys.stderr)
        return 2
    print(f"selfcheck: report written to {out}", file=sys.stderr)
    return 1 if any(r.status == FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
