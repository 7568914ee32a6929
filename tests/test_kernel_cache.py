"""The kernel cache (canonlm.utils.kernel_cache): which directory, the trust rule, the environment the libraries read,
and mamba-ssm's autotune choices kept across processes without dropping their pre-hooks.

Real directories with real modes; the libraries' own functions read the variables (triton's ``knobs.cache.dir`` and
cache manager, torch inductor's ``cache_dir()`` / ``triton_cache_dir()``). The mamba-ssm tests run the real mamba-ssm
2.3.1 autotuned kernels (``_chunk_cumsum_fwd_kernel``; ``_chunk_cumsum_bwd_kernel``, whose configs all carry
``pre_hook=init_to_zero(["dA_ptr", "ddt_bias_ptr"])``) with the real ``triton.runtime.autotuner.Autotuner`` under
Triton's interpreter (tests/_triton_interp.py, in subprocesses: the interpreter must be on before triton is imported),
with its first-config-only patch undone so the autotuner really benchmarks. The one fake is the benchmark timer
(``Autotuner.do_bench`` needs a GPU's events): it runs each config's kernel call for real and returns a fixed time per
config (``BLOCK_SIZE_H=8`` fastest), so the choice is known. The outputs are checked against plain-torch autograd
of the same function with every ``torch.empty_like`` buffer poisoned with NaN: a buffer the pre-hook must zero (dA,
ddt_bias accumulate with atomics) would come out NaN if the hook were dropped, which a mutant shows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from canonlm.errors import ConfigError
from canonlm.utils import kernel_cache as kc

HERE = Path(__file__).resolve().parent
VARS = (
    "CANONLM_KERNEL_CACHE",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "CANONLM_CACHE",
    "XDG_CACHE_HOME",
    "TRITON_HOME",
)
MISSING = [m for m in ("triton", "mamba_ssm", "causal_conv1d") if importlib.util.find_spec(m) is None]


@pytest.fixture(autouse=True)
def clean(tmp_path, monkeypatch):
    """No cache variables, HOME in tmp_path, a fresh module state (and the same after the test)."""
    kc._reset_for_tests()
    for v in VARS:
        monkeypatch.delenv(v, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    yield home
    kc._reset_for_tests()


def _mode(p: Path) -> int:
    return os.stat(p).st_mode & 0o777


# ---------------------------------------------------------------------------------------------------------------
# which directory
# ---------------------------------------------------------------------------------------------------------------


def test_resolution_order(tmp_path, monkeypatch, clean):
    """explicit path > $CANONLM_KERNEL_CACHE > <canonlm cache>/kernels, where <canonlm cache> is the native Canon
    kernel's root: $CANONLM_CACHE > $XDG_CACHE_HOME/canonlm > ~/.cache/canonlm."""
    from canonlm.ops.canon import _native

    home = clean
    assert kc.configure() == home / ".cache" / "canonlm" / "kernels" == _native.cache_dir() / "kernels"
    kc._reset_for_tests()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kc.configure() == tmp_path / "xdg" / "canonlm" / "kernels" == _native.cache_dir() / "kernels"
    kc._reset_for_tests()
    monkeypatch.setenv("CANONLM_CACHE", str(tmp_path / "cc"))
    assert kc.configure() == tmp_path / "cc" / "kernels" == _native.cache_dir() / "kernels"
    kc._reset_for_tests()
    monkeypatch.setenv("CANONLM_KERNEL_CACHE", str(tmp_path / "env"))
    assert kc.configure() == tmp_path / "env"
    kc._reset_for_tests()
    assert kc.configure(str(tmp_path / "explicit")) == tmp_path / "explicit"
    kc._reset_for_tests()
    assert kc.configure("") == tmp_path / "env"  # an empty value is "not set"
    root = kc.configure(tmp_path / "explicit")
    for d in (root, root / "triton", root / "inductor", root / "autotune"):
        assert d.is_dir() and _mode(d) == 0o700, d


