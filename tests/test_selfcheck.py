"""``python -m canonlm.selfcheck``: the CPU run end to end (report, SKIP lines, compile / check times, refusal to
overwrite), the lines of the full and ``--quick`` plans, the time budget (lines stopped or not run, SKIP with the
reason; a crashed worker; the exit code; nothing left running), the verdict rules (a fallback to the reference is never
a PASS), the fp32 tolerance rule (``TRITON_F32_DEFAULT``), first-config autotuning on a real Triton ``Autotuner``, the
counting of the kernels that really ran, and the GPU harness dry-run on the CPU with the fast backends resolving there
and every fast entry point replaced by a CPU stand-in computing the reference (the compile-friendly Canon line runs
for real, compiled by inductor for the CPU)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch


from canonlm.errors import ConfigError
from canonlm.ops import backend_calls, forget_backend_choices
from canonlm.selfcheck import environment as env
from canonlm.selfcheck import kernels, models, numerics, plan, training, triton_hooks, verdict
from canonlm.selfcheck.report import write_report
from canonlm.selfcheck.runner import LineSpec
from canonlm.selfcheck.verdict import FAIL, PASS, SKIP, Skip, judge_kernel, run_check

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")
HERE = Path(__file__).resolve().parent


def _selfcheck(args, cwd, timeout=400):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, "-m", "canonlm.selfcheck", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


def _rows(report: str) -> dict[str, dict]:
    """{line name: {status, compile, check, kernels, detail}} from the report's checks table (times as floats, None
    when empty)."""
    out = {}
    for line in report.split("## Checks", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 6 and cells[0] in (PASS, FAIL, SKIP):
            out[cells[1]] = dict(
                status=cells[0],
                compile=float(cells[2]) if cells[2] else None,
                check=float(cells[3]) if cells[3] else None,
                kernels=cells[4],
                detail=cells[5],
            )
    return out


#: A printed result line: ``[STATUS] name (compile 1.2 s, check 0.3 s): detail`` (or ``(not run)``).
PRINTED = re.compile(
    r"^\[(PASS|FAIL|SKIP)\] (.+?) \((compile (\d+\.\d) s(?: \[[^\]]*\])?, check (\d+\.\d) s|not run|"
    r"stopped after (\d+\.\d) s)\): (.*)$"
)


def _printed(stderr: str) -> dict[str, tuple]:
    """{line name: (status, compile s or None, check s or None, detail)} from the lines printed as results came."""
    out = {}
    for line in stderr.splitlines():
        m = PRINTED.match(line)
        if m:
            c, k = m.group(4), m.group(5)
            out[m.group(2)] = (m.group(1), None if c is None else float(c), None if k is None else float(k), m.group(7))
    return out


#: The CPU lines of a --quick run (docs/selfcheck.md): no bf16 native line, training llama only.
QUICK_CPU = (
    [
        "cpu canon/cpu native kernel fp32 fwd+bwd",
        "cpu canon reference + decode step vs loop (fp64)",
        "cpu attention sdpa fp32 fwd+bwd + decode",
    ]
    + [f"cpu {op} chunked reference vs recurrence (fp64) fwd+bwd" for op in ("gla", "gdn", "ssd")]
    + [f"cpu model {a} decode == full forward (fp32)" for a in ("llama", "gla", "gdn", "mamba2")]
    + [f"cpu model {a} doc-mask == documents alone (fp32)" for a in ("llama", "gla", "gdn", "mamba2")]
    + ["cpu train llama canon=ABCD 2L64D 5 steps"]
)


@CPU_ONLY
@pytest.mark.slow
def test_cpu_quick_run_writes_the_report_with_compile_and_check_times(tmp_path, capsys):
    out = tmp_path / "r.md"
    p = _selfcheck(["--quick", "--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert env.NO_CUDA_MESSAGE in p.stdout
    report = out.read_text()
    assert report.strip() in p.stdout  # printed as well
    versions = report.split("## Versions", 1)[1].split("## Checks", 1)[0]
    for name in ("torch", "lightning", "triton", "fla-core", "flash-attn", "causal-conv1d", "mamba-ssm"):
        assert f"| {name} |" in versions, name
    assert "| CUDA (torch build) |" in versions
    rows, printed = _rows(report), _printed(p.stderr)
    assert set(printed) == set(rows)  # every line printed as it came, and in the report
    gpu = {n: r for n, r in rows.items() if not n.startswith("cpu ")}
    cpu = {n: r for n, r in rows.items() if n.startswith("cpu ")}
    assert any(n.startswith("kernel gla/fla") for n in gpu) and any(n.startswith("fsdp2") for n in gpu)
    assert any(n.startswith("train ") for n in gpu) and any(n.startswith("model ") for n in gpu)
    assert all(
        (r["status"], r["detail"], r["compile"], r["check"]) == (SKIP, env.NO_CUDA, None, None) for r in gpu.values()
    ), gpu
    assert all(printed[n][:3] == (SKIP, None, None) for n in gpu)  # printed "(not run)"
    assert list(cpu) == QUICK_CPU
    assert all(r["status"] == PASS for r in cpu.values()), cpu
    # every CPU line states its compile and check times, in the report and as printed
    for n, r in cpu.items():
        assert r["compile"] is not None and r["check"] is not None, (n, r)
        assert printed[n][1:3] == (r["compile"], r["check"]), (n, printed[n], r)
    train = cpu["cpu train llama canon=ABCD 2L64D 5 steps"]
    assert train["compile"] >= 1.0 and train["check"] > 0  # a train.py start-up (python, torch, lightning) > 1 s
    assert "tokens/s" in train["detail"] and "attention=sdpa:" in train["detail"]  # counted in the subprocess
    assert "ran canon=cpu:" in cpu["cpu canon/cpu native kernel fp32 fwd+bwd"]["detail"]
    assert f"- fp32 precision of Triton tl.dot: {numerics.triton_fp32_precision()} (" in report
    assert "- time budget: 120 s (--budget-s): every line finished within it" in report
    assert "- kernel cache: Triton " in report and "- autotune: first config that runs" in report
    assert "(15 PASS, 0 FAIL," in report
    for a in ("llama", "gla", "gdn", "mamba2"):  # document masking: a packed window == each document alone
        assert (
            "7 documents in 2 rows of 48 tokens vs each alone"
            in cpu[f"cpu model {a} doc-mask == documents alone (fp32)"]["detail"]
        )
    # an existing report is not overwritten (refused before anything runs)
    from canonlm.selfcheck.__main__ import main

    before = out.read_text()
    assert main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and "--force" in err and out.read_text() == before


def test_full_and_quick_plans(capsys):
    """The lines of both modes, as docs/selfcheck.md lists them (an independent list: names built here from the
    documented rules, not read from the plan), their groups, and ``--list``."""
    full = plan.build_plan(plan.Options(), cuda=True, n_gpu=1)
    quick = plan.build_plan(plan.Options(quick=True), cuda=True, n_gpu=1)
    kernel = {
        dt: [f"kernel canon/{b} {dt} {m}" for b in ("dao", "fla") for m in ("fwd+bwd", "decode")]
        + [f"kernel canon/torch compiled {dt} fwd+bwd"]
        + [
            f"kernel attention/{b} {dt} {m}"
            for b in ("sdpa", "flash")
            if not (b == "flash" and dt == "fp32")
            for m in ("fwd+bwd", "decode")
        ]
        + [f"kernel {o} {dt} {m}" for o in ("gla/fla", "gdn/fla", "ssd/mamba_ssm") for m in ("fwd+bwd", "decode")]
        + [f"kernel ssd/mamba_ssm fused split {dt} fwd+bwd"]
        + [
            f"kernel {o} {dt} doc-mask ({how}) fwd+bwd"
            for o, how in (("gla/fla", "cu_seqlens"), ("gdn/fla", "cu_seqlens"), ("ssd/mamba_ssm", "seq_idx"))
        ]
        for dt in ("fp32", "bf16")
    }
    archs = ("llama", "gla", "gdn", "mamba2")
    sets = {"llama": "ABCD", "gla": "AbCD", "gdn": "AbCD", "mamba2": "AbCD"}
    want_full = (
        kernel["fp32"]
        + kernel["bf16"]
        + [
            n
            for a in archs
            for n in (
                f"model {a} fast vs reference (cuda, bf16)",
                f"model {a} decode == full forward (cuda, fp32)",
                f"model {a} doc-mask == documents alone (cuda, fp32)",
            )
        ]
        + [f"train {a} canon={sets[a]} 12L768D 20 steps (1 GPU, bf16-mixed)" for a in archs]
        + [f"fsdp2 {a} canon={sets[a]} 12L768D 20 steps (all GPUs)" for a in ("llama", "gla")]
    )
    want_quick = (
        kernel["bf16"]
        + [
            "model llama decode == full forward (cuda, fp32)",  # llama: Canon-ABCD masked
            "model llama doc-mask == documents alone (cuda, fp32)",
        ]
        + [f"model {a} decode == full forward (cuda, fp32)" for a in archs[1:]]
        + [f"train {a} canon={sets[a]} 4L256D 10 steps (1 GPU, bf16-mixed)" for a in ("llama", "gla")]
        + ["fsdp2 llama canon=ABCD 4L256D 10 steps (all GPUs)"]
        + QUICK_CPU
    )
    want_full += (
        [QUICK_CPU[0], "cpu canon/cpu native kernel bf16 fwd+bwd"]
        + QUICK_CPU[1:]
        + [f"cpu train {a} canon={sets[a]} 2L64D 5 steps" for a in archs[1:]]
    )
    assert [s.name for s in full] == want_full
    assert [s.name for s in quick] == want_quick
    for specs in (full, quick):
        # one process per kernel family and dtype, per model architecture, per training run
        for s in specs:
            if s.name.startswith("kernel "):
                dt = "bf16" if " bf16 " in s.name else "fp32"
                fam = next(f for f in ("split", "canon", "attention", "gla", "gdn", "ssd") if f in s.name)
                assert s.group == ("canon" if fam == "attention" else fam) + " " + dt, s
                assert s.device == "cuda" and not s.heavy and s.static is None
            elif s.name.startswith(("train ", "fsdp2 ")):
                assert s.heavy and s.device == "cuda"
            elif s.name.startswith("cpu "):
                assert s.device == "cpu" and s.group.startswith("cpu")
        assert all(s.static == [SKIP, "needs >= 2 GPUs (1 visible)"] for s in specs if s.name.startswith("fsdp2"))
        # the document-masking lines run their own checks: the varlen kernels, and the model on doc_ids
        for s in specs:
            if "doc-mask" in s.name:
                want = (
                    "canonlm.selfcheck.kernels:check_doc_mask_kernel"
                    if s.name.startswith("kernel ")
                    else "canonlm.selfcheck.models:check_model_doc_mask"
                )
                assert s.target == want and s.static is None, s
                if s.name.startswith("cpu "):
                    assert s.group == "cpu" and s.kwargs == {"fast": False, "T": 48} and s.args[1:] == ["cpu", "2L64D"]
                elif s.name.startswith("model "):
                    assert s.group == f"model {s.args[0]}" and s.kwargs == {"device": "cuda", "size": "2L256D"}
                else:
                    assert s.group == s.name.split()[1].split("/")[0] + " " + s.name.split()[2] and s.est_compiles > 0
        train = [s for s in specs if s.name.startswith("train ")]
        assert all(s.args[0]["autotune"] == "first" and "data.batch_size=8" in s.args[0]["overrides"] for s in train)
    no_cuda = plan.build_plan(plan.Options(quick=True), cuda=False, n_gpu=0)
    assert all(s.static == [SKIP, env.NO_CUDA] for s in no_cuda if not s.name.startswith("cpu "))
    two = plan.build_plan(plan.Options(size="4L128D", steps=3, autotune="full"), cuda=True, n_gpu=2)
    m2 = next(s for s in two if s.name.startswith("train mamba2"))
    assert m2.name == "train mamba2 canon=AbCD 4L128D 3 steps (1 GPU, bf16-mixed)" and m2.args[0]["autotune"] == "full"
    assert all(s.static is None for s in two if s.name.startswith("fsdp2"))
    from canonlm.selfcheck.__main__ import main

    assert main(["--list", "--quick"]) == 0
    listed = [ln.split("  [", 1)[0] for ln in capsys.readouterr().out.splitlines()]
    assert listed == [
        s.name for s in plan.build_plan(plan.Options(quick=True), torch.cuda.is_available(), torch.cuda.device_count())
    ]


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--steps", "1"], "--steps 1: allowed: an integer >= 2"),
        (["--budget-s", "0"], "--budget-s 0.0: allowed"),
        (["--jobs", "0"], "--jobs 0: allowed"),
        (["--size", "big"], "--size big: allowed: one of"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(argv, msg, tmp_path, capsys):
    from canonlm.selfcheck.__main__ import main

    out = tmp_path / "r.md"
    assert main([*argv, "--out", str(out)]) == 2
    assert msg in capsys.readouterr().err and not out.exists()


@pytest.mark.slow
def test_a_worker_that_lingers_after_its_last_line_does_not_hold_the_command(tmp_path, monkeypatch, capsys):
    """A worker whose last line passed but whose process does not exit (a non-daemon thread: a stuck CUDA or
    inductor teardown) is not waited for: the command returns within its budget plus the stop, with the line's
    PASS, and stops the worker (no process left)."""
    from canonlm.selfcheck import __main__ as cli

    lines = [LineSpec("e lingers", "e", "test_selfcheck_interp:lingering_line", [], est_s=5)]
    monkeypatch.setattr(cli, "build_plan", lambda opts, cuda, n_gpu: lines)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "r.md"
    t0 = time.perf_counter()
    rc = cli.main(["--out", str(out), "--budget-s", "20", "--jobs", "1"])
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert rc == 0, err
    assert elapsed < 20, elapsed
    assert _rows(out.read_text())["e lingers"]["status"] == PASS
    left = subprocess.run(["pgrep", "-f", "canonlm.selfcheck.runner"], capture_output=True, text=True).stdout.split()
    assert not left, left


def test_budget_stops_lines_with_the_reason_and_the_exit_code_stays_right(tmp_path, monkeypatch, capsys):
    """A planted plan through the real command and real workers: a line's compile / check split comes back from its
    worker; a FAIL is a FAIL; a worker that dies fails the line it ran and the rest of its group runs in a new
    worker; at the 5 s budget the line still running is stopped and the next one not run, both SKIP with the
    reason; the command returns at once with exit code 1 (a FAIL), writes the report, and leaves no process
    behind. The lines are the standard library's (``os.path.split("PASS/x")`` is ``("PASS", "x")``) and
    ``test_selfcheck_interp.planted_line`` (a module that imports no torch), so the workers start in a fraction of
    a second."""
    from canonlm.selfcheck import __main__ as cli

    lines = [
        LineSpec("a planted FAIL", "a", "os.path:split", ["FAIL/planted failure"], est_s=30),
        LineSpec("a hangs", "a", "time:sleep", [600]),
        LineSpec("a never starts", "a", "os.path:split", ["PASS/x"]),
        LineSpec("b crashes", "b", "os:_exit", [3], est_s=20),
        LineSpec("b after the crash", "b", "os.path:split", ["PASS/ran in a new worker"]),
        LineSpec(
            "c timed", "c", "test_selfcheck_interp:planted_line", [], {"compile_s": 0.6, "check_s": 0.3}, est_s=10
        ),
        LineSpec("d static", "d", static=[SKIP, "no CUDA"]),
    ]
    monkeypatch.setattr(cli, "build_plan", lambda opts, cuda, n_gpu: lines)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "r.md"
    t0 = time.perf_counter()
    rc = cli.main(["--out", str(out), "--budget-s", "5", "--jobs", "3"])
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert rc == 1, err
    assert elapsed < 5 + 8, elapsed  # the budget, the stop (SIGTERM, then SIGKILL after 2 s), the report
    rows, printed = _rows(out.read_text()), _printed(err)
    assert set(printed) == set(rows) == {s.name for s in lines}
    assert (rows["a planted FAIL"]["status"], rows["a planted FAIL"]["detail"]) == (FAIL, "planted failure")
    hang = rows["a hangs"]
    assert hang["status"] == SKIP and hang["compile"] is None and hang["check"] is None
    assert re.fullmatch(
        r"stopped after \d+ s: the 5 s budget was spent while it ran; rerun with --budget-s 10 "
        r"\(the kernel cache makes a second run faster\)",
        hang["detail"],
    ), hang
    assert printed["a hangs"][0] == SKIP and "stopped after" in err
    assert (rows["a never starts"]["status"], rows["a never starts"]["detail"]) == (
        SKIP,
        "not run: the 5 s budget was spent; rerun with --budget-s 10 (the kernel cache makes a second run faster)",
    )
    assert rows["b crashes"]["status"] == FAIL
    assert rows["b crashes"]["detail"].startswith("the worker process died (exit 3) while this line ran")
    assert (rows["b after the crash"]["status"], rows["b after the crash"]["detail"]) == (PASS, "ran in a new worker")
    timed = rows["c timed"]
    assert timed["status"] == PASS and 0.6 <= timed["compile"] < 2.0 and 0.3 <= timed["check"] < 2.0, timed
    assert (rows["d static"]["status"], rows["d static"]["compile"]) == (SKIP, None)
    report = out.read_text()
    assert "- time budget: 5 s (--budget-s): 1 lines not run and 1 stopped by it (SKIP)" in report
    assert "(2 PASS, 2 FAIL, 3 SKIP)" in report
    kept = re.search(r"run directory \(training runs, worker logs\) kept in (\S+)", err).group(1)
    assert (Path(kept) / "selfcheck-plan.json").is_file()
    left = [p for p in Path("/proc").glob("[0-9]*") if kept in _cmdline(p)]
    assert not left, "worker processes still running"


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_time_split_of_a_line():
    """Compile time is the time spent inside ``compiling()`` (nested blocks once) plus what ``add_compile_time``
    adds (a subprocess's start-up); check time is the rest of the line's wall time."""

    def line():
        with verdict.compiling():
            time.sleep(0.2)
            with verdict.compiling():
                time.sleep(0.1)
        time.sleep(0.15)
        time.sleep(0.05)  # a subprocess's start-up, measured by the line and added as compile time
        verdict.add_compile_time(0.05, built=3, loaded=2)
        return PASS, "ok"

    r = run_check("timed", line)
    assert 0.35 <= r.compile_s < 0.6 and 0.15 <= r.check_s < 0.4, r
    assert abs(r.compile_s + r.check_s - r.seconds) < 1e-9 and r.kernels == {"built": 3, "loaded": 2}
    r = run_check("fails", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert r.status == FAIL and r.compile_s == 0.0 and r.kernels == {}  # the clock starts afresh for each line


def test_first_config_autotune_on_a_real_triton_autotuner(monkeypatch):
    """A real ``triton.runtime.autotuner.Autotuner`` over a stand-in kernel (no GPU here): inside
    ``first_config_autotune`` the first config that compiles is run once and used, later configs are never tried,
    nothing is benchmarked or written to Triton's disk cache, and the choice is not left in the autotuner's cache;
    a choice made before (a full autotune) is used as it is; outside the context Triton's methods are back."""
    pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner, Config
    from triton.runtime.errors import OutOfResources

    calls = []

    def body(x, n, BLOCK):  # the Python function under the "kernel" (Autotuner reads its name)
        raise AssertionError("not called")

    class Kernel:
        def __init__(self):
            self.fn, self.arg_names = body, ["x", "n", "BLOCK"]

        def run(self, *args, BLOCK, **kw):
            calls.append(BLOCK)
            if BLOCK == 16:
                raise OutOfResources(1, 0, "shared memory")

    configs = [Config({"BLOCK": b}) for b in (16, 32, 64)]
    tuner = Autotuner(Kernel(), ["x", "n", "BLOCK"], configs, ["n"], None, None, cache_results=True)
    monkeypatch.setattr(Autotuner, "check_disk_cache", lambda *a: pytest.fail("Triton's disk cache was used"))
    run, bench = Autotuner.run, Autotuner._bench
    x = torch.zeros(4)
    with triton_hooks.first_config_autotune() as why:
        assert why is None
        tuner.run(x, 128)
        assert calls == [16, 32, 32]  # 16 fails to compile, 32 runs once as the "benchmark", then the real call
        assert tuner.cache == {} and tuner.cache_results is True
        tuner.run(x, 128)
        assert calls == [16, 32, 32, 32]  # remembered: no second tuning
        tuner.cache[(256, "torch.float32")] = configs[2]  # tuned before, e.g. restored from the kernel cache
        tuner.run(x, 256)
        assert calls[-1] == 64 and tuner.cache == {(256, "torch.float32"): configs[2]}
    assert (Autotuner.run, Autotuner._bench) == (run, bench)


def test_kernel_counts_chain_to_the_listener_already_set(monkeypatch):
    """``count_compiles`` hooks Triton's real compilation listener knob (``compile`` calls it once per kernel binary,
    ``cache_hit`` True when it came from the disk cache; no GPU here to compile, so the knob is called as ``compile``
    calls it) and keeps calling a listener that was set before."""
    triton = pytest.importorskip("triton")
    seen = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: seen.append(kw["cache_hit"]))
    monkeypatch.setattr(triton_hooks, "_listening", [False])
    monkeypatch.setattr(triton_hooks, "counts", {"built": 0, "loaded": 0})
    assert triton_hooks.count_compiles() and triton_hooks.count_compiles()  # idempotent
    for hit in (False, False, True):
        triton.knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=hit)
    assert triton_hooks.kernel_counts() == {"built": 2, "loaded": 1} and seen == [False, False, True]


