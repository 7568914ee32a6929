"""scripts/gpu_check.sh (the phase runner) with scripts/gpu_check.py (its options, input checks, plan, phase bodies,
key results and summary) on this CPU machine: its dry run (inputs checked, each phase's command and limit printed, the
self-check's lines and the bench's variants listed -- document masking included --, nothing run or written), its
refusals of bad input, and real runs whose GPU phases cannot run here.

Each test copies the script (with setup.sh and pyproject.toml) into an empty repository whose ``.venv/bin/python``
runs this interpreter, so the phases that run (facts, restore, selfcheck, pack) run canonlm for real, and puts a
fake ``nvidia-smi`` first on PATH: one that finds no GPU (the phases that need one are skipped and say so) or one
that lists a GPU (they run on this CPU and fail or time out, and the script goes on). No test runs the install phase:
it would install into this venv (tests/test_wheelhouse.py installs offline for real).

Oracles: the files the test put into the kernel-cache archive (restored into the cache directory, and packed back by
the pack phase, also when split into parts), file modes read with ``os.stat``, and the table parsed from stdout.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["facts", "install", "restore", "warmup", "selfcheck", "pytest", "bench", "pack"]


def _repo(tmp_path: Path, bench: bool = False) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for s in ("gpu_check.sh", "gpu_check.py", "setup.sh", "_uv.sh", "wheelhouse.py"):
        shutil.copy(ROOT / "scripts" / s, repo / "scripts" / s)
    for f in ("pyproject.toml", "uv.lock"):
        shutil.copy(ROOT / f, repo / f)
    if bench:  # the bench and the presets it reads (conf/arch)
        (repo / "bench").mkdir()
        shutil.copy(ROOT / "bench" / "gpu_step.py", repo / "bench" / "gpu_step.py")
        shutil.copytree(ROOT / "conf", repo / "conf")
    (repo / ".venv" / "bin").mkdir(parents=True)
    py = repo / ".venv" / "bin" / "python"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    return repo


def _run(repo: Path, *args: str, gpu: bool = False, timeout: int = 180) -> subprocess.CompletedProcess:
    bindir = repo.parent / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n'
        if gpu
        else '#!/bin/sh\necho "NVIDIA-SMI has failed" >&2\nexit 9\n'
    )
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "CANONLM_KERNEL_CACHE", "SETUP_DRY_RUN")}
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    env["UV"] = str(Path(sys.executable).parent / "uv")  # setup.sh's dry run (install plan) uses this venv's uv
    return subprocess.run(
        ["bash", str(repo / "scripts" / "gpu_check.sh"), *args],
        cwd=repo.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _cache_tar(tmp_path: Path, big: int = 0) -> tuple[Path, dict[str, bytes]]:
    """A kernel-cache archive as the pack phase writes it (members relative to the cache root), and its files."""
    files = {
        "triton/ab12/_kernel.json": b'{"name": "k"}',
        "triton/ab12/_kernel.cubin": b"\x7fELF...",
        "triton/ab12/__grp___kernel.json": b'{"child_paths": {}}',
        "autotune/mamba/k.json": b'{"index": 3}',
        "inductor/fxgraph/x/y": b"graph",
    }
    if big:
        files["triton/big.bin"] = os.urandom(big)  # incompressible: forces parts
    path = tmp_path / "cache-in.tar.gz"
    with tarfile.open(path, "w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size, info.mode = len(data), 0o664  # group-writable in the archive
            t.addfile(info, io.BytesIO(data))
    return path, files


def _table(stdout: str) -> dict[str, tuple[str, str]]:
    """phase -> (status, result) from the table printed last."""
    rows = re.findall(r"^\| (\w+) \| ([^|]+?) \| (\d+) \| ([^|]*?) \| (.*?) \|$", stdout, re.M)
    assert [r[0] for r in rows] == PHASES, stdout[-3000:]
    assert stdout.rstrip().splitlines()[-1].startswith("| pack |")  # the table is the last thing printed
    return {r[0]: (r[1], r[4]) for r in rows}


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_dry_run_checks_inputs_prints_each_phase_and_writes_nothing(tmp_path):
    repo = _repo(tmp_path)
    tar, _ = _cache_tar(tmp_path)
    wh = tmp_path / "wh"
    wh.mkdir()
    shutil.copy(tar, wh / "x-1.0-py3-none-any.whl")  # any file named like a wheel: present
    out, cache = tmp_path / "out", tmp_path / "cache"
    res = _run(
        repo,
        "--dry-run",
        "--out",
        "out",
        "--wheelhouse",
        "wh",
        "--cache-in",
        tar.name,
        "--cache-dir",
        str(cache),
        "--limit",
        "bench=200",
        "--skip",
        "pytest",
        "--warmup",
        "arch=gla canon=AbCD trainer=gpu",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = {
        m[1]: (int(m[2]), m[3])
        for m in re.finditer(r"^\[gpu_check\] \d (\w+) +limit +(\d+) s  (.*)$", res.stdout, re.M)
    }
    assert list(lines) == PHASES
    assert lines["bench"][0] == 200 and lines["selfcheck"][0] == 130
    assert lines["install"][1] == f"bash scripts/setup.sh --wheelhouse {wh}"
    assert lines["restore"][1].startswith(f"(umask 077; cat {tar} | tar -xz -C {cache} --no-same-owner")
    assert lines["selfcheck"][1] == (
        f".venv/bin/python -m canonlm.selfcheck --quick --budget-s <limit - 25 s> --out {out}/selfcheck.md --force"
    )
    assert lines["pytest"][1] == "skipped (--skip)"
    assert lines["warmup"][1].startswith("skipped: no CUDA GPU") and lines["bench"][1].startswith("skipped: no CUDA")
    assert "--cache-in" in res.stdout and "(5 files)" in res.stdout
    assert "[setup] dry run: nothing was changed" in res.stdout  # setup.sh's offline plan, checked too
    assert not out.exists() and not cache.exists() and not (repo / ".venv" / "lib").exists()
    # the self-check's lines (its --list), the document-masking ones among them; the bench is not in this copy
    listed = _listed(
        res.stdout,
        "selfcheck plan: its lines, document masking (doc-mask) included (.venv/bin/python "
        "-m canonlm.selfcheck --quick --list):",
    )
    archs = ("llama", "gla", "gdn", "mamba2")
    doc = (
        [
            f"kernel {o} bf16 doc-mask ({how}) fwd+bwd"
            for o, how in (("gla/fla", "cu_seqlens"), ("gdn/fla", "cu_seqlens"), ("ssd/mamba_ssm", "seq_idx"))
        ]
        + ["model llama doc-mask == documents alone (cuda, fp32)"]
        + [f"cpu model {a} doc-mask == documents alone (fp32)" for a in archs]
    )
    assert [n for n in listed if "doc-mask" in n] == doc
    assert "kernel canon/dao bf16 fwd+bwd" in listed and "cpu train llama canon=ABCD 2L64D 5 steps" in listed
    assert "[gpu_check] bench plan: not listed (bench/gpu_step.py not found)" in res.stdout

    res = _run(repo, "--dry-run", "--out", "out", "--warmup", "arch=gla canon=AbCD trainer=gpu", gpu=True)
    assert res.returncode == 0, res.stderr
    assert re.search(
        r"^\[gpu_check\] 4 warmup +limit +90 s  \.venv/bin/python -m canonlm\.warmup arch=gla canon=AbCD "
        r"trainer=gpu$",
        res.stdout,
        re.M,
    )
    assert re.search(r"^\[gpu_check\] 2 install .*skipped \(no --wheelhouse", res.stdout, re.M)


def _listed(stdout: str, header: str) -> list[str]:
    """The names listed under ``[gpu_check] <header>``: its indented lines, without their ``[...]`` notes."""
    lines = stdout.splitlines()
    assert f"[gpu_check] {header}" in lines, stdout[-3000:]
    out = []
    for line in lines[lines.index(f"[gpu_check] {header}") + 1 :]:
        if not line.startswith("[gpu_check]     "):
            break
        out.append(line[len("[gpu_check]     ") :].split("  [", 1)[0])
    return out


def test_dry_run_lists_the_bench_variants_with_document_masking(tmp_path):
    """With the bench in the repository, the dry run lists its variants for the bench's arguments (--bench-args):
    each canonlm model's document-masked variant right after its plain twin; none with --doc-models none."""
    repo = _repo(tmp_path, bench=True)
    res = _run(repo, "--dry-run", "--out", "out", "--bench-args", "--quick --models llama,gla", gpu=True)
    assert res.returncode == 0, res.stdout + res.stderr
    listed = _listed(
        res.stdout,
        "bench plan (on a CUDA GPU): its variants, document-masked ones (/docs) included "
        "(.venv/bin/python bench/gpu_step.py --quick --models llama,gla --list):",
    )
    assert listed == [
        "12L768D/llama/none/-/eager",
        "12L768D/llama/ABCD/auto/eager",
        "12L768D/llama/ABCD/auto/eager/docs",
        "12L768D/llama/none/-/compiled",
        "12L768D/llama/ABCD/auto/compiled",
        "12L768D/gla/b/auto/eager",
        "12L768D/gla/AbCD/auto/eager",
        "12L768D/gla/AbCD/auto/eager/docs",
    ]
    assert not (tmp_path / "out").exists()
    res = _run(repo, "--dry-run", "--out", "out", "--bench-args", "--quick --doc-models none", gpu=True)
    listed = _listed(
        res.stdout,
        "bench plan (on a CUDA GPU): its variants, document-masked ones (/docs) included "
        "(.venv/bin/python bench/gpu_step.py --quick --doc-models none --list):",
    )
    assert res.returncode == 0 and len(listed) == 11 and not [n for n in listed if "/docs" in n], listed
    res = _run(repo, "--dry-run", "--out", "out", "--bench-args", "--quick --doc-len x", gpu=True)
    assert res.returncode == 0 and re.search(
        r"^\[gpu_check\] bench plan .*: not listed \(.* exits 2: .*--doc-len", res.stdout, re.M
    ), res.stdout[-2000:]


