"""Interpreter tier: every Triton call site canonlm has, run for real on CPU under Triton's interpreter.

canonlm's fast paths call fla's and mamba-ssm's Triton kernels on a GPU; no GPU is available to this project's CI.
Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernel source with numpy on CPU tensors, so every call
site runs here through canonlm's *public* op with the fast backend pinned (``backend="fla"`` / ``"mamba_ssm"``),
forward and backward where the op has one, in float32 and bfloat16, at tiny shapes, and is compared with canonlm's
reference op computed in float64 on the same inputs (the same bf16-rounded values for bf16 cases):

* fla ``chunk_gla`` -- ``ops.gla.chunk_gla`` with grad on (case ``gla_chunk``);
* fla ``fused_recurrent_gla`` -- ``ops.gla.chunk_gla`` without grad, T <= 64: the decode path (``gla_decode``);
* fla ``chunk_gated_delta_rule`` -- ``ops.gdn.chunk_gated_delta_rule`` with grad on (``gdn_chunk``);
* fla ``fused_recurrent_gated_delta_rule`` -- the same op without grad, T <= 64 (``gdn_decode``);
* fla ``causal_conv1d`` (Canon) -- ``ops.canon.causal_conv1d``: residual + bias + initial state, SiLU without
  residual, a strided slice and a transposed tensor as input (``canon_*``);
* fla ``causal_conv1d_update`` -- ``ops.canon.causal_conv1d_step`` (``canon_step``);
* mamba-ssm ``mamba_chunk_scan_combined`` -- ``ops.ssd.ssd_scan`` with grad on, 4 heads in 2 groups (``ssd_chunk``);
* mamba-ssm ``selective_state_update`` -- ``ops.ssd.ssd_scan`` without grad, T == 1 (``ssd_decode``);
* mamba-ssm ``mamba_split_conv1d_scan_combined`` -- ``ops.ssd.split_conv1d_scan_combined`` (``ssd_split``; its
  causal-conv1d C++ op is a plain-torch stand-in written from ``csrc/causal_conv1d.cpp``, see ``_triton_interp.py``).

Each case counts the Triton kernel launches (it fails if the expected kernels did not launch, so a silent fallback
to the reference cannot pass) and checks every output and every gradient, initial states included: relative error
``max|fast - ref| / max|ref|`` at most 1e-5 in float32 and 6e-2 in bfloat16 (bf16 rounding of inputs and
intermediates: 2^-8 relative per rounding, accumulated over a few roundings).

What this tier proves: the argument order and keywords of every call (g vs beta, B vs C, ``dt_softplus``,
``use_qk_l2norm_in_kernel``, scale, group-to-head mapping), the layouts and state conventions (fla's (B, H, K, V)
states, the Canon state column padding, mamba-ssm's (B, H, P, N) states), dtype casts, strided and transposed
inputs, the decode dispatch (which kernel a no-grad short call takes), and every gradient canonlm relies on.
What it cannot prove: compiled-GPU behaviour (the interpreter is numpy: no TF32 ``tl.dot``, no races, no shared
memory limits), tile sizes beyond the first autotune config, the CUDA C++ kernels (flash-attn, Dao causal-conv1d;
the fused Mamba2 case runs causal-conv1d's C++ op as a plain-torch stand-in, see ``_triton_interp.py``), and speed.

The interpreter needs small test-only patches (``tests/_triton_interp.py``, one comment per limitation), and must be
switched on before triton is imported, so all cases run in one subprocess (about a minute on 2 cores) and each test
below reads its case's result. Needs the ``interp`` extra and mamba-ssm / causal-conv1d installed without their CUDA
builds (``bash scripts/setup.sh dev,interp`` does both; CI runs this tier).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NEEDED = ("triton", "fla", "mamba_ssm", "causal_conv1d")
MISSING = [m for m in NEEDED if importlib.util.find_spec(m) is None]
# CI must run this tier: there a missing package fails the tests instead of skipping them.
pytestmark = pytest.mark.skipif(
    bool(MISSING) and not os.environ.get("CI"), reason=f"needs {', '.join(MISSING)} (bash scripts/setup.sh dev,interp)"
)

TOL = {"fp32": 1e-5, "bf16": 6e-2}

# ----------------------------------------------------------------------------------------------------------------
# cases (run in the subprocess; each returns {"err": {name: rel. error}, "expect": [kernel names that must launch],
# "forbid": [kernel names that must not]})
# ----------------------------------------------------------------------------------------------------------------

CASES: dict = {}


def case(name, dtypes=("fp32", "bf16")):
    def register(fn):
        for dt in dtypes:
            CASES[f"{name}-{dt}"] = (fn, dt)
        return fn

    return register


def _torch():
    import torch

    return torch


def _dtype(dt):
    torch = _torch()
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare(fast_fn, ref_fn, inputs: dict, grad: bool, seed: int = 1) -> dict:
    """Run ``fast_fn(**inputs)`` and ``ref_fn(**inputs in float64)``; with ``grad``, back-propagate one random
    float64 cotangent per output through both and compare the gradients of every input tensor that requires one."""
    torch = _torch()
    fast_in = {
        k: (v.detach().clone().requires_grad_(grad and v.is_floating_point()) if torch.is_tensor(v) else v)
        for k, v in inputs.items()
    }
    ref_in = {
        k: (v.detach().double().requires_grad_(grad and v.is_floating_point()) if torch.is_tensor(v) else v)
        for k, v in inputs.items()
    }
    with torch.set_grad_enabled(grad):
        outs = fast_fn(**fast_in)
    with torch.set_grad_enabled(grad):
        refs = ref_fn(**ref_in)
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,))]
    refs = [r for r in (refs if isinstance(refs, (tuple, list)) else (refs,))]
    err = {}
    for i, (o, r) in enumerate(zip(outs, refs)):
        if o is None or r is None:
            assert o is None and r is None, f"output {i}: fast {o is None}, reference {r is None}"
            continue
        assert o.shape == r.shape, f"output {i}: shape {tuple(o.shape)} vs reference {tuple(r.shape)}"
        err[f"out{i}"] = rel(o, r)
    if grad:
        g = torch.Generator().manual_seed(seed)
        dys = [None if r is None else torch.randn(r.shape, generator=g, dtype=torch.float64) for r in refs]
        torch.autograd.backward(
            [o for o in outs if o is not None], [d.to(o.dtype) for o, d in zip(outs, dys) if o is not None]
        )
        torch.autograd.backward([r for r in refs if r is not None], [d for d in dys if d is not None])
        for k, v in fast_in.items():
            if torch.is_tensor(v) and v.requires_grad:
                assert v.grad is not None and ref_in[k].grad is not None, f"no gradient for {k}"
                err["d" + k] = rel(v.grad, ref_in[k].grad)
    return err


def _linear_inputs(dt, T, op, B=1, H=2, K=16, V=32, seed=0):
    """q, k (B, T, H, K) and v (B, T, H, V) in the case's dtype, a float32 log-decay g ((B, T, H, K) per key channel
    for GLA, (B, T, H) per head for GDN, with GDN's beta (B, T, H)) and a float32 initial state (B, H, K, V)."""
    torch = _torch()
    F = torch.nn.functional
    g = torch.Generator().manual_seed(seed)
    lo = _dtype(dt)
    r = lambda *s: torch.randn(*s, generator=g)
    out = dict(q=r(B, T, H, K).to(lo), k=r(B, T, H, K).to(lo), v=r(B, T, H, V).to(lo))
    if op == "gla":
        return dict(out, g=F.logsigmoid(r(B, T, H, K)) / 8, initial_state=r(B, H, K, V))
    return dict(out, g=F.logsigmoid(r(B, T, H)) / 4, beta=torch.sigmoid(r(B, T, H)), initial_state=r(B, H, K, V) / 4)