def test_fallback_to_reference_is_fail():
    """A kernel result whose selected backend is the reference, or whose calls went to the reference, fails however
    small its errors; so does a fast backend that was never called."""
    fla = {"gla": {"fla": 1}}
    v = judge_kernel("gla", "fla", "reference", fla, {"o": 0.0, "dq": 1e-9}, 1e-3)
    assert v.status == FAIL and "fallback" in v.detail
    v = judge_kernel("gla", "fla", "fla", {"gla": {"fla": 1, "reference": 1}}, {"o": 0.0}, 1e-3)
    assert v.status == FAIL and "gla ran reference" in v.detail
    v = judge_kernel("gla", "fla", "fla", {}, {"o": 0.0}, 1e-3)
    assert v.status == FAIL and "fla did not run" in v.detail
    assert judge_kernel("gla", "fla", "fla", fla, {"o": 1e-4}, 1e-3).status == PASS
    assert judge_kernel("gla", "fla", "fla", fla, {"o": 1e-4, "dq": 2e-3}, 1e-3).status == FAIL
    assert judge_kernel("gla", "fla", "fla", fla, {"o": math.nan}, 1e-3).status == FAIL
    assert judge_kernel("gla", "fla", "fla", fla, {}, 1e-3).status == FAIL  # nothing compared is no pass


