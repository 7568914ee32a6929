"""``python -m canonlm.selfcheck``: the command line (see the package docstring and docs/selfcheck.md)."""

from __future__ import annotations

import argparse
import datetime
import getpass
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import canonlm.selfcheck as package
from canonlm.selfcheck.environment import NO_CUDA_MESSAGE, versions
from canonlm.selfcheck.numerics import precision_note
from canonlm.selfcheck.plan import TRAIN_DEFAULTS, Options, build_plan, with_workdir
from canonlm.selfcheck.report import format_line, render, write_report
from canonlm.selfcheck.runner import _setup_process, run_plan
from canonlm.selfcheck.triton_hooks import AUTOTUNE_MODES
from canonlm.selfcheck.verdict import FAIL, Result

#: Default time budgets (seconds): full run / --quick.
BUDGET_S = {False: 300.0, True: 120.0}
#: GiB of GPU memory per training run allowed to run at once (a 12L768D run peaks near 20 GiB).
GIB_PER_TRAINING = 35


def default_jobs() -> int:
    """Worker processes at once: half the CPU cores (each compiling worker keeps one busy; training runs and data
    loaders use the rest), at least 2, at most 8."""
    return min(8, max(2, (os.cpu_count() or 2) // 2))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m canonlm.selfcheck", description=package.__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="report path (default: selfcheck-<date>.md in the current directory)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing --out")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="fewer lines: bf16 kernels, the decode model lines, training llama and gla only (4L256D, "
        "10 steps), FSDP2 llama only, the CPU lines without bf16 and with llama training only; "
        "budget 120 s",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-time budget in seconds (default 300; 120 with --quick): lines not finished by then "
        "are SKIP with the reason",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"worker processes at once (default: half the CPU cores, 2 to 8; here {default_jobs()})",
    )
    ap.add_argument(
        "--autotune",
        choices=AUTOTUNE_MODES,
        default="first",
        help="first: Triton autotuners take the first config that runs (default; a config changes "
        "speed, not results); full: benchmark every config, as training does (many more compiles)",
    )
    ap.add_argument(
        "--size",
        default=None,
        help=f"model size of the GPU training lines (default {TRAIN_DEFAULTS[False][0]}; "
        f"{TRAIN_DEFAULTS[True][0]} with --quick)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps of each GPU training line (default {TRAIN_DEFAULTS[False][1]}; "
        f"{TRAIN_DEFAULTS[True][1]} with --quick)",
    )
    ap.add_argument("--batch", type=int, default=8, help="windows of 2048 tokens per GPU per step (default 8)")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the run directory (training runs, worker logs; default: removed unless a line failed)",
    )
    ap.add_argument("--list", action="store_true", help="print the lines this command would run, then exit")
    return ap


def _bad(args) -> Optional[str]:
    """The first bad option (name, value, what is allowed), or None."""
    if args.steps is not None and args.steps < 2:
        return f"--steps {args.steps}: allowed: an integer >= 2"
    if args.batch < 1:
        return f"--batch {args.batch}: allowed: an integer >= 1"
    if args.budget_s is not None and not args.budget_s > 0:
        return f"--budget-s {args.budget_s}: allowed: a number of seconds > 0"
    if args.jobs is not None and args.jobs < 1:
        return f"--jobs {args.jobs}: allowed: an integer >= 1"
    if args.size is not None:
        from canonlm.arch.config import parse_size
        from canonlm.errors import ConfigError

        try:
            parse_size(args.size)
        except ConfigError as e:
            return f"--size {args.size}: allowed: {e.allowed}"
    return None


def _cache_dirs() -> dict[str, Path]:
    """Where Triton and inductor keep their compiled kernels in this process's environment."""
    triton = os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache"
    )
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 -- no user name (container without a passwd entry)
        user = "unknown"
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return {"Triton": Path(triton), "inductor": Path(inductor)}