@case("gla_chunk")
def gla_chunk(dt):
    from canonlm.ops import gla

    err = compare(
        lambda **a: gla.chunk_gla(**a, output_final_state=True, backend="fla"),
        lambda **a: gla.chunk_gla_reference(**a, output_final_state=True),
        _linear_inputs(dt, 100, "gla"),
        grad=True,
    )
    return {
        "err": err,
        "expect": ["chunk_fwd_kernel_h", "chunk_gla_fwd_kernel_o", "chunk_bwd_kernel_dh", "chunk_gla_bwd_kernel_inter"],
        "forbid": ["fused_recurrent_fwd_kernel"],
    }


@case("gla_decode")
def gla_decode(dt):
    from canonlm.ops import gla

    err = {}
    for T in (1, 20):  # one decode step, and a short no-grad prefill
        e = compare(
            lambda **a: gla.chunk_gla(**a, output_final_state=True, backend="fla"),
            lambda **a: gla.chunk_gla_reference(**a, output_final_state=True),
            _linear_inputs(dt, T, "gla", seed=T),
            grad=False,
        )
        err.update({f"T{T}.{k}": v for k, v in e.items()})
    return {"err": err, "expect": ["fused_recurrent_fwd_kernel"], "forbid": ["chunk_fwd_kernel_h"]}