def test_training_fallback_and_short_runs_are_fail():
    spec = training.TrainSpec("train gla", "gla", "AbCD", [], 30, 1, "cuda", 10)
    rows = [{"step": s, "train/loss": 3.0 - s / 100} for s in range(30)]
    rows += [{"step": s, "perf/tokens_per_s": 1e5, "perf/mfu": 0.3, "perf/peak_mem_gb": 9.5} for s in (5, 10, 15)]
    info = {
        "steps": 30,
        "world_size": 1,
        "backends": {"canon": "dao", "gla": "fla"},
        "ran": {"canon": {"dao": 480}, "gla": {"fla": 360}},
        "peak_mem_gib": 10.0,
    }
    want = {"canon": "dao", "gla": "fla"}
    status, detail = training.judge_training(spec, rows, info, want)
    assert status == PASS and "tokens/s 100,000" in detail and "MFU 30.0%" in detail and "10.00 GiB" in detail
    assert "ran canon=dao:480 gla=fla:360" in detail
    fell_back = {**info, "ran": {"canon": {"dao": 480}, "gla": {"fla": 300, "reference": 60}}}
    status, detail = training.judge_training(spec, rows, fell_back, want)
    assert status == FAIL and "gla ran reference" in detail
    assert training.judge_training(spec, rows, {**info, "ran": {"gla": {"fla": 360}}}, want)[0] == FAIL  # no Canon call
    assert training.judge_training(spec, rows, {k: v for k, v in info.items() if k != "ran"}, want)[0] == FAIL
    assert training.judge_training(spec, rows, {**info, "steps": 12}, want)[0] == FAIL
    assert training.judge_training(spec, rows + [{"train/loss": math.inf}], info, want)[0] == FAIL
    # llama without Canon: Canon is never called, which is right
    llama = training.TrainSpec("train llama", "llama", "none", [], 30, 1, "cuda", 10)
    info_l = {**info, "ran": {"attention": {"sdpa": 360}}}
    assert training.judge_training(llama, rows, info_l, {"canon": "dao", "attention": "sdpa"})[0] == PASS
    # Mamba2: the fused split kernel must run where it can
    m2 = training.TrainSpec("train mamba2", "mamba2", "AbCD", [], 30, 1, "cuda", 10)
    want_m = {"canon": "dao", "ssd": "mamba_ssm"}
    unfused = {**info, "ran": {"canon": {"dao": 480}, "ssd": {"mamba_ssm": 360}}}
    fused = {**info, "ran": {"canon": {"dao": 480}, "ssd": {"split": 360}}}
    status, detail = training.judge_training(m2, rows, {**unfused, "fused_split_reason": None}, want_m)
    assert status == FAIL and "ssd ran mamba_ssm" in detail
    assert training.judge_training(m2, rows, {**fused, "fused_split_reason": None}, want_m)[0] == PASS
    assert (
        training.judge_training(m2, rows, {**unfused, "fused_split_reason": "causal-conv1d too old"}, want_m)[0] == PASS
    )


