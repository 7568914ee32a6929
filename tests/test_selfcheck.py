"""``python -m canonlm.selfcheck``: the CPU run end to end (report, SKIP lines, refusal to overwrite), the verdict
rules (a fallback to the reference is never a PASS), and the GPU harness dry-run on the CPU with every fast path
replaced by its reference."""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch


import canonlm.selfcheck as sc

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
        if len(cells) == 4 and cells[0] in (sc.PASS, sc.FAIL, sc.SKIP):
            out[cells[1]] = (cells[0], cells[2])
    return out


@CPU_ONLY
@pytest.mark.slow
def test_cpu_run_writes_the_report_and_never_passes_gpu_lines(tmp_path):
    out = tmp_path / "r.md"
    p = _selfcheck(["--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sc.NO_CUDA_MESSAGE in p.stdout
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
    assert all(r == (sc.SKIP, sc.NO_CUDA) for r in gpu.values()), gpu
    assert len(cpu) >= 10 and all(r[0] == sc.PASS for r in cpu.values()), cpu
    for arch in ("llama", "gla", "gdn", "mamba2"):
        assert "tokens/s" in next(r[1] for n, r in cpu.items() if n.startswith(f"cpu train {arch} "))
    # an existing report is not overwritten
    before = out.read_text()
    p2 = _selfcheck(["--out", str(out)], tmp_path, timeout=60)
    assert p2.returncode == 2 and "exists" in p2.stderr and "--force" in p2.stderr
    assert out.read_text() == before


def test_fallback_to_reference_is_fail():
    """A kernel result whose selected backend is the reference fails, however small its errors."""
    status, detail = sc.judge_kernel("fla", "reference", {"o": 0.0, "dq": 1e-9}, 1e-3)
    assert status == sc.FAIL and "fallback" in detail
    assert sc.judge_kernel("fla", "fla", {"o": 1e-4}, 1e-3)[0] == sc.PASS
    assert sc.judge_kernel("fla", "fla", {"o": 1e-4, "dq": 2e-3}, 1e-3)[0] == sc.FAIL
    assert sc.judge_kernel("fla", "fla", {"o": math.nan}, 1e-3)[0] == sc.FAIL
    assert sc.judge_kernel("fla", "fla", {}, 1e-3)[0] == sc.FAIL  # nothing compared is no pass


def test_training_fallback_and_short_runs_are_fail():
    spec = sc.TrainSpec("train gla", "gla", "AbCD", [], 30, 1, "cuda", 10)
    rows = [{"step": s, "train/loss": 3.0 - s / 100} for s in range(30)]
    rows += [{"step": s, "perf/tokens_per_s": 1e5, "perf/mfu": 0.3, "perf/peak_mem_gb": 9.5} for s in (5, 10, 15)]
    info = {"steps": 30, "world_size": 1, "backends": {"canon": "dao", "gla": "fla"},
            "selected": {"canon": ["dao"], "gla": ["fla"]}, "peak_mem_gib": 10.0}
    want = {"canon": "dao", "gla": "fla"}
    status, detail = sc.judge_training(spec, rows, info, want)
    assert status == sc.PASS and "tokens/s 100,000" in detail and "MFU 30.0%" in detail and "10.00 GiB" in detail
    fell_back = {**info, "selected": {"canon": ["dao"], "gla": ["reference"]}}
    status, detail = sc.judge_training(spec, rows, fell_back, want)
    assert status == sc.FAIL and "gla ran reference" in detail
    assert sc.judge_training(spec, rows, {**info, "steps": 12}, want)[0] == sc.FAIL
    assert sc.judge_training(spec, rows + [{"train/loss": math.inf}], info, want)[0] == sc.FAIL


def test_run_check_turns_exceptions_into_lines():
    def boom():
        raise RuntimeError("kernel crashed")

    def skip():
        raise sc.Skip("needs 2 GPUs")

    assert sc.run_check("a", boom).status == sc.FAIL and "kernel crashed" in sc.run_check("a", boom).detail
    assert (sc.run_check("b", skip).status, sc.run_check("b", skip).detail) == (sc.SKIP, "needs 2 GPUs")
    assert sc.run_check("c", lambda: ("MAYBE", "")).status == sc.FAIL


def test_missing_library_skips_and_broken_install_fails(monkeypatch):
    monkeypatch.setattr(sc, "dist_version", lambda names: None)
    status, reason = sc._fast_unavailable("attention", "flash", "cuda", torch.bfloat16)
    assert status == sc.SKIP and "flash-attn not installed" in reason
    monkeypatch.setattr(sc, "dist_version", lambda names: "9.9")  # "installed", but the module does not import
    monkeypatch.setitem(sc.FAST_LIBS, ("gla", "fla"), ((("fla-core",),), ("canonlm_no_such_module.ops",)))
    status, reason = sc._fast_unavailable("gla", "fla", "cuda", torch.bfloat16)
    assert status == sc.FAIL and "installed but" in reason


def test_write_report_never_overwrites_without_force(tmp_path):
    path = tmp_path / "r.md"
    sc.write_report(path, "one", force=False)
    with pytest.raises(FileExistsError):
        sc.write_report(path, "two", force=False)
    assert path.read_text() == "one" and sorted(os.listdir(tmp_path)) == ["r.md"]
    sc.write_report(path, "three", force=True)
    assert path.read_text() == "three"


# ----------------------------------------------------------------------------------------------------------------
# the GPU harness, dry-run on the CPU: every fast path replaced by its reference
# ----------------------------------------------------------------------------------------------------------------

AUTO = {"canon": "dao", "attention": "sdpa", "gla": "fla", "gdn": "fla", "ssd": "mamba_ssm"}


@pytest.fixture
def stubbed(monkeypatch):
    """Run the GPU checks on the CPU: fast backend names map to the references inside the ops."""
    import canonlm.ops.attention as att
    import canonlm.ops.canon as canon
    import canonlm.ops.gdn as gdn
    import canonlm.ops.gla as gla
    import canonlm.ops.ssd as ssd

    monkeypatch.setattr(sc, "_DEV", "cpu")
    monkeypatch.setattr(sc, "_fast_unavailable", lambda op, fast, dev, dt: None)
    monkeypatch.setattr(sc, "_resolve", lambda op, name, dev, dt: AUTO[op] if name == "auto" else name)
    monkeypatch.setattr(sc, "_expected_fast", lambda arch, dt: {})

    def swap(mod, fname, mapping):
        orig = getattr(mod, fname)

        @functools.wraps(orig)
        def f(*a, backend="auto", **k):
            return orig(*a, backend=mapping.get(backend, backend), **k)
        monkeypatch.setattr(mod, fname, f)

    swap(canon, "causal_conv1d", {"dao": "torch", "fla": "torch"})
    swap(canon, "causal_conv1d_step", {"dao": "torch", "fla": "torch"})
    swap(att, "attention", {"flash": "sdpa"})
    swap(gla, "chunk_gla", {"fla": "reference"})
    swap(gdn, "chunk_gated_delta_rule", {"fla": "reference"})
    swap(ssd, "ssd_scan", {"mamba_ssm": "reference"})
    monkeypatch.setattr(ssd, "split_conv1d_scan_combined", ssd.split_conv1d_scan_reference)
    monkeypatch.setattr(ssd, "use_fused_split", lambda *a: True)


def test_gpu_kernel_harness_dry_run_on_cpu(stubbed, tmp_path):
    args = SimpleNamespace(quick=True, batch=8, size="12L768D", steps=30)
    checks = [(n, f) for n, f in sc.gpu_checks(args, tmp_path) if n.startswith(("kernel ", "model "))]
    assert len(checks) >= 15
    results = [sc.run_check(n, f) for n, f in checks]
    assert all(r.status == sc.PASS for r in results), [(r.name, r.detail) for r in results if r.status != sc.PASS]


def test_gpu_kernel_harness_reports_a_fallback(stubbed, monkeypatch):
    monkeypatch.setattr(sc, "_resolve", lambda op, name, dev, dt: "reference" if name == "auto" else name)
    r = sc.run_check("kernel gla/fla bf16 fwd+bwd", lambda: sc.check_gla_kernel("bf16", "fwd+bwd"))
    assert r.status == sc.FAIL and "'reference' was selected" in r.detail