def _entries(d: Path) -> int:
    try:
        return sum(1 for _ in d.iterdir())
    except OSError:
        return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Command line entry point; returns the exit code (0 no FAIL, 1 a FAIL, 2 refused)."""
    args = _parser().parse_args(argv)
    bad = _bad(args)
    if bad:
        print(f"selfcheck: error: {bad}", file=sys.stderr)
        return 2
    started = datetime.datetime.now()
    t0 = time.time()
    out = Path(args.out) if args.out else Path.cwd() / f"selfcheck-{started:%Y-%m-%d}.md"
    if not args.list and out.exists() and not args.force:
        print(
            f"selfcheck: error: {out} exists; pass --force to overwrite it or --out to choose another file",
            file=sys.stderr,
        )
        return 2
    budget = args.budget_s if args.budget_s is not None else BUDGET_S[args.quick]
    jobs = args.jobs or default_jobs()
    opts = Options(quick=args.quick, size=args.size, steps=args.steps, batch=args.batch, autotune=args.autotune)

    import torch

    cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if cuda else 0
    plan = build_plan(opts, cuda, n_gpu)
    if args.list:
        for s in plan:
            what = [f"group {s.group}"] + (
                [f"~{s.est_compiles} Triton kernels to compile cold"] if s.est_compiles else []
            )
            what += [f"here: {s.static[0]} ({s.static[1]})"] if s.static else []
            print(f"{s.name}  [{'; '.join(what)}]")
        print(
            f"selfcheck: {len(plan)} lines ({sum(s.static is None for s in plan)} to run), budget {budget:.0f} s, "
            f"{jobs} workers at once",
            file=sys.stderr,
        )
        return 0
    _setup_process()  # the kernel cache (after --list, which writes nothing)
    if not cuda:
        print(NO_CUDA_MESSAGE, flush=True)
    heavy = 1
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        heavy = max(1, min(4, int(total // GIB_PER_TRAINING)))
    caches = _cache_dirs()
    before = {k: _entries(d) for k, d in caches.items()}
    workdir = Path(tempfile.mkdtemp(prefix="canonlm-selfcheck-"))
    n_run = sum(s.static is None for s in plan)
    print(
        f"selfcheck: {n_run} of {len(plan)} lines to run in {len({s.group for s in plan if s.static is None})} "
        f"groups, up to {jobs} worker processes at once, budget {budget:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    notes: list[str] = []

    def emit(r: Result) -> None:
        print(format_line(r), file=sys.stderr, flush=True)

    def note(text: str) -> None:
        notes.append(text)
        print(f"selfcheck: note: {text}", file=sys.stderr, flush=True)

    results: list[Result] = []

    def terminated(signum, frame):  # an outer timeout: stop the workers (run_plan's finally), then exit
        raise SystemExit(128 + signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if main_thread else None
    try:
        results, stats = run_plan(
            with_workdir(plan, str(workdir)),
            workdir=workdir,
            budget_s=budget,
            jobs=jobs,
            heavy_slots=heavy,
            quick=args.quick,
            autotune=args.autotune,
            cuda=cuda,
            emit=emit,
            note=note,
            t0=t0,
        )
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        if args.keep or any(r.status == FAIL for r in results):
            print(f"selfcheck: run directory (training runs, worker logs) kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    wall = time.time() - t0
    ran = [r for r in results if r.compile_s is not None and r.seconds > 0]
    after = {k: _entries(d) for k, d in caches.items()}
    left_out = stats["not_run"] + stats["stopped"]
    header = {
        "date": started.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node() or "unknown",
        "command": "python -m canonlm.selfcheck " + " ".join(sys.argv[1:] if argv is None else argv),
        "mode": (f"CUDA, {n_gpu} GPU(s) visible" if cuda else NO_CUDA_MESSAGE + "; CPU lines only")
        + (", --quick" if args.quick else ""),
        "wall time": f"{wall:.0f} s; summed over the lines that ran: compile {sum(r.compile_s for r in ran):.0f} s, "
        f"check {sum(r.check_s for r in ran):.0f} s (groups of lines run in parallel)",
        "time budget": f"{budget:.0f} s (--budget-s): "
        + (
            f"{stats['not_run']} lines not run and {stats['stopped']} stopped by it (SKIP)"
            if left_out
            else "every line finished within it"
        ),
        "workers": f"{stats['workers']} processes, up to {jobs} at once (--jobs), at most {heavy} GPU training "
        f"run(s) at once"
        + (
            f"; start-up {stats['startup_s']:.1f} s each (median; not in the lines' times)"
            if stats.get("startup_s") is not None
            else ""
        ),
        "autotune": (
            "first config that runs (--autotune first: a config changes speed, not results; training "
            "lines' throughput is not a benchmark)"
            if args.autotune == "first"
            else "full (--autotune full: every config compiled and benchmarked, as training does)"
        ),
        "kernel cache": "; ".join(
            f"{k} {d} ({before[k]:,} entries before this run, {after[k]:,} after)" for k, d in caches.items()
        )
        + ": a second run loads the kernels this one compiled instead of compiling them",
        "fp32 precision of Triton tl.dot": precision_note(),
    }
    if notes:
        header["notes"] = "; ".join(notes)
    text = render(results, versions(), header)
    print(text, flush=True)
    try:
        write_report(out, text, args.force)
    except FileExistsError:
        print(f"selfcheck: error: {out} appeared while the checks ran; not overwritten (use --force)", file=sys.stderr)
        return 2
    print(f"selfcheck: report written to {out} ({wall:.0f} s)", file=sys.stderr)
    return 1 if any(r.status == FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