def test_run_check_turns_exceptions_into_lines():
    def boom():
        raise RuntimeError("kernel crashed")

    def skip():
        raise Skip("needs 2 GPUs")

    assert run_check("a", boom).status == FAIL and "kernel crashed" in run_check("a", boom).detail
    assert (run_check("b", skip).status, run_check("b", skip).detail) == (SKIP, "needs 2 GPUs")
    assert run_check("c", lambda: ("MAYBE", "")).status == FAIL


def test_missing_library_skips_and_broken_install_fails(monkeypatch):
    """Not installed: SKIP. Installed without its CUDA op (the probe's ``ModuleNotFoundError`` names the package's
    own extension): SKIP with the module and how to get it. Anything else: FAIL. (tests/test_selfcheck_classify.py
    builds such installs for real and runs the probes in a subprocess.)"""
    monkeypatch.setattr(env, "dist_version", lambda names: None)
    assert env.fast_unavailable("attention", "flash", "cuda", torch.bfloat16) == (SKIP, "flash-attn not installed")
    assert env.fast_unavailable("ssd", "split", "cuda", torch.bfloat16) == (
        SKIP,
        "mamba-ssm, causal-conv1d not installed",
    )
    monkeypatch.setattr(env, "dist_version", lambda names: "9.9")  # "installed", but the probe fails
    monkeypatch.setattr(env.importlib.util, "find_spec", lambda name: None)  # and no such extension module here

    def probes(error):
        monkeypatch.setitem(env.FAST_PROBES, ("gla", "fla"), ((("fla-core",), lambda: error),))
        return env.fast_unavailable("gla", "fla", "cuda", torch.bfloat16)

    assert probes("ModuleNotFoundError: No module named 'einops'") == (
        FAIL,
        "fla-core is installed but does not load: ModuleNotFoundError: No module named 'einops'",
    )
    status, reason = probes("ImportError: /x/causal_conv1d_cuda.so: undefined symbol: _ZN3c105ErrorC2E")
    assert status == FAIL and reason.startswith("fla-core is installed but does not load: ImportError: ")
    assert probes(ModuleNotFoundError("No module named 'selective_scan_cuda'", name="selective_scan_cuda")) == (
        SKIP,
        "mamba-ssm installed without its CUDA op (selective_scan_cuda): install its CUDA build for this torch "
        "(`bash scripts/setup.sh cuda` where GitHub is reachable, or with nvcc `MAMBA_FORCE_BUILD=TRUE pip "
        "install --no-build-isolation --no-cache-dir --no-deps mamba-ssm==9.9`; docs/gpu.md)",
    )
    # the split line needs causal-conv1d's op: SKIP naming it, though the SSD kernels load
    monkeypatch.setitem(
        env.FAST_PROBES,
        ("ssd", "split"),
        (
            (("mamba-ssm",), lambda: None),
            (("causal-conv1d",), lambda: "ModuleNotFoundError: No module named 'causal_conv1d_cuda'"),
        ),
    )
    status, reason = env.fast_unavailable("ssd", "split", "cuda", torch.bfloat16)
    assert status == SKIP and reason.startswith("causal-conv1d installed without its CUDA op (causal_conv1d_cuda): ")