@case("gdn_chunk")
def gdn_chunk(dt):
    from canonlm.ops import gdn

    err = compare(
        lambda **a: gdn.chunk_gated_delta_rule(**a, output_final_state=True, backend="fla"),
        lambda **a: gdn.chunk_gated_delta_rule_reference(**a, output_final_state=True),
        _linear_inputs(dt, 100, "gdn"),
        grad=True,
    )
    return {
        "err": err,
        "expect": [
            "l2norm_fwd_kernel",
            "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
            "chunk_fwd_kernel_o",
            "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",
        ],
        "forbid": ["fused_recurrent_gated_delta_rule_fwd_kernel"],
    }


@case("gdn_decode")
def gdn_decode(dt):
    from canonlm.ops import gdn

    err = {}
    for T in (1, 20):
        e = compare(
            lambda **a: gdn.chunk_gated_delta_rule(**a, output_final_state=True, backend="fla"),
            lambda **a: gdn.chunk_gated_delta_rule_reference(**a, output_final_state=True),
            _linear_inputs(dt, T, "gdn", seed=T),
            grad=False,
        )
        err.update({f"T{T}.{k}": v for k, v in e.items()})
    return {
        "err": err,
        "expect": ["fused_recurrent_gated_delta_rule_fwd_kernel"],
        "forbid": ["chunk_gated_delta_rule_fwd_kernel_h_blockdim64"],
    }


def _canon_inputs(dt, T=40, B=2, C=24, K=4, seed=0, layout="contiguous", state=True, bias=True):
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    lo = _dtype(dt)
    r = lambda *s: torch.randn(*s, generator=g)
    if layout == "contiguous":
        x = r(B, T, C).to(lo)
    elif layout == "strided":  # a slice of a wider (B, T, 3C) activation, as Canon-B's q|k|v
        x = r(B, T, 3 * C).to(lo)[:, :, C : 2 * C]
    else:  # (B, C, T) memory seen as (B, T, C)
        x = r(B, C, T).to(lo).transpose(1, 2)
    return dict(
        x=x,
        weight=(torch.rand(C, K, generator=g) - 0.5),
        bias=r(C) if bias else None,
        initial_state=r(B, C, K - 1).to(lo) if state else None,
    )


def _canon_case(dt, residual, activation, **kw):
    from canonlm.ops import canon

    inputs = _canon_inputs(dt, **kw)
    if inputs["bias"] is None:
        inputs.pop("bias")
    if inputs["initial_state"] is None:
        inputs.pop("initial_state")
    x = inputs["x"]
    fast = lambda **a: canon.causal_conv1d(**a, residual=residual, activation=activation, backend="fla")
    ref = lambda **a: canon.causal_conv1d_reference(**a, residual=residual, activation=activation)
    err = compare(fast, ref, inputs, grad=True)
    expect = ["causal_conv1d_fwd_kernel", "causal_conv1d_bwd_kernel"]
    if "initial_state" in inputs:  # d(initial_state) has its own kernel
        expect.append("compute_dh0_kernel")
    return {"err": err, "expect": expect, "forbid": [], "x_contiguous": x.is_contiguous()}


@case("canon_residual_state")
def canon_residual_state(dt):
    out = _canon_case(dt, residual=True, activation=False)
    out.pop("x_contiguous")
    return out