def test_relative_path_is_resolved_once(tmp_path, monkeypatch):
    """A relative value becomes one absolute path (against ``base``, else the working directory), and the variables
    the libraries read hold that absolute path: moving the working directory afterwards changes nothing."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    root = kc.configure("kc", base=tmp_path / "launch")
    assert root == tmp_path / "launch" / "kc" and root.is_absolute()
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")
    monkeypatch.chdir(tmp_path)
    assert kc.configure("kc", base=tmp_path / "launch") == root
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")
    kc._reset_for_tests()
    assert kc.configure("~/kc2") == tmp_path / "home" / "kc2"
    kc._reset_for_tests()
    assert kc.configure("sub/../kc3") == tmp_path / "kc3"  # cwd is tmp_path now


def test_environment_the_libraries_read(tmp_path):
    """TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR / CANONLM_KERNEL_CACHE are set, and the real libraries' own functions
    answer the kernel cache's subfolders."""
    import triton
    from torch._inductor.runtime import cache_dir_utils
    from triton.runtime.cache import get_cache_manager

    root = kc.configure(tmp_path / "kc")
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert os.environ["CANONLM_KERNEL_CACHE"] == str(root)
    assert triton.knobs.cache.dir == str(root / "triton")
    manager = get_cache_manager("ab" * 32)  # Triton reads the variable per cache manager
    assert Path(manager.cache_dir).parent == root / "triton"
    assert cache_dir_utils.cache_dir() == str(root / "inductor")
    assert cache_dir_utils.triton_cache_dir(0) == str(root / "triton")  # inductor's own Triton kernels go there too
    # a second configure (another directory) moves what canonlm set, with no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        root2 = kc.configure(tmp_path / "kc2")
    assert triton.knobs.cache.dir == str(root2 / "triton") and cache_dir_utils.cache_dir() == str(root2 / "inductor")