@pytest.mark.parametrize(
    "error, want",
    [
        ("ModuleNotFoundError: No module named 'causal_conv1d_cuda'", ("causal-conv1d", "causal_conv1d_cuda")),
        ("ModuleNotFoundError: No module named 'flash_attn_2_cuda'", ("flash-attn", "flash_attn_2_cuda")),
        (
            ModuleNotFoundError("No module named 'selective_scan_cuda'", name="selective_scan_cuda"),
            ("mamba-ssm", "selective_scan_cuda"),
        ),
        ("ModuleNotFoundError: No module named 'triton'", None),  # a missing dependency: broken
        ("ImportError: No module named 'causal_conv1d_cuda'", None),  # not the plain absence of the module
        (ImportError("causal_conv1d_cuda.so: undefined symbol: _ZN3c10"), None),
        (
            "ImportError: mamba_ssm.ops.triton.ssd_combined does not import even without the mamba_ssm package __init__ "
            "(NameError: x); the package __init__ failed with ModuleNotFoundError: No module named 'selective_scan_cuda'",
            None,
        ),  # the Triton module itself is broken
    ],
)
def test_missing_cuda_op_is_only_the_plain_absence_of_the_packages_own_extension(monkeypatch, error, want):
    monkeypatch.setattr(env, "dist_version", lambda names: "1.0")
    monkeypatch.setattr(env.importlib.util, "find_spec", lambda name: None)
    assert env.missing_cuda_op(error) == want
    if want is not None:  # a module of that name on the path (it exists, so it was not missing): not this case
        monkeypatch.setattr(env.importlib.util, "find_spec", lambda name: object())
        assert env.missing_cuda_op(error) is None
        monkeypatch.setattr(env.importlib.util, "find_spec", lambda name: None)
        monkeypatch.setattr(env, "dist_version", lambda names: None)  # its distribution not installed
        assert env.missing_cuda_op(error) is None


def test_write_report_never_overwrites_without_force(tmp_path):
    path = tmp_path / "r.md"
    write_report(path, "one", force=False)
    with pytest.raises(FileExistsError):
        write_report(path, "two", force=False)
    assert path.read_text() == "one" and sorted(os.listdir(tmp_path)) == ["r.md"]
    write_report(path, "three", force=True)
    assert path.read_text() == "three"


# ----------------------------------------------------------------------------------------------------------------
# the fp32 tolerance rule
# ----------------------------------------------------------------------------------------------------------------


def test_fp32_tolerance_follows_triton_f32_default(monkeypatch):
    """Tight (2e-4) only when Triton's tl.dot runs fp32 in IEEE (TRITON_F32_DEFAULT=ieee); the TF32 allowance (5e-3)
    when the variable is unset (Triton's default) or names a reduced-precision mode; the GPU tests' helper is the
    same rule."""
    import _kernel_calls

    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert numerics.triton_fp32_precision() == "tf32"
    assert numerics.fp32_tol() == _kernel_calls.fp32_tol() == 5e-3
    assert numerics.kernel_tol("gla", "fla", "fp32") == numerics.kernel_tol("ssd", "split", "fp32") == 5e-3
    assert "unset" in numerics.precision_note() and "5e-03" in numerics.precision_note()
    for value in ("ieee", " IEEE "):
        monkeypatch.setenv("TRITON_F32_DEFAULT", value)
        assert numerics.triton_fp32_precision() == "ieee"
        assert numerics.fp32_tol() == _kernel_calls.fp32_tol() == 2e-4
        assert _kernel_calls.fp32_tol(1e-3, 1e-2) == 1e-3
        assert numerics.kernel_tol("gdn", "fla", "fp32") == 2e-4
        assert numerics.precision_note().startswith("ieee (TRITON_F32_DEFAULT=")
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
    assert numerics.triton_fp32_precision() == "tf32x3" and numerics.fp32_tol() == 5e-3
    assert _kernel_calls.fp32_tol(1, 2) == 2
    # no tl.dot, no TF32: the CUDA C Canon kernel and SDPA stay tight whatever the variable; bf16 has its own
    assert numerics.kernel_tol("canon", "dao", "fp32") == numerics.kernel_tol("attention", "sdpa", "fp32") == 2e-4
    assert numerics.kernel_tol("gla", "fla", "bf16") == 6e-2