@case("canon_silu_nores")
def canon_silu_nores(dt):
    out = _canon_case(dt, residual=False, activation=True, bias=False)
    out.pop("x_contiguous")
    return out


@case("canon_strided")
def canon_strided(dt):
    out = _canon_case(dt, residual=True, activation=True, layout="strided")
    assert not out.pop("x_contiguous")
    return out


@case("canon_transposed")
def canon_transposed(dt):
    out = _canon_case(dt, residual=True, activation=False, layout="transposed", state=False)
    assert not out.pop("x_contiguous")
    return out


@case("canon_step")
def canon_step(dt):
    torch = _torch()
    from canonlm.ops import canon

    g = torch.Generator().manual_seed(3)
    lo = _dtype(dt)
    B, C, K = 2, 24, 4
    err = {}
    for residual, act in ((True, False), (False, True)):
        inputs = dict(
            x_t=torch.randn(B, C, generator=g).to(lo),
            state=torch.randn(B, C, K, generator=g).to(lo),
            weight=torch.rand(C, K, generator=g) - 0.5,
            bias=torch.randn(C, generator=g),
        )

        def ref(x_t, state, weight, bias):  # decode step = the last position of the convolution over the window
            win = torch.cat([state[:, :, 1:], x_t.unsqueeze(-1)], -1).transpose(1, 2)  # (B, K, C)
            y = canon.causal_conv1d_reference(win, weight, bias, residual=residual, activation=act)[:, -1]
            return y, win.transpose(1, 2)

        e = compare(
            lambda **a: canon.causal_conv1d_step(**a, residual=residual, activation=act, backend="fla"),
            ref,
            inputs,
            grad=False,
        )
        err.update({f"res={residual},silu={act}.{k}": v for k, v in e.items()})
    return {"err": err, "expect": ["causal_conv1d_update_kernel"], "forbid": []}


def _ssd_inputs(dt, T, B=1, H=4, P=16, G=2, N=16, seed=0):
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    lo = _dtype(dt)
    r = lambda *s: torch.randn(*s, generator=g)
    return dict(
        x=r(B, T, H, P).to(lo),
        dt=r(B, T, H) - 1,
        A=-torch.rand(H, generator=g) - 0.5,
        B=r(B, T, G, N).to(lo),
        C=r(B, T, G, N).to(lo),
        D=r(H),
        dt_bias=r(H) / 2,
        initial_state=r(B, H, P, N) / 4,
    )


@case("ssd_chunk")
def ssd_chunk(dt):
    from canonlm.ops import ssd

    err = compare(
        lambda **a: ssd.ssd_scan(**a, chunk_size=16, output_final_state=True, backend="mamba_ssm"),
        lambda **a: ssd.ssd_scan_reference(**a, chunk_size=16, output_final_state=True),
        _ssd_inputs(dt, T=40),
        grad=True,
    )  # 3 chunks, the last one partial
    return {
        "err": err,
        "expect": [
            "_chunk_cumsum_fwd_kernel",
            "_state_passing_fwd_kernel",
            "_chunk_scan_fwd_kernel",
            "_chunk_scan_chunk_state_bwd_dx_kernel",
            "_state_passing_bwd_kernel",
        ],
        "forbid": ["_selective_scan_update_kernel"],
    }


@case("ssd_decode")
def ssd_decode(dt):
    from canonlm.ops import ssd

    err = compare(
        lambda **a: ssd.ssd_scan(**a, chunk_size=32, output_final_state=True, backend="mamba_ssm"),
        lambda **a: ssd.ssd_scan_reference(**a, chunk_size=32, output_final_state=True),
        _ssd_inputs(dt, T=1),
        grad=False,
    )
    return {"err": err, "expect": ["_selective_scan_update_kernel"], "forbid": ["_chunk_scan_fwd_kernel"]}