@pytest.mark.parametrize(
    "make, args, names",
    [
        (None, ["--wheelhouse", "nowhere"], ["--wheelhouse", "nowhere': no such directory"]),
        ("emptydir:wh", ["--wheelhouse", "wh"], ["--wheelhouse", "holds no .whl file"]),
        ("text:c.tgz", ["--cache-in", "c.tgz"], ["--cache-in", "c.tgz': not a readable .tar.gz"]),
        (None, ["--cache-in", "none.tgz"], ["--cache-in", "no such file (nor its parts"]),
        ("text:afile", ["--out", "afile"], ["--out", "afile': exists and is not a directory"]),
        ("text:afile", ["--out", "afile/sub"], ["--out", "cannot be created"]),
        ("summary:out", ["--out", "out"], ["already holds summary.md", "--force"]),
        ("mode777:cdir", ["--cache-dir", "ABS:cdir"], ["--cache-dir", "writable by group or others (mode 777)"]),
        (None, ["--cache-dir", "rel/cache"], ["--cache-dir 'rel/cache': must be an absolute path"]),
        (None, ["--skip", "facts,gpu"], ["--skip 'facts,gpu': unknown phase 'gpu'", "selfcheck"]),
        (None, ["--limit", "bench"], ["--limit 'bench'", "PHASE=SECONDS"]),
        (None, ["--limit", "bench=2m"], ["--limit 'bench=2m'", "whole number"]),
        (None, ["--budget", "0"], ["--budget '0'"]),
        (None, ["--frobnicate"], ["unknown argument '--frobnicate'", "--dry-run"]),
    ],
)
@pytest.mark.parametrize("dry", [True, False])
def test_bad_input_is_refused_before_anything_runs(tmp_path, make, args, names, dry):
    repo = _repo(tmp_path)
    if make:
        kind, name = make.split(":")
        p = tmp_path / name
        if kind == "emptydir":
            p.mkdir()
        elif kind == "text":
            p.write_text("not an archive\n")
        elif kind == "summary":
            p.mkdir()
            (p / "summary.md").write_text("an earlier run's\n")
        elif kind == "mode777":
            p.mkdir()
            p.chmod(0o777)
    args = [str(tmp_path / a[4:]) if a.startswith("ABS:") else a for a in args]
    res = _run(repo, *(["--dry-run"] if dry else []), "--out", str(tmp_path / "o"), *args)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "=== " not in res.stdout and "limit" not in res.stdout  # no phase ran or was listed
    for n in names:
        assert n in res.stderr, res.stderr
    assert not (tmp_path / "o").exists() or "--out" in args