# ----------------------------------------------------------------------------------------------------------------
# the GPU harness on the CPU: the fast backends resolve here, their entry points are CPU stand-ins
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """Run the GPU checks on the CPU: every fast backend resolves on the CPU (``cuda_reason`` answers None, the
    library probes succeed; flash-attn stays "not installed"), and each fast entry point -- the function the op calls
    for that backend -- is replaced by a stand-in computing the reference (captured before the self-check's counter
    wraps anything). The ops' own dispatch, the model and the self-check run unchanged."""
    import canonlm.ops.canon as canon
    import canonlm.ops.gdn as gdn
    import canonlm.ops.gla as gla
    import canonlm.ops.ssd as ssd
    from canonlm.ops.canon import _cuda
    from canonlm.ops.gdn import _fla as gdn_fla
    from canonlm.ops.gla import _fla as gla_fla
    from canonlm.ops.ssd import _mamba

    for mod in (canon, gla, gdn, ssd):
        monkeypatch.setattr(mod, "cuda_reason", lambda device: None)
    found = (("stand-in", "stand-in"), None)
    for mod, fn in (
        (_cuda, "dao_functions"),
        (_cuda, "fla_functions"),
        (gla_fla, "fla_functions"),
        (gdn_fla, "functions"),
    ):
        monkeypatch.setattr(mod, fn, lambda: found)
    monkeypatch.setattr(gdn_fla, "dtype_reason", lambda dtype: None)
    monkeypatch.setattr(_mamba, "chunk_scan_function", lambda: ("stand-in", None))
    monkeypatch.setattr(_mamba, "split_info", lambda: (SimpleNamespace(fn="stand-in", stride_fix=True), None))
    resolve = canon.resolve_backend

    def cuda_auto(name, device, dtype, *shape):  # canon's auto on a CPU device prefers the native kernel
        if name == "auto":  # as on CUDA: dao, else fla, for this Canon shape
            for cand in ("dao", "fla"):
                with contextlib.suppress(ConfigError):
                    return resolve(cand, device, dtype, *shape)
        return resolve(name, device, dtype, *shape)

    monkeypatch.setattr(canon, "resolve_backend", cuda_auto)
    monkeypatch.setattr(
        env,
        "fast_unavailable",
        lambda op, fast, dev, dt: (SKIP, "flash-attn not installed") if fast == "flash" else None,
    )

    conv, step = canon.causal_conv1d_torch, canon.causal_conv1d_step
    gla_ref, gdn_ref = gla.chunk_gla_reference, gdn.chunk_gated_delta_rule_reference
    ssd_ref, split_ref = ssd.ssd_scan_reference, ssd.split_conv1d_scan_reference

    def conv_fwd(x, w, b, residual, act, h):
        return conv(x, w, b, residual=residual, activation=act, initial_state=h)

    # the document-masked calls: each document run alone through the reference (no state across a boundary)
    def per_span(fn, flat, cu_cpu):  # fn(*docs) -> (1, L, ...) for tensors (1, total, ...)
        ends = cu_cpu.tolist()
        return torch.cat([fn(*[t[:, a:e] for t in flat]) for a, e in zip(ends[:-1], ends[1:])], 1)

    def per_row_segment(fn, seqs, seq_idx):  # fn(*docs) -> (1, L, ...) for tensors (B, T, ...), runs of seq_idx
        rows = []
        for b in range(seq_idx.shape[0]):
            _, counts = torch.unique_consecutive(seq_idx[b], return_counts=True)
            ends = [0] + torch.cumsum(counts, 0).tolist()
            rows.append(torch.cat([fn(*[t[b : b + 1, a:e] for t in seqs]) for a, e in zip(ends[:-1], ends[1:])], 1))
        return torch.cat(rows, 0)

    def dao_fwd(x, w, b, residual, act, h, seq_idx=None):
        if seq_idx is None:
            return conv_fwd(x, w, b, residual, act, h)
        return per_row_segment(lambda xd: conv_fwd(xd, w, b, residual, act, None), [x], seq_idx)

    def fla_fwd(x, w, b, residual, act, h, cu_seqlens=None, cu_seqlens_cpu=None):
        if cu_seqlens is None:
            return conv_fwd(x, w, b, residual, act, h)
        B, T, C = x.shape
        return per_span(
            lambda xd: conv_fwd(xd, w, b, residual, act, None), [x.reshape(1, B * T, C)], cu_seqlens_cpu
        ).view(B, T, C)

    def conv_step(x_t, state, w, b, residual, act):
        return step(x_t, state, w, b, residual=residual, activation=act, backend="torch")

    def scan(x, dt, A, B, C, Q, D, db, sp, lim, h, final, seq_idx=None):
        if seq_idx is not None:
            y = per_row_segment(
                lambda *xs: ssd_ref(*xs[:2], A, *xs[2:], chunk_size=Q, D=D, dt_bias=db, dt_softplus=sp, dt_limit=lim)[
                    0
                ],
                [x, dt, B, C],
                seq_idx,
            )
            return y, None
        return ssd_ref(
            x,
            dt,
            A,
            B,
            C,
            chunk_size=Q,
            D=D,
            dt_bias=db,
            dt_softplus=sp,
            dt_limit=lim,
            initial_state=h,
            output_final_state=final,
        )

    stand_ins = {
        (_cuda, "dao_forward"): dao_fwd,
        (_cuda, "fla_forward"): fla_fwd,
        (_cuda, "dao_step"): conv_step,
        (_cuda, "fla_step"): conv_step,
        (gla_fla, "fla_forward"): lambda q, k, v, g, s, h, final: gla_ref(
            q, k, v, g, scale=s, initial_state=h, output_final_state=final
        ),
        (gla_fla, "fla_forward_varlen"): lambda q, k, v, g, s, cu, cu_cpu: per_span(
            lambda *xs: gla_ref(*xs, scale=s)[0], [q, k, v, g], cu_cpu
        ),
        (gdn_fla, "forward"): lambda q, k, v, g, b, s, h, final, l2: gdn_ref(
            q, k, v, g, b, scale=s, initial_state=h, output_final_state=final, use_qk_l2norm=l2
        ),
        (gdn_fla, "forward_varlen"): lambda q, k, v, g, b, s, l2, cu, cu_cpu: per_span(
            lambda *xs: gdn_ref(*xs, scale=s, use_qk_l2norm=l2)[0], [q, k, v, g, b], cu_cpu
        ),
        (_mamba, "chunk_scan"): scan,
        (_mamba, "state_update"): lambda x, dt, A, B, C, *rest: scan(x, dt, A, B, C, 64, *rest),
        (_mamba, "split_conv1d_scan"): split_ref,
    }
    for (mod, name), fn in stand_ins.items():
        monkeypatch.setattr(mod, name, fn)
    forget_backend_choices()
    yield
    forget_backend_choices()


def test_gpu_kernel_harness_dry_run_on_cpu(fake_gpu):
    """Every kernel line (bf16) and the model lines pass on the CPU with the fast entry points called -- and each line
    saw exactly its fast backends run; flash-attn, "not installed", is SKIP with the reason."""
    results = kernels.run_kernel_checks("cpu", ("bf16",))
    assert len(results) == 19
    for r in results:
        if r.backend == "flash":
            assert (r.status, r.detail) == (SKIP, "flash-attn not installed"), r
            continue
        assert r.status == PASS, (r.name, r.detail)
        assert set(r.ran) == {r.op} and set(r.ran[r.op]) == {r.backend} and r.ran[r.op][r.backend] >= 1, r
        assert r.errors and max(r.errors.values()) <= r.tol == 6e-2
        assert r.compile_s is not None and r.check_s is not None
    # the compile-friendly Canon path, compiled by inductor (for the CPU here): traced once per Canon use, one graph,
    # and its compile (dynamo + inductor, several seconds) is the line's compile time, not its check time
    compiled = next(r for r in results if r.backend == "torch")
    assert compiled.name == "kernel canon/torch compiled bf16 fwd+bwd" and compiled.ran == {"canon": {"torch": 2}}
    assert "inductor: 1 graph" in compiled.detail and set(compiled.errors) == {
        "canon.y",
        "shortconv.y",
        "dx",
        "dw",
        "db",
        "dinit",
    }
    assert compiled.compile_s > 0.5 and compiled.compile_s > compiled.check_s, compiled
    assert [r.op for r in kernels.run_kernel_checks("cpu", ("bf16",), ops=["gdn"])] == ["gdn", "gdn", "gdn"]
    for arch in models.PRESETS:
        v = models.check_model_decode(arch, "cpu", "2L64D")
        assert v.status == PASS, (arch, v.detail)
        assert set(v.ran["cached"]) == {"canon", models.MIXER_OP[arch]}
    v = models.check_model_fast_vs_reference("gla", "cpu", "2L64D")  # 2 layers x (Canon-A/C/D, short convs q/k/v)
    assert v.status == PASS and v.ran == {"fwd+bwd": {"canon": {"dao": 12}, "gla": {"fla": 2}}}, v.detail