@case("ssd_split")
def ssd_split(dt):
    torch = _torch()
    from canonlm.ops import ssd

    g = torch.Generator().manual_seed(5)
    lo = _dtype(dt)
    B, T, H, P, G, N, W = 1, 70, 4, 16, 2, 16, 4
    d_inner, conv_dim = H * P, H * P + 2 * G * N
    r = lambda *s: torch.randn(*s, generator=g)
    inputs = dict(
        zxbcdt=r(B, T, 2 * d_inner + 2 * G * N + H).to(lo),
        conv_weight=(torch.rand(conv_dim, W, generator=g) - 0.5),
        conv_bias=r(conv_dim) / 4,
        dt_bias=r(H) / 2,
        A=-torch.rand(H, generator=g) - 0.5,
        D=r(H),
        rmsnorm_weight=1 + r(d_inner) / 4,
        outproj_weight=r(32, d_inner) / 8,
    )
    # Under bf16 autocast mamba-ssm casts the out-projection weight to the autocast dtype itself
    # (MambaSplitConv1dScanCombinedFn.forward: torch.is_autocast_enabled(), CUDA autocast only); here it comes in bf16.
    inputs["outproj_weight"] = inputs["outproj_weight"].to(lo)
    kw = dict(chunk_size=32, activation="silu", rmsnorm_eps=1e-5, headdim=P, ngroups=G, norm_before_gate=False)
    err = compare(
        lambda **a: ssd.split_conv1d_scan_combined(**a, **kw),
        lambda **a: ssd.split_conv1d_scan_reference(**a, **kw),
        inputs,
        grad=True,
    )
    return {
        "err": err,
        "expect": [
            "_chunk_scan_fwd_kernel",
            "_layer_norm_fwd_1pass_kernel",
            "_layer_norm_bwd_kernel",
            "_chunk_scan_chunk_state_bwd_dx_kernel",
        ],
        "forbid": [],
    }


def _run_all(names=None) -> dict:
    """Subprocess entry: run the cases (all, or ``names``) with the interpreter harness enabled."""
    import _triton_interp

    launches = _triton_interp.enable()
    import torch
    import triton

    torch.manual_seed(0)
    out = {"triton": triton.__version__, "cases": {}}
    for name, (fn, dt) in CASES.items():
        if names and name not in names:
            continue
        launches.clear()
        t0 = time.perf_counter()
        try:
            res = fn(dt)
        except Exception:  # noqa: BLE001 -- a failing case is recorded with its traceback
            res = {"error": traceback.format_exc(limit=8)}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        res["launches"] = dict(launches)
        out["cases"][name] = res
        print(f"{name}: {res['seconds']} s", file=sys.stderr, flush=True)
    return out


def _run_without_selective_scan() -> dict:
    """Subprocess entry: a mamba-ssm installed without its CUDA extension (``MAMBA_SKIP_CUDA_BUILD``, as
    scripts/wheelhouse.sh builds it), i.e. ``selective_scan_cuda`` absent, so ``import mamba_ssm`` fails in its
    ``__init__``. canonlm's ``ssd=auto`` must still resolve to mamba-ssm's Triton SSD (imported without the package
    ``__init__``, canonlm.ops.ssd._mamba.import_triton_module) and run it: the chunked scan with grad and the decode
    step, against the reference."""
    import _triton_interp

    launches = _triton_interp.enable(stub_selective_scan=False)
    try:
        import mamba_ssm  # noqa: F401 -- the precondition: this must fail, as on such a node

        package = "imported"
    except ImportError as e:
        package = f"{type(e).__name__}: {e}"
    torch = _torch()
    from canonlm.ops import ssd
    from canonlm.ops.ssd import _mamba

    out = {"package_import": package, "resolved": ssd.resolve_backend("auto", torch.device("cpu"), torch.float32)}
    launches.clear()
    out["err"] = compare(
        lambda **a: ssd.ssd_scan(**a, chunk_size=16, output_final_state=True, backend="auto"),
        lambda **a: ssd.ssd_scan_reference(**a, chunk_size=16, output_final_state=True),
        _ssd_inputs("fp32", T=40),
        grad=True,
    )
    out["chunk_launches"] = dict(launches)
    launches.clear()
    out["err"].update(
        {
            f"decode.{k}": v
            for k, v in compare(
                lambda **a: ssd.ssd_scan(**a, chunk_size=16, output_final_state=True, backend="auto"),
                lambda **a: ssd.ssd_scan_reference(**a, chunk_size=16, output_final_state=True),
                _ssd_inputs("fp32", T=1),
                grad=False,
            ).items()
        }
    )
    out["decode_launches"] = dict(launches)
    out["problem"] = _mamba.package_problem()
    from canonlm.arch import CanonLM, build_model_config  # what a run prints and records about it

    model = CanonLM(
        build_model_config({"arch": "mamba2", "size": "1L64D"}, canon={"set": "AbCD"}, vocab_size=32, max_seq_len=64)
    )
    model.place(torch.device("cpu"), torch.float32)
    out["report"] = model.backend_report()
    return out