def test_real_run_without_a_gpu_reports_each_phase_and_packs_the_cache(tmp_path):
    """No GPU: facts, restore, a selfcheck cut short by its limit (TIMEOUT, the script goes on), pack; warmup, pytest
    and bench skipped as needing a GPU. The archive is split into parts by a 1 MiB file limit, and a second run
    restores from those parts into another cache directory."""
    repo = _repo(tmp_path)
    tar, files = _cache_tar(tmp_path, big=2_500_000)
    out, cache = tmp_path / "out", tmp_path / "cache"
    t0 = time.monotonic()
    res = _run(
        repo,
        "--out",
        "out",
        "--cache-in",
        tar.name,
        "--cache-dir",
        str(cache),
        "--limit",
        "selfcheck=4",
        "--max-file-mib",
        "1",
    )
    took = time.monotonic() - t0
    assert res.returncode == 1, res.stdout + res.stderr  # a phase timed out
    rows = _table(res.stdout)
    assert rows["facts"][0] == "OK" and "torch " in rows["facts"][1]
    assert rows["install"] == ("SKIP", "skipped (no --wheelhouse: the environment as it is)")
    assert rows["restore"][0] == "OK" and rows["restore"][1].startswith(f"{len(files)} files, ")
    assert rows["warmup"] == (
        "SKIP",
        "skipped (no --warmup config: the bench and the self-check compile what they use)",
    )
    for p in ("pytest", "bench"):
        assert rows[p] == ("SKIP", "skipped: no CUDA GPU (nvidia-smi -L lists none)")
    assert rows["selfcheck"][0] == "TIMEOUT"
    assert rows["pack"][0] == "OK" and "kernel-cache.tar.gz.00..02" in rows["pack"][1], rows["pack"]
    assert took < 60
    # the cache directory: the archive's files, private (mode 0700, nothing for group / others)
    assert _tree(cache) == files
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in cache.rglob("*"))
    # --out: flat, within the limits, the summary holding the same table
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "kernel-cache.tar.gz.00",
        "kernel-cache.tar.gz.01",
        "kernel-cache.tar.gz.02",
        "phases.log",
        "summary.md",
    ]
    assert all(p.is_file() and p.stat().st_size <= 1 << 20 for p in out.iterdir())
    assert "| selfcheck | TIMEOUT |" in (out / "summary.md").read_text()
    assert "=== 5 selfcheck (limit 4 s)" in (out / "phases.log").read_text()

    # the parts restore in a later run, into another cache directory
    cache2 = tmp_path / "cache2"
    res = _run(
        repo,
        "--out",
        "out2",
        "--cache-in",
        str(out / "kernel-cache.tar.gz"),
        "--cache-dir",
        str(cache2),
        "--skip",
        "facts,selfcheck,pack",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert _table(res.stdout)["restore"][0] == "OK"
    assert _tree(cache2) == files


def test_gpu_phases_that_fail_or_time_out_here_are_reported_and_the_script_goes_on(tmp_path):
    """With a GPU listed (fake nvidia-smi), warmup, pytest and bench run on this CPU: each fails or hits its limit
    (this repository copy has no tests/ or bench/), each is recorded as such, and the table still comes last."""
    repo = _repo(tmp_path)
    res = _run(
        repo,
        "--out",
        "out",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--skip",
        "selfcheck,pack",
        "--warmup",
        "arch=llama model.size=2L64D",
        "--limit",
        "warmup=3",
        "--limit",
        "pytest=20",
        "--limit",
        "bench=20",
        gpu=True,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    rows = _table(res.stdout)
    for p in ("warmup", "pytest", "bench"):
        assert rows[p][0] == "TIMEOUT" or rows[p][0].startswith("FAIL (exit "), rows
    assert rows["warmup"][1].startswith("0/1 configs warm")
    assert rows["restore"][0] == "OK" and "(no --cache-in: empty)" in rows["restore"][1]
    assert rows["selfcheck"] == ("SKIP", "skipped (--skip)") and rows["pack"] == ("SKIP", "skipped (--skip)")


def test_budget_cuts_phases_and_keeps_time_for_pack(tmp_path):
    """--budget 12 with pack's limit 3: the phases before pack have 12 - (3 + 5) = 4 s, under what each needs (facts
    and restore 5 s, selfcheck 55 s), so they are skipped as out of time, saying so; pack still runs."""
    repo = _repo(tmp_path)
    res = _run(repo, "--out", "out", "--cache-dir", str(tmp_path / "cache"), "--budget", "12", "--limit", "pack=3")
    rows = _table(res.stdout)
    for p in ("facts", "restore", "selfcheck"):
        assert rows[p][0] == "SKIP" and re.fullmatch(
            r"skipped: no time left \(\d s of the --budget 12 s left for it; "
            r"it needs at least \d+ s\)",
            rows[p][1],
        ), rows
    assert rows["pack"] == ("OK", f"no cache directory {tmp_path / 'cache'}: nothing to pack")  # it ran
    assert res.returncode == 0


def test_a_cache_dir_that_holds_other_files_is_refused(tmp_path):
    """--cache-dir must hold nothing but a kernel cache's folders: the script makes it private and packs it whole,
    so a directory of the user's (here with notes.txt) is refused before anything runs, and left as it was."""
    repo = _repo(tmp_path)
    d = tmp_path / "mine"
    d.mkdir(mode=0o755)
    (d / "notes.txt").write_text("mine")
    (d / "triton").mkdir()
    res = _run(repo, "--dry-run", "--out", "out", "--cache-dir", str(d))
    assert res.returncode == 2 and "holds 'notes.txt'" in res.stderr, res.stdout + res.stderr
    assert stat.S_IMODE(d.stat().st_mode) == 0o755 and (d / "notes.txt").read_text() == "mine"


def test_help_prints_the_phases_and_options_and_writes_nothing(tmp_path):
    repo = _repo(tmp_path)
    res = _run(repo, "--help")
    assert res.returncode == 0, res.stderr
    for p in PHASES:
        assert re.search(rf"^  {p} +\S", res.stdout, re.M), p
    for opt in ("--out DIR", "--cache-dir ABS", "--limit PHASE=S", "--dry-run", "Exit status:"):
        assert opt in res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "repo"]


def _logic():
    """scripts/gpu_check.py loaded by path (it is a script, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_logic", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_key_results_are_read_from_the_tools_own_output(tmp_path):
    """The table's result column from each tool's own output: the bench's ratio lines written by
    bench/gpu_step.py's ratio_line, the self-check's report written by canonlm.selfcheck.report.render, pytest's
    summary line, setup.sh's offline messages, the warm-up markers."""
    g = _logic()
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_step
    finally:
        sys.path.pop(0)
    q = {"kind": "canon_overhead", "shape": "12L768D", "what": "llama ABCD/none auto eager", "value": 1.0734}
    lines = [
        gpu_step.ratio_line({**q, "target": 1.15, "op": "<=", "met": True, "same_batch": True}),
        gpu_step.ratio_line({**q, "what": "gla AbCD/b auto eager", "value": 1.2, "target": None, "same_batch": False}),
    ]
    o = {"out": str(tmp_path), "warmups": ["a=1", "b=2"]}
    assert g.key_of("bench", 0, "noise\n" + "\n".join(lines) + "\n", o) == (
        "llama ABCD/none auto eager 1.073x; gla AbCD/b auto eager 1.200x"
    )
    assert g.key_of("bench", 0, "no ratios here\n", o) == "no ratio (see gpu_step.md)"
    assert g.key_of("bench", 1, "Traceback\nRuntimeError: CUDA out of memory\n\n", o) == (
        "RuntimeError: CUDA out of memory"
    )
    log = "....s\n=== 4 passed, 1 skipped, 2390 deselected in 3.21s ===\n"
    assert g.key_of("pytest", 0, log, o) == "4 passed, 1 skipped, 2390 deselected"
    log = "--- python -m canonlm.warmup a=1\nWARMUP OK a=1\n--- python -m canonlm.warmup b=2\nWARMUP FAIL 1 b=2\n"
    assert g.key_of("warmup", 1, log, o) == "1/2 configs warm; failed: b=2;"
    log = (
        "[setup] keeping torch 2.11.0+cu128 (CUDA 12.8) (from python3); offline, nothing replaces it\n"
        "[setup] wheelhouse check (Python 3.12, cp312-cp312-manylinux_2_28_x86_64): every requirement is met, 40 "
        "already installed, 12 from /data/wh: a 1\n"
    )
    assert g.key_of("install", 0, log, o) == (
        "keeping torch 2.11.0+cu128 (CUDA 12.8) (from python3); 12 packages from the wheelhouse"
    )
    # setup.sh's offline check (scripts/wheelhouse.py check) on an empty wheelhouse: what it names is the result
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("wheelhouse_logic", ROOT / "scripts" / "wheelhouse.py")
    w = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(w)
    (tmp_path / "wh").mkdir()
    (tmp_path / "locked.txt").write_text(
        "einops==0.8.2\nfoo-bar==1.0 ; sys_platform == 'linux'\nbaz==2 ; sys_platform == 'win32'\n"
    )
    (tmp_path / "have.txt").write_text("")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = w.check(*(str(tmp_path / f) for f in ("wh", "locked.txt", "have.txt", "need.txt")), "dev")
    assert rc == 2 and g.key_of("install", 2, err.getvalue(), o) == "missing: einops==0.8.2, foo-bar==1.0"

    from canonlm.selfcheck.report import render
    from canonlm.selfcheck.verdict import Result

    results = [Result(st, "d", name=f"line {i}", seconds=1.0) for i, st in enumerate(["PASS", "PASS", "FAIL", "SKIP"])]
    (tmp_path / "selfcheck.md").write_text(render(results, [("torch", "2.11")], {"budget": "105 s"}))
    assert g.key_of("selfcheck", 1, "", o) == "2 PASS, 1 FAIL, 1 SKIP"
    (tmp_path / "selfcheck.md").unlink()  # no report (cut before writing it): the lines it printed are counted
    assert (
        g.key_of("selfcheck", 124, "[PASS] a\n[PASS] b\n[SKIP] c\n", o)
        == "2 PASS, 0 FAIL, 1 SKIP (lines printed; no report)"
    )


def test_limits_are_cut_to_the_budget_and_pack_keeps_its_time():
    """A phase's limit is cut to what the budget leaves after pack's limit + 5 s (5 s when pack is skipped), and a
    phase left with less than it needs is skipped saying so; pack itself may use all that is left."""
    g = _logic()
    o = g.parse(["--budget", "200", "--limit", "pack=30"], "/tmp")
    assert g.limit_now(o, "selfcheck", 0) == (130, "")
    assert g.limit_now(o, "selfcheck", 100) == (65, "")  # 200 - 100 - 35
    lim, why = g.limit_now(o, "selfcheck", 120)  # 45 s < the 55 s it needs
    assert lim == 45 and why.startswith("skipped: no time left (45 s of the --budget 200 s")
    assert g.limit_now(o, "pack", 180) == (20, "")
    o = g.parse(["--budget", "200", "--skip", "pack"], "/tmp")
    assert g.limit_now(o, "bench", 100) == (95, "")


def test_pack_without_room_in_out_keeps_the_archive_beside_the_cache(tmp_path):
    """--max-files 3 and an archive that needs 3 parts of 1 MiB beside phases.log and summary.md: pack fails, says
    where the archive was kept, and writes no part into --out."""
    repo = _repo(tmp_path)
    tar, files = _cache_tar(tmp_path, big=2_500_000)
    cache = tmp_path / "cache"
    res = _run(
        repo,
        "--out",
        "out",
        "--cache-in",
        tar.name,
        "--cache-dir",
        str(cache),
        "--skip",
        "facts,selfcheck",
        "--max-file-mib",
        "1",
        "--max-files",
        "3",
    )
    assert res.returncode == 1, res.stdout + res.stderr
    status, key = _table(res.stdout)["pack"]
    assert status == "FAIL (exit 1)" and key.endswith(
        f"would not fit the 1 files left in --out; kept at {cache}.tar.gz"
    )
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["phases.log", "summary.md"]
    with tarfile.open(f"{cache}.tar.gz") as t:
        assert sorted(m.name[2:] for m in t if m.isfile()) == sorted(files)