def test_doc_mask_lines_pass_on_the_fast_paths_and_fail_on_a_leak(fake_gpu, monkeypatch):
    """The document-masking lines on the CPU with the fast entry points as stand-ins: the kernel lines call the varlen
    entry points (GLA / GDN ``cu_seqlens``, SSD ``seq_idx``) and match each document alone; the model lines run
    Canon on its fast kernel and the mixer on its fast op with ``doc_ids`` (Mamba2 without its fused split). A
    kernel that lets the state cross the document boundaries FAILs on its errors, and a model whose Canon layers fall
    back to the shift-and-add path FAILs on the calls."""
    from canonlm.ops.gla import _fla as gla_fla
    from canonlm.ops.ssd import _mamba

    lines = {r.name: r for r in kernels.run_kernel_checks("cpu", ("fp32",)) if "doc-mask" in r.name}
    assert sorted(lines) == [
        "kernel gdn/fla fp32 doc-mask (cu_seqlens) fwd+bwd",
        "kernel gla/fla fp32 doc-mask (cu_seqlens) fwd+bwd",
        "kernel ssd/mamba_ssm fp32 doc-mask (seq_idx) fwd+bwd",
    ]
    for r in lines.values():
        assert r.status == PASS, (r.name, r.detail)
        assert r.ran == {r.op: {r.backend: 1}} and max(r.errors.values()) < 1e-5, r
        assert "7 documents in 2 rows of 300 tokens" in r.detail
    assert set(lines["kernel gdn/fla fp32 doc-mask (cu_seqlens) fwd+bwd"].errors) == {
        "o",
        "dq",
        "dk",
        "dv",
        "dg",
        "dbeta",
    }
    for arch, mixer in (
        ("llama", {"attention": {"sdpa": 2}}),
        ("gla", {"gla": {"fla": 2}}),
        ("gdn", {"gdn": {"fla": 2}}),
        ("mamba2", {"ssd": {"mamba_ssm": 2}}),
    ):
        v = models.check_model_doc_mask(arch, "cpu", "2L64D", T=48)
        assert v.status == PASS, (arch, v.detail)
        ran = v.ran["packed fwd+bwd"]
        assert set(ran["canon"]) == {"dao"} and {k: x for k, x in ran.items() if k != "canon"} == mixer, (arch, ran)
        assert v.errors["logits"] < 1e-5 and v.errors["grads(L2)"] < 1e-5, v.errors

    # a varlen kernel that ignores the document boundaries: the state leaks from one document into the next
    whole = gla_fla.fla_forward
    monkeypatch.setattr(
        gla_fla, "fla_forward_varlen", lambda q, k, v, g, s, cu, cu_cpu: whole(q, k, v, g, s, None, False)[0]
    )
    r = run_check(
        "kernel gla/fla fp32 doc-mask (cu_seqlens) fwd+bwd", lambda: kernels.check_doc_mask_kernel("gla", "fp32", "cpu")
    )
    assert r.status == FAIL and r.errors["o"] > 1e-2 and "> tol 5e-03" in r.detail, r.detail
    chunk = _mamba.chunk_scan
    monkeypatch.setattr(_mamba, "chunk_scan", lambda *a, seq_idx=None, **k: chunk(*a, **k))
    r = run_check("kernel ssd doc-mask", lambda: kernels.check_doc_mask_kernel("ssd", "fp32", "cpu"))
    assert r.status == FAIL and r.errors["y"] > 1e-2, r.detail
    # Canon's document masking on the shift-and-add path instead of the kernel auto resolved: a fallback
    import canonlm.ops.canon as canon

    select = canon._select
    monkeypatch.setattr(canon, "_select", lambda backend, *a: "torch" if backend == "auto" else select(backend, *a))
    v = models.check_model_doc_mask("gla", "cpu", "2L64D", T=48)
    assert v.status == FAIL and "canon ran torch (want dao/fla: fallback)" in v.detail, v.detail
    with pytest.raises(ValueError, match="allowed: gla, gdn, ssd"):
        kernels.check_doc_mask_kernel("canon", "fp32", "cpu")


def test_compiled_canon_line_fails_on_a_graph_break(monkeypatch):
    """``fullgraph``: a graph break in the torch Canon path is an error, so the line FAILs instead of passing on an
    eager fallback (dynamo raises while tracing, before inductor compiles anything)."""
    import canonlm.ops.canon as canon

    path = canon.causal_conv1d_torch

    def with_break(*a, **k):
        torch._dynamo.graph_break()
        return path(*a, **k)

    monkeypatch.setattr(canon, "causal_conv1d_torch", with_break)
    r = run_check("kernel canon/torch compiled fp32 fwd+bwd", lambda: kernels.check_canon_compiled("fp32", "cpu"))
    assert r.status == FAIL and "graph" in r.detail.lower(), r.detail


def test_kernel_line_counts_the_calls_of_the_fast_entry_point(fake_gpu, monkeypatch):
    """The counted calls are the calls the op made: the same number as the test helper's own counter of the wrapper
    (tests/_kernel_calls.py), and the number of segments the decode line feeds (1 prefill + 10 steps + 1 chunk for
    GLA; 1 prefill + 10 steps for SSD; 2 convs x 40 steps for Canon)."""
    from _kernel_calls import count_calls

    from canonlm.ops.gla import _fla as gla_fla

    helper = count_calls(monkeypatch, gla_fla, "fla_forward")
    v = kernels.check_gla_kernel("fp32", "decode", "cpu")
    assert v.status == PASS, v.detail
    assert v.ran == {"gla": {"fla": 12}} and len(helper) == 12
    assert kernels.check_gla_kernel("fp32", "fwd+bwd", "cpu").ran == {"gla": {"fla": 1}}
    assert kernels.check_ssd_kernel("fp32", "decode", "cpu").ran == {"ssd": {"mamba_ssm": 11}}
    assert kernels.check_canon_kernel("dao", "fp32", "decode", "cpu").ran == {"canon": {"dao": 80}}
    assert kernels.check_canon_kernel("fla", "fp32", "fwd+bwd", "cpu").ran == {"canon": {"fla": 2}}
    assert kernels.check_ssd_split_kernel("fp32", "cpu").ran == {"ssd": {"split": 1}}  # its internals are not counted