def test_configure_is_cheap_and_imports_no_compiler(tmp_path):
    """A fresh process: configure() imports neither torch nor triton nor torch._dynamo / inductor; a repeated call
    returns at once."""
    code = textwrap.dedent(f"""
        import sys, time, json
        from canonlm.utils import kernel_cache
        root = kernel_cache.configure({str(tmp_path / "kc")!r})
        t = time.perf_counter()
        for _ in range(100):
            kernel_cache.configure({str(tmp_path / "kc")!r})
        again = (time.perf_counter() - t) / 100
        print(json.dumps(dict(root=str(root), again=again,
                              loaded=[m for m in ("torch", "triton", "torch._dynamo", "torch._inductor")
                                      if m in sys.modules])))
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in VARS},
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["root"] == str(tmp_path / "kc") and out["loaded"] == []
    assert out["again"] < 1e-3, out  # a repeated call only compares the request and the environment


# ---------------------------------------------------------------------------------------------------------------
# the trust rule and bad values
# ---------------------------------------------------------------------------------------------------------------


def test_untrusted_configured_dir_falls_back_with_one_warning(tmp_path, clean):
    """A world-writable or symlinked configured directory is not used: <canonlm cache>/kernels instead, else a
    private temp dir; one warning naming the directory and why."""
    home = clean
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.warns(
        RuntimeWarning,
        match=r"not using the kernel cache .*shared: it is writable by group or "
        r"others \(mode 0o777\)",
    ) as w:
        root = kc.configure(shared)
    assert len(w) == 1
    assert root == home / ".cache" / "canonlm" / "kernels" and _mode(root) == 0o700
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")
    assert list(shared.iterdir()) == []  # nothing created in the refused directory
    kc._reset_for_tests()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real").mkdir(mode=0o700)
    with pytest.warns(RuntimeWarning, match="is a symlink"):
        assert kc.configure(link) == root
    kc._reset_for_tests()
    os.chmod(root, 0o770)  # the default is unsafe too: a private temp directory
    with pytest.warns(RuntimeWarning, match="not using the kernel cache"):
        private = kc.configure(shared)
    assert private.parent != root.parent and _mode(private) == 0o700 and private.owner() == root.owner()
    assert (private / "triton").is_dir() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(private / "inductor")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kc.configure(shared) == private  # once per process


def test_untrusted_env_dir_falls_back(tmp_path, monkeypatch, clean):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    monkeypatch.setenv("CANONLM_KERNEL_CACHE", str(shared))
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        assert kc.configure() == clean / ".cache" / "canonlm" / "kernels"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_dir_owned_by_another_user_is_refused(tmp_path, clean):
    other = tmp_path / "other"
    other.mkdir(mode=0o755)
    os.chown(other, 65534, 65534)
    with pytest.warns(RuntimeWarning, match="is owned by uid 65534"):
        assert kc.configure(other) == clean / ".cache" / "canonlm" / "kernels"


def test_impossible_values_are_config_errors(tmp_path, monkeypatch):
    """A value that cannot be a directory of ours is a ConfigError naming the key (or the variable) and the value."""
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError) as e:
        kc.configure(str(f))
    assert e.value.key == "paths.kernel_cache" and e.value.value == str(f) and "cannot be created" in str(e.value)
    with pytest.raises(ConfigError, match=r"paths\.kernel_cache=.*file/sub.*cannot be created"):
        kc.configure(str(f / "sub"))
    (tmp_path / "kc").mkdir(mode=0o700)
    (tmp_path / "kc" / "triton").write_text("x")
    with pytest.raises(ConfigError, match=r"subfolder triton/ that cannot be created"):
        kc.configure(tmp_path / "kc")
    monkeypatch.setenv("CANONLM_KERNEL_CACHE", str(f))
    with pytest.raises(ConfigError) as e:
        kc.configure()
    assert e.value.key == "CANONLM_KERNEL_CACHE"
    assert "TRITON_CACHE_DIR" not in os.environ  # nothing applied


def test_unwritable_dir_is_a_config_error(tmp_path):
    """A directory this user cannot write: mode 0500 for an ordinary user; as root (who writes through modes), the
    same directory bind-mounted read-only in a private mount namespace (``unshare -rm``: root of a user namespace
    mapped to this user), where the write fails with EROFS, as on a read-only mount."""
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    if os.geteuid() != 0:
        with pytest.raises(ConfigError, match="is not writable"):
            kc.configure(d)
        return
    code = (
        "import sys\nfrom canonlm.errors import ConfigError\nfrom canonlm.utils import kernel_cache as kc\n"
        "try:\n    kc.configure(sys.argv[1])\nexcept ConfigError as e:\n    print(e)\n    sys.exit(3)\n"
    )
    script = f'mount --bind {d} {d} && mount -o remount,bind,ro {d} && {sys.executable} -c "$0" {d}'
    p = subprocess.run(["unshare", "-rm", "sh", "-c", script, code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "paths.kernel_cache" in p.stdout and "is not writable" in p.stdout


def test_user_set_variables_win_with_a_warning(tmp_path, monkeypatch):
    """A TRITON_CACHE_DIR the user set is left as it is (one warning says where Triton's kernels go); one equal to
    the kernel cache's, or torch's own default, is not a conflict."""
    from torch._inductor.runtime import cache_dir_utils

    mine = str(tmp_path / "my-triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", mine)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", cache_dir_utils.default_cache_dir())  # as torch sets it itself
    with pytest.warns(RuntimeWarning, match=r"TRITON_CACHE_DIR=.*my-triton is set in the environment and wins") as w:
        root = kc.configure(tmp_path / "kc")
    assert len(w) == 1
    assert os.environ["TRITON_CACHE_DIR"] == mine
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    kc._reset_for_tests()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "kc" / "triton"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kc.configure(tmp_path / "kc")


def test_run_refuses_a_bad_kernel_cache_before_writing(tmp_path, compose_cfg):
    """``paths.kernel_cache`` that cannot be a directory stops ``run`` with a ConfigError naming the key, and the run
    directory Hydra made for it is removed (nothing written)."""
    from canonlm.train.run import run

    f = tmp_path / "file"
    f.write_text("x")
    out = tmp_path / "logs" / "train" / "runs" / "test"
    out.mkdir(parents=True)
    cfg = compose_cfg([f"paths.kernel_cache={f}/kc"], output_dir=out)
    with pytest.raises(ConfigError) as e:
        run(cfg)
    assert e.value.key == "paths.kernel_cache" and not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# fla: its autotune results go to Triton's cache (TRITON_CACHE_DIR) by themselves
# ---------------------------------------------------------------------------------------------------------------

FLA_SCRIPT = r"""
import importlib, json, sys
from triton.runtime.autotuner import Autotuner
# what canonlm's fla paths load (GLA, GDN, Canon's fla causal_conv1d)
for name in ("fla.ops.gla", "fla.ops.gated_delta_rule", "fla.modules.causal_conv1d.ops"):
    importlib.import_module(name)
found = {}
for name, mod in list(sys.modules.items()):
    if name.startswith("fla.") and mod is not None:
        for k, obj in vars(mod).items():
            for _ in range(6):
                if isinstance(obj, Autotuner):
                    found[f"{name}.{k}"] = [bool(obj.cache_results), any(c.pre_hook for c in obj.configs)]
                    break
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break
print("RESULT " + json.dumps(found))
"""


@pytest.mark.skipif(importlib.util.find_spec("fla") is None and not os.environ.get("CI"), reason="needs fla-core")
def test_fla_autotune_results_are_stored_by_triton():
    """fla-core 0.6.0's autotuners (every one in the modules canonlm's GLA, GDN and Canon paths import) were built
    with ``cache_results=True`` (``FLA_CACHE_RESULTS``, on by default) and none of their configs has a pre-hook, so
    Triton's ``check_disk_cache`` stores and reuses all of them in ``TRITON_CACHE_DIR``: the kernel cache's
    ``triton/``. (Not under the interpreter, where Triton switches ``cache_results`` off.)"""
    env = {k: v for k, v in os.environ.items() if k not in (*VARS, "TRITON_INTERPRET", "FLA_CACHE_RESULTS")}
    r = subprocess.run([sys.executable, "-c", FLA_SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    found = json.loads(lines[-1][len("RESULT ") :])
    assert len(found) >= 100, len(found)
    assert [k for k, (cached, _) in found.items() if not cached] == []
    assert [k for k, (_, hooked) in found.items() if hooked] == []


# ---------------------------------------------------------------------------------------------------------------
# mamba-ssm autotune choices across processes (real Autotuner, real kernels, Triton interpreter)
# ---------------------------------------------------------------------------------------------------------------

SCRIPT = r'''
import json, os, sys
phase, root, here = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, here)
os.environ["TRITON_INTERPRET"] = "1"
from triton.runtime import autotuner
prune = autotuner.Autotuner.prune_configs  # the real pruning: _triton_interp's patch 1 keeps the first config only
import _triton_interp
_triton_interp.enable()
autotuner.Autotuner.prune_configs = prune
import torch, triton
from canonlm.utils import kernel_cache
if phase == "first":  # configured before the import: the import hook wraps the autotuners
    kernel_cache.configure(root)
    from mamba_ssm.ops.triton import ssd_chunk_state as m
else:                  # imported before: configure() wraps the modules already loaded
    from mamba_ssm.ops.triton import ssd_chunk_state as m
    kernel_cache.configure(root)
fwd, bwd = m._chunk_cumsum_fwd_kernel, m._chunk_cumsum_bwd_kernel
bench = []

def timer(name):
    """Stand-in for the GPU benchmarker: runs the real kernel call, returns a fixed time (BLOCK_SIZE_H=8 fastest)."""
    def do_bench(kernel_call, quantiles):
        cells = (c.cell_contents for c in kernel_call.__closure__)
        config = dict(zip(kernel_call.__code__.co_freevars, cells))["config"]  # Autotuner._bench's closure
        kernel_call()
        h = config.kwargs["BLOCK_SIZE_H"]
        bench.append([name, h])
        t = 1.0 if h == 8 else 2.0 + abs(h.bit_length() - 4)
        return [t, t, t]
    return do_bench

fwd.do_bench, bwd.do_bench = timer("fwd"), timer("bwd")
if phase == "second":
    fwd.configs = fwd.configs[1:]  # a changed config list: the first config dropped
empty_like = torch.empty_like
torch.empty_like = lambda *a, **k: empty_like(*a, **k).fill_(float("nan"))  # unzeroed accumulators show up as NaN

def case(h, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, T, cs = 1, 32, 16
    dt, A, bias = torch.randn(b, T, h, generator=g), -torch.rand(h, generator=g), torch.randn(h, generator=g)
    ddA, ddt_out = torch.randn(b, h, T // cs, cs, generator=g), torch.randn(b, h, T // cs, cs, generator=g)
    return dict(b=b, T=T, cs=cs, dt=dt, A=A, bias=bias, ddA=ddA, ddt_out=ddt_out)

def errors(c, forward=True):
    """max abs errors of mamba-ssm's fwd + bwd against plain-torch autograd of dt_out = softplus(dt + bias),
    dA = dt_out * A (cumsum within chunks for the forward's dA_cumsum)."""
    if forward:
        dA_cs, dt_out = m._chunk_cumsum_fwd(c["dt"], c["A"], c["cs"], dt_bias=c["bias"], dt_softplus=True)
    ddt, dA, dbias = m._chunk_cumsum_bwd(c["ddA"], c["ddt_out"], c["dt"], c["A"], dt_bias=c["bias"], dt_softplus=True)
    dt_, A_, b_ = (c[k].clone().requires_grad_() for k in ("dt", "A", "bias"))
    x = torch.nn.functional.softplus(dt_ + b_).reshape(c["b"], -1, c["cs"], len(A_)).permute(0, 3, 1, 2)
    a = x * A_[None, :, None, None]
    (a * c["ddA"] + x * c["ddt_out"]).sum().backward()
    e = lambda u, v: float((u - v.detach()).abs().max())
    out = {"ddt": e(ddt, dt_.grad), "dA": e(dA, A_.grad), "ddt_bias": e(dbias, b_.grad)}
    if forward:
        out.update(dt_out=e(dt_out, x), dA_cumsum=e(dA_cs, a.cumsum(-1)))
    return out

def chosen(at):
    cfg = next(iter(at.cache.values()))
    idx = [i for i, c in enumerate(at.configs) if c is cfg]
    hook = cfg.pre_hook
    return {"block": cfg.kwargs["BLOCK_SIZE_H"], "index_by_identity": idx, "n_configs": len(at.configs),
            "pre_hook_names": [c.cell_contents for c in hook.__closure__] if hook else None,
            "pre_hook_is_original": bool(idx) and hook is at.configs[idx[0]].pre_hook}

out = {"err": errors(case(8)), "fwd": chosen(fwd), "bwd": chosen(bwd), "stats": dict(kernel_cache._stats)}
if phase == "first":
    out["bench_first"] = list(bench)
    c6 = case(6, seed=1)                         # a second tuning key (nheads=6): recorded, then corrupted
    errors(c6, forward=False)
    d = os.path.join(root, "autotune", "_chunk_cumsum_bwd_kernel")
    newest = [p for p in (os.path.join(d, f) for f in os.listdir(d)) if json.load(open(p))["key"][1] == "6"][0]
    open(newest, "w").write("{not json")
    key6 = [k for k in bwd.cache if k[1] == 6][0]
    bwd.cache.pop(key6)
    n = len(bench)
    out["err6"] = errors(c6, forward=False)
    out["bench_after_corrupt"] = [x for x in bench[n:] if x[0] == "bwd"]
    out["corrupt_rewritten"] = json.load(open(newest))["config"]
else:
    out["bench"] = list(bench)
    # mutant: the same restored choice without its pre_hook must be caught (dA, ddt_bias are then not zeroed)
    load = kernel_cache._load_choice
    def stripped(self, *a):
        c = load(self, *a)
        return None if c is None else triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
    kernel_cache._load_choice = stripped
    bwd.cache.clear()
    out["mutant_err"] = errors(case(8), forward=False)
    out["mutant_bench"] = len(bench) - len(out["bench"])
out["stats_end"] = kernel_cache._stats
out["records"] = sorted(os.path.relpath(os.path.join(b, f), root) for b, _, fs in os.walk(root) for f in fs
                        if f.endswith(".json"))
print("RESULT " + json.dumps(out))
'''


def _interp(phase: str, root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, phase, str(root), str(HERE)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(HERE.parent),
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"{phase} process failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.skipif(
    bool(MISSING) and not os.environ.get("CI"), reason=f"needs {', '.join(MISSING)} (bash scripts/setup.sh dev,interp)"
)
def test_mamba_autotune_choice_survives_the_process_with_its_pre_hook(tmp_path):
    root = tmp_path / "kc"
    one = _interp("first", root)
    # first process: every config benchmarked once per kernel, BLOCK_SIZE_H=8 chosen, results right
    assert sorted(one["bench_first"]) == sorted([[k, h] for k in ("fwd", "bwd") for h in (1, 2, 4, 8, 16, 32, 64)])
    assert one["fwd"]["block"] == one["bwd"]["block"] == 8
    assert max(one["err"].values()) < 1e-5, one["err"]
    assert one["bwd"]["pre_hook_names"] == [["dA_ptr", "ddt_bias_ptr"]]  # init_to_zero(names) closes over names
    # a corrupt record is ignored: benchmarked again, rewritten, still right
    assert len(one["bench_after_corrupt"]) == 7 and one["stats_end"]["ignored"] == 1
    assert "BLOCK_SIZE_H: 8" in one["corrupt_rewritten"] and max(one["err6"].values()) < 1e-5
    # one record per kernel and tuning key (bwd: nheads 8 and 6; fwd: 8)
    assert sum(r.startswith("autotune/_chunk_cumsum_bwd_kernel/") for r in one["records"]) == 2
    assert sum(r.startswith("autotune/_chunk_cumsum_fwd_kernel/") for r in one["records"]) == 1

    two = _interp("second", root)
    # second process: the backward kernel is not benchmarked; its choice is the very Config object, pre_hook and all
    assert [b for b in two["bench"] if b[0] == "bwd"] == []
    assert two["bwd"] == dict(one["bwd"], pre_hook_is_original=True) and two["bwd"]["index_by_identity"] == [3]
    assert two["stats"]["restored"] == 1 and two["stats"]["benchmarked"] == 1  # bwd restored; fwd (list changed)
    # ... and the pre_hook ran: every output right although empty buffers are NaN
    assert max(two["err"].values()) < 1e-5, two["err"]
    # the forward kernel's config list changed (first config dropped): its record is not used, the 6 configs are
    # benchmarked again and the same config wins (at index 2 now; the old index 3 would be BLOCK_SIZE_H=16)
    assert sorted(h for k, h in two["bench"] if k == "fwd") == [2, 4, 8, 16, 32, 64]
    assert two["fwd"]["block"] == 8 and two["fwd"]["index_by_identity"] == [2]
    # mutant: the restored choice without its pre_hook leaves dA / ddt_bias unzeroed -- the check above catches it
    assert two["mutant_bench"] == 0
    assert not (two["mutant_err"]["dA"] < 1e-3 and two["mutant_err"]["ddt_bias"] < 1e-3), two["mutant_err"]
    assert two["mutant_err"]["ddt"] < 1e-5  # ddt is written whole: only the accumulated outputs depend on the hook


def test_only_mamba_ssm_autotuners_are_wrapped(tmp_path, monkeypatch):
    """configure() wraps the real Autotuner instances of ``mamba_ssm.ops.triton.*`` modules already imported (their
    class becomes the recording subclass; ``run`` is the only method it overrides) and leaves other modules' alone;
    the import hook answers only for those modules and is gone after a reset."""
    import types

    import triton
    import triton.language as tl

    def make():
        @triton.autotune(configs=[triton.Config({"B": 1}), triton.Config({"B": 2})], key=["n"])
        @triton.jit
        def kernel(x, n, B: tl.constexpr):
            pass

        return kernel

    mine, other = types.ModuleType("mamba_ssm.ops.triton._kc_test"), types.ModuleType("other_lib._kc_test")
    mine.kernel, other.kernel = make(), make()
    monkeypatch.setitem(sys.modules, mine.__name__, mine)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    from triton.runtime.autotuner import Autotuner

    kc.configure(tmp_path / "kc")
    assert type(mine.kernel) is not Autotuner and isinstance(mine.kernel, Autotuner)
    assert [k for k, v in vars(type(mine.kernel)).items() if callable(v)] == ["run"]
    assert type(other.kernel) is Autotuner
    hook = next(f for f in sys.meta_path if isinstance(f, kc._ImportHook))
    assert hook.find_spec("other_lib.x", None) is None
    kc._reset_for_tests()
    assert not any(isinstance(f, kc._ImportHook) for f in sys.meta_path)


def test_evaluation_and_generation_use_the_runs_kernel_cache(tmp_path, monkeypatch):
    """Commands other than training configure the cache too (eval/load.load_model, behind evaluation, the harness
    and generation): the run's recorded ``paths.kernel_cache`` when it has one, else ``$CANONLM_KERNEL_CACHE``."""
    from omegaconf import OmegaConf

    from canonlm.eval.load import _kernel_cache

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    _kernel_cache(OmegaConf.create({"paths": {"kernel_cache": str(tmp_path / "recorded")}}))
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "recorded" / "triton")
    kc._reset_for_tests()
    monkeypatch.setenv("CANONLM_KERNEL_CACHE", str(tmp_path / "env"))
    _kernel_cache(None)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "env" / "triton")


def test_a_child_with_its_own_cache_does_not_take_its_parents_for_a_users_choice(tmp_path, monkeypatch):
    """A canonlm parent exported CANONLM_KERNEL_CACHE and TRITON_CACHE_DIR=<its root>/triton; a child configured with
    another ``paths.kernel_cache`` moves both to its own root, without the "set in the environment and wins"
    warning (that is kept for a value the user set)."""
    import warnings

    parent = tmp_path / "parent"
    monkeypatch.setenv("CANONLM_KERNEL_CACHE", str(parent))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(parent / "triton"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(parent / "inductor"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        root = kc.configure(tmp_path / "child")
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
