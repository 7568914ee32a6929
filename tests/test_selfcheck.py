"""``python -m canonlm.selfcheck``: the CPU run end to end (report, SKIP lines, refusal to overwrite), the verdict
rules (a fallback to the reference is never a PASS), the fp32 tolerance rule (``TRITON_F32_DEFAULT``), the counting of
the kernels that really ran, and the GPU harness dry-run on the CPU with the fast backends resolving there and every
fast entry point replaced by a CPU stand-in computing the reference."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch


from canonlm.errors import ConfigError
from canonlm.ops import backend_calls, forget_backend_choices
from canonlm.selfcheck import environment as env
from canonlm.selfcheck import kernels, models, numerics, training
from canonlm.selfcheck.report import write_report
from canonlm.selfcheck.verdict import FAIL, PASS, SKIP, Skip, judge_kernel, run_check

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")


def _selfcheck(args, cwd, timeout=400):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "canonlm.selfcheck", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def _rows(report: str) -> dict[str, tuple[str, str]]:
    """{check name: (status, detail)} from the report's checks table."""
    out = {}
    for line in report.split("## Checks", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 4 and cells[0] in (PASS, FAIL, SKIP):
            out[cells[1]] = (cells[0], cells[2])
    return out


@CPU_ONLY
@pytest.mark.slow
def test_cpu_run_writes_the_report_and_never_passes_gpu_lines(tmp_path):
    out = tmp_path / "r.md"
    p = _selfcheck(["--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert env.NO_CUDA_MESSAGE in p.stdout
    report = out.read_text()
    assert report.strip() in p.stdout  # printed as well
    versions = report.split("## Versions", 1)[1].split("## Checks", 1)[0]
    for name in ("torch", "lightning", "triton", "fla-core", "flash-attn", "causal-conv1d", "mamba-ssm"):
        assert f"| {name} |" in versions, name
    assert "| CUDA (torch build) |" in versions
    rows = _rows(report)
    gpu = {n: r for n, r in rows.items() if not n.startswith("cpu ")}
    cpu = {n: r for n, r in rows.items() if n.startswith("cpu ")}
    assert any(n.startswith("kernel gla/fla") for n in gpu) and any(n.startswith("fsdp2") for n in gpu)
    assert any(n.startswith("train ") for n in gpu) and any(n.startswith("model ") for n in gpu)
    assert all(r == (SKIP, env.NO_CUDA) for r in gpu.values()), gpu
    assert len(cpu) >= 10 and all(r[0] == PASS for r in cpu.values()), cpu
    for arch in ("llama", "gla", "gdn", "mamba2"):
        assert "tokens/s" in next(r[1] for n, r in cpu.items() if n.startswith(f"cpu train {arch} "))
    # what ran is counted, in the training subprocess too (the CPU runs: SDPA, the native Canon kernel)
    assert "attention=sdpa:" in next(r[1] for n, r in cpu.items() if n.startswith("cpu train llama "))
    assert "ran canon=cpu:" in cpu["cpu canon/cpu native kernel fp32 fwd+bwd"][1]
    assert f"- fp32 precision of Triton tl.dot: {numerics.triton_fp32_precision()} (" in report
    # an existing report is not overwritten
    before = out.read_text()
    p2 = _selfcheck(["--out", str(out)], tmp_path, timeout=60)
    assert p2.returncode == 2 and "exists" in p2.stderr and "--force" in p2.stderr
    assert out.read_text() == before


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
    info = {"steps": 30, "world_size": 1, "backends": {"canon": "dao", "gla": "fla"},
            "ran": {"canon": {"dao": 480}, "gla": {"fla": 360}}, "peak_mem_gib": 10.0}
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
    assert training.judge_training(m2, rows, {**unfused, "fused_split_reason": "causal-conv1d too old"}, want_m)[0] \
        == PASS


def test_run_check_turns_exceptions_into_lines():
    def boom():
        raise RuntimeError("kernel crashed")

    def skip():
        raise Skip("needs 2 GPUs")

    assert run_check("a", boom).status == FAIL and "kernel crashed" in run_check("a", boom).detail
    assert (run_check("b", skip).status, run_check("b", skip).detail) == (SKIP, "needs 2 GPUs")
    assert run_check("c", lambda: ("MAYBE", "")).status == FAIL


def test_missing_library_skips_and_broken_install_fails(monkeypatch):
    monkeypatch.setattr(env, "dist_version", lambda names: None)
    status, reason = env.fast_unavailable("attention", "flash", "cuda", torch.bfloat16)
    assert status == SKIP and "flash-attn not installed" in reason
    monkeypatch.setattr(env, "dist_version", lambda names: "9.9")  # "installed", but the module does not import
    monkeypatch.setitem(env.FAST_LIBS, ("gla", "fla"), ((("fla-core",),), ("canonlm_no_such_module.ops",)))
    status, reason = env.fast_unavailable("gla", "fla", "cuda", torch.bfloat16)
    assert status == FAIL and "installed but" in reason


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
    for mod, fn in ((_cuda, "dao_functions"), (_cuda, "fla_functions"), (gla_fla, "fla_functions"),
                    (gdn_fla, "functions")):
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
    monkeypatch.setattr(env, "fast_unavailable",
                        lambda op, fast, dev, dt: (SKIP, "flash-attn not installed") if fast == "flash" else None)

    conv, step = canon.causal_conv1d_torch, canon.causal_conv1d_step
    gla_ref, gdn_ref = gla.chunk_gla_reference, gdn.chunk_gated_delta_rule_reference
    ssd_ref, split_ref = ssd.ssd_scan_reference, ssd.split_conv1d_scan_reference

    def conv_fwd(x, w, b, residual, act, h):
        return conv(x, w, b, residual=residual, activation=act, initial_state=h)

    def conv_step(x_t, state, w, b, residual, act):
        return step(x_t, state, w, b, residual=residual, activation=act, backend="torch")

    def scan(x, dt, A, B, C, Q, D, db, sp, lim, h, final):
        return ssd_ref(x, dt, A, B, C, chunk_size=Q, D=D, dt_bias=db, dt_softplus=sp, dt_limit=lim, initial_state=h,
                       output_final_state=final)

    stand_ins = {
        (_cuda, "dao_forward"): conv_fwd, (_cuda, "fla_forward"): conv_fwd,
        (_cuda, "dao_step"): conv_step, (_cuda, "fla_step"): conv_step,
        (gla_fla, "fla_forward"): lambda q, k, v, g, s, h, final: gla_ref(q, k, v, g, scale=s, initial_state=h,
                                                                          output_final_state=final),
        (gdn_fla, "forward"): lambda q, k, v, g, b, s, h, final, l2: gdn_ref(
            q, k, v, g, b, scale=s, initial_state=h, output_final_state=final, use_qk_l2norm=l2),
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
    assert len(results) == 15
    for r in results:
        if r.backend == "flash":
            assert (r.status, r.detail) == (SKIP, "flash-attn not installed"), r
            continue
        assert r.status == PASS, (r.name, r.detail)
        assert set(r.ran) == {r.op} and set(r.ran[r.op]) == {r.backend} and r.ran[r.op][r.backend] >= 1, r
        assert r.errors and max(r.errors.values()) <= r.tol == 6e-2
    assert [r.op for r in kernels.run_kernel_checks("cpu", ("bf16",), ops=["gdn"])] == ["gdn", "gdn"]
    for arch in models.PRESETS:
        v = models.check_model_decode(arch, "cpu", "2L64D")
        assert v.status == PASS, (arch, v.detail)
        assert set(v.ran["cached"]) == {"canon", models.MIXER_OP[arch]}
    v = models.check_model_fast_vs_reference("gla", "cpu", "2L64D")  # 2 layers x (Canon-A/C/D, short convs q/k/v)
    assert v.status == PASS and v.ran == {"fwd+bwd": {"canon": {"dao": 12}, "gla": {"fla": 2}}}, v.detail


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
    model = SimpleNamespace(cfg=SimpleNamespace(arch="llama"), placement=(torch.device("cpu"), torch.float32),
                            backends={"canon": "torch", "attention": "sdpa"})
    trainer = SimpleNamespace(is_global_zero=True, global_step=3, world_size=1, precision="32-true")
    probe.on_train_end(trainer, SimpleNamespace(model=model, device=torch.device("cpu")))
    assert canon.causal_conv1d_torch is original
    info = json.loads(out.read_text())
    assert info["ran"] == {"canon": {"torch": 2}} and info["steps"] == 3 and "fused_split_reason" not in info