def test_kernel_line_fails_when_the_fast_entry_point_is_not_called(fake_gpu, monkeypatch):
    """The fast backend resolves (``auto`` picks fla), the errors are tiny, yet the op never calls fla's entry point:
    FAIL, whether it ran its reference or something uncounted."""
    import canonlm.ops.gla as gla

    orig, ref = gla.chunk_gla, gla.chunk_gla_reference

    def via_reference(*a, backend="auto", **k):  # the dispatch answers "fla" but runs the reference
        return orig(*a, backend="reference" if backend == "fla" else backend, **k)

    monkeypatch.setattr(gla, "chunk_gla", via_reference)
    r = run_check("kernel gla/fla fp32 fwd+bwd", lambda: kernels.check_gla_kernel("fp32", "fwd+bwd", "cpu"))
    assert r.status == FAIL and "gla ran reference (want fla: fallback)" in r.detail, r.detail
    assert max(r.errors.values()) < 1e-5  # the numbers alone would have passed

    def uncounted(q, k, v, g, *, backend="auto", chunk_size=64, **kw):  # nothing the counter knows of runs
        return ref(q, k, v, g, **kw)

    monkeypatch.setattr(gla, "chunk_gla", uncounted)
    r = run_check("kernel gla/fla fp32 decode", lambda: kernels.check_gla_kernel("fp32", "decode", "cpu"))
    assert r.status == FAIL and "gla: fla did not run" in r.detail, r.detail


def test_kernel_line_reports_a_fallback_selection(fake_gpu, monkeypatch):
    monkeypatch.setattr(env, "resolve", lambda op, name, dev, dt: "reference" if name == "auto" else name)
    r = run_check("kernel gla/fla bf16 fwd+bwd", lambda: kernels.check_gla_kernel("bf16", "fwd+bwd", "cpu"))
    assert r.status == FAIL and "'reference' was selected" in r.detail


def test_renamed_entry_point_is_an_error_not_a_pass(fake_gpu, monkeypatch):
    """An entry point that no longer exists (a renamed wrapper) makes the counter raise, naming it; the entry points
    it had already wrapped are restored; the kernel line FAILs."""
    from canonlm.ops.canon import _cuda
    from canonlm.ops.gla import _fla as gla_fla

    dao = _cuda.dao_forward
    monkeypatch.delattr(gla_fla, "fla_forward")
    with pytest.raises(RuntimeError, match=r"canonlm\.ops\.gla\._fla\.fla_forward .*does not exist"):
        with backend_calls(["canon", "gla"]):
            pass
    assert _cuda.dao_forward is dao
    r = run_check("kernel gla/fla fp32 fwd+bwd", lambda: kernels.check_gla_kernel("fp32", "fwd+bwd", "cpu"))
    assert r.status == FAIL and "fla_forward" in r.detail and "does not exist" in r.detail


def test_fp32_kernel_line_tolerance_follows_the_precision(fake_gpu, monkeypatch):
    """A GLA kernel off by 1e-3 (relative, injected) passes under TF32 (tolerance 5e-3) and fails under
    TRITON_F32_DEFAULT=ieee (2e-4); the line names the precision."""
    from canonlm.ops.gla import _fla as gla_fla

    exact = gla_fla.fla_forward

    def off_by_1e3(*a):
        return tuple(None if t is None else t * (1 + 1e-3) for t in exact(*a))

    monkeypatch.setattr(gla_fla, "fla_forward", off_by_1e3)
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    v = kernels.check_gla_kernel("fp32", "fwd+bwd", "cpu")
    assert 0.9e-3 < max(v.errors.values()) < 1.1e-3
    assert v.status == PASS and v.tol == 5e-3 and "fp32 tl.dot: tf32" in v.detail, v.detail
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    v = kernels.check_gla_kernel("fp32", "fwd+bwd", "cpu")
    assert v.status == FAIL and v.tol == 2e-4 and "fp32 tl.dot: ieee" in v.detail, v.detail


def test_mamba2_must_take_the_fused_path_where_it_can(fake_gpu, monkeypatch):
    """Mamba2's full forward must run mamba_split_conv1d_scan_combined when fused_split_reason allows it: once per
    layer (2L); not taking it is a FAIL. Where the fused path cannot run, the separate scan is right."""
    from canonlm.ops import ssd
    from canonlm.ops.ssd import _mamba

    v = models.check_model_decode("mamba2", "cpu", "2L64D")
    assert v.status == PASS, v.detail
    assert v.ran["full"]["ssd"] == {"split": 2} and set(v.ran["cached"]["ssd"]) == {"mamba_ssm"}
    assert set(v.ran["full"]["canon"]) == {"dao"}  # Canon-A/C/D; the mixer's conv is inside the fused kernel

    monkeypatch.setattr(ssd, "use_fused_split", lambda *a, **k: False)
    v = models.check_model_decode("mamba2", "cpu", "2L64D")
    assert v.status == FAIL and "full: ssd ran mamba_ssm (want split" in v.detail, v.detail
    r = run_check("model mamba2 fast vs ref", lambda: models.check_model_fast_vs_reference("mamba2", "cpu", "2L64D"))
    assert r.status == FAIL and "ssd ran mamba_ssm (want split" in r.detail, r.detail

    monkeypatch.setattr(_mamba, "split_info", lambda: (None, "causal-conv1d too old"))
    forget_backend_choices()
    v = models.check_model_decode("mamba2", "cpu", "2L64D")
    assert v.status == PASS and v.ran["full"]["ssd"] == {"mamba_ssm": 2}, v.detail


def test_model_line_fails_on_a_canon_fallback(fake_gpu, monkeypatch):
    """A model whose Canon layers run plain torch instead of the kernel ``auto`` resolved fails its line."""
    import canonlm.ops.canon as canon

    select = canon._select
    monkeypatch.setattr(canon, "_select", lambda backend, *a: "torch" if backend == "auto" else select(backend, *a))
    v = models.check_model_decode("gla", "cpu", "2L64D")
    assert v.status == FAIL and "canon ran torch (want dao/fla: fallback)" in v.detail, v.detail


def test_train_probe_records_the_calls(tmp_path):
    """The training runs' callback counts the ops' calls from the start of training and writes them at its end."""
    import canonlm.ops.canon as canon

    out = tmp_path / "probe.json"
    probe = training.train_probe(str(out))
    original = canon.causal_conv1d_torch
    probe.on_train_start(None, None)
    x, w = torch.randn(1, 5, 8), torch.randn(8, 4)
    canon.causal_conv1d(x, w, backend="torch")
    canon.causal_conv1d_step(x[:, 0], torch.zeros(1, 8, 4), w, backend="torch")
    model = SimpleNamespace(
        cfg=SimpleNamespace(arch="llama"),
        placement=(torch.device("cpu"), torch.float32),
        backends={"canon": "torch", "attention": "sdpa"},
    )
    trainer = SimpleNamespace(is_global_zero=True, global_step=3, world_size=1, precision="32-true")
    probe.on_train_end(trainer, SimpleNamespace(model=model, device=torch.device("cpu")))
    assert canon.causal_conv1d_torch is original
    info = json.loads(out.read_text())
    assert info["ran"] == {"canon": {"torch": 2}} and info["steps"] == 3 and "fused_split_reason" not in info