# ----------------------------------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interp_results():
    from _triton_interp import run_in_subprocess

    return run_in_subprocess("test_triton_interpret", "_run_all", timeout=1500)


def problems(name: str, r: dict) -> list:
    """What is wrong with case ``name``'s result ``r`` (empty when it passes): an exception, no launch, an expected
    kernel that did not launch or a forbidden one that did, an error above the dtype's tolerance (NaN included)."""
    if "error" in r:
        return [f"raised:\n{r['error']}"]
    launched, out = r["launches"], []
    if sum(launched.values()) == 0:
        out.append("no Triton kernel launched (fell back to a reference?)")
    out += [f"kernel {k} did not launch; launched: {launched}" for k in r["expect"] if launched.get(k, 0) == 0]
    out += [f"kernel {k} launched on this path; launched: {launched}" for k in r["forbid"] if launched.get(k, 0)]
    tol = TOL[name.rsplit("-", 1)[1]]
    bad = {k: v for k, v in r["err"].items() if not (v <= tol)}
    if bad or not r["err"]:
        out.append(f"relative error above {tol}: {bad} (all: {r['err']})")
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_triton_call_site(interp_results, name):
    bad = problems(name, interp_results["cases"][name])
    assert not bad, f"{name} (triton {interp_results['triton']}): " + "; ".join(bad)


def test_mamba_ssm_without_its_cuda_extension_still_runs_the_triton_ssd():
    """A mamba-ssm whose ``import mamba_ssm`` fails for the missing ``selective_scan_cuda`` (built with
    ``MAMBA_SKIP_CUDA_BUILD``): ``ssd=auto`` resolves to ``mamba_ssm``, its chunked scan (with gradients) and decode
    step launch their Triton kernels and match the reference, and the reason is kept for the backend report."""
    from _triton_interp import run_in_subprocess

    res = run_in_subprocess("test_triton_interpret", "_run_without_selective_scan")
    assert res["package_import"].startswith("ModuleNotFoundError") and "selective_scan_cuda" in res["package_import"]
    assert res["resolved"] == "mamba_ssm", res
    assert res["chunk_launches"].get("_chunk_scan_fwd_kernel") and res["chunk_launches"].get(
        "_chunk_scan_chunk_state_bwd_dx_kernel"
    ), res
    assert res["decode_launches"].get("_selective_scan_update_kernel"), res
    assert "selective_scan_cuda" in (res["problem"] or ""), res
    assert (
        res["report"]["ssd"] == "mamba_ssm"
        and "without the mamba_ssm package __init__" in res["report"]["notes"]["ssd"]
        and "selective_scan_cuda" in res["report"]["notes"]["ssd"]
    ), res["report"]
    assert res["err"] and max(res["err"].values()) <= TOL["fp32"], res


def test_mutation_lines_still_exist():
    """scripts/interp_mutations.py (the tier's mutation check) mutates exact lines of the fast-path wrappers; each must
    still be in its file exactly once, or the mutation table would silently test nothing."""
    sys.path.insert(0, str(HERE.parent / "scripts"))
    import interp_mutations

    src = HERE.parent / "src" / "canonlm"
    missing = [
        name
        for name, (path, old, *_rest) in interp_mutations.MUTATIONS.items()
        if (src / path).read_text().count(old) != 1
    ]
    assert len(interp_mutations.MUTATIONS) >= 5 and not missing, missing


if __name__ == "__main__":  # python tests/test_triton_interpret.py [case ...]: print the table of cases
    sys.path.insert(0, str(HERE))
    res = _run_all(sys.argv[1:])
    print(json.dumps(res, indent=1))
