"""Canon backends are resolved per Canon layer shape when the model is placed (``CanonLM.place``): ``ops=fused``
(or ``kernels.canon=fused``) gives a layer Dao's ``causal_conv1d_fn`` where that kernel takes its channels C and taps
K and fla's Triton ``causal_conv1d`` elsewhere; a pinned ``kernels.canon=dao`` that cannot take some layer is one
ConfigError at place(), naming the key, the value and that layer; the forward and the decode steps then run what was
resolved, for every Canon layer (A, B, C, D and the linear mixers' short convs ``b``) of every architecture.

"CUDA" is faked as in tests/test_backend_contract.py (``torch.cuda.is_available`` returns True and the libraries'
import probes return stand-ins), so the real resolver runs with its real device, dtype and shape rules while no tensor
goes to a GPU. The stand-in for ``causal_conv1d_fn`` / ``causal_conv1d_update`` fails like the C++ op (below), so a
layer handed to Dao with a shape it refuses fails here as it would at the first forward on a GPU.

Oracle: the limits re-derived from causal-conv1d's C++ source (v1.6.1, ``csrc/causal_conv1d.cpp``; the same checks in
every release of the ``causal-conv1d>=1.5.1,<1.7`` pin), ``causal_conv1d_fwd`` lines 175-182 (again in ``_bwd``)::

    TORCH_CHECK(x.stride(2) == 1 || x.stride(1) == 1);
    const bool is_channel_last = x.stride(1) == 1 && x.stride(2) > 1;
    if (is_channel_last) {
        TORCH_CHECK(dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now");
        TORCH_CHECK(x.stride(2) % 8 == 0 && x.stride(0) % 8 == 0, "causal_conv1d with channel last layout requires
                    strides (x.stride(0) and x.stride(2)) to be multiples of 8");
    }
    TORCH_CHECK(width >= 2 && width <= 4, "causal_conv1d only supports width between 2 and 4");

and ``causal_conv1d_update`` line 496: ``TORCH_CHECK(width >= 2 && width <= 4, ...)``. canonlm hands Dao the
channel-last view of x (B, T, C) (stride(1) == 1), where ``dim`` is C. fla-core 0.6.0's
``fla/modules/causal_conv1d/ops.py`` (``causal_conv1d_fwd``, ``causal_conv1d_update``) checks neither D nor W.
"""

from __future__ import annotations

import pytest
import torch

from canonlm.arch import CanonLM, ConfigError, build_model_config
from canonlm.arch.canon import Canon
from canonlm.ops import _dispatch
from canonlm.ops import canon as canon_ops
from canonlm.ops.canon import _native
from canonlm.ops.canon.naive import canon_loop

CUDA = torch.device("cuda")

pytestmark = pytest.mark.filterwarnings("ignore:canonlm. Canon-B in:UserWarning")


def dao_takes(C: int, K: int) -> bool:
    """The C++ checks quoted in the module docstring, for canonlm's channel-last call."""
    return C % 8 == 0 and 2 <= K <= 4


def expected_fused(C: int, K: int) -> str:
    return "dao" if dao_takes(C, K) else "fla"


# ------------------------------------------------------------------------------------------------ library stand-ins
calls: list[tuple[str, int]] = []  # (kernel, C) of every stand-in call


def fake_dao_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """``causal_conv1d_fn`` (x (B, C, T)) with the C++ op's shape checks; computed by the plain loop."""
    B, C, T = x.shape
    if x.stride(1) == 1 and x.stride(2) > 1:
        if C % 8 != 0:
            raise RuntimeError("causal_conv1d only supports channel dimension divisible by 8 for now")
        if x.stride(2) % 8 != 0 or x.stride(0) % 8 != 0:
            raise RuntimeError("causal_conv1d with channel last layout requires strides to be multiples of 8")
    if not 2 <= weight.shape[-1] <= 4:
        raise RuntimeError("causal_conv1d only supports width between 2 and 4")
    calls.append(("dao", C))
    y = canon_loop(
        x.transpose(1, 2), weight, bias, residual=False, activation=activation == "silu", init=initial_states
    )
    return y.transpose(1, 2)


def _roll_in(x, state, weight, bias, activation):
    state.copy_(torch.cat([state[:, :, 1:], x.unsqueeze(-1)], -1))
    z = (state * weight).sum(-1) + (bias if bias is not None else 0)
    return z * torch.sigmoid(z) if activation == "silu" else z


def fake_dao_update(x, conv_state, weight, bias=None, activation=None):
    """``causal_conv1d_update``: x (B, C), conv_state (B, C, K) updated in place; width checked like the C++ op."""
    if not 2 <= weight.shape[-1] <= 4:
        raise RuntimeError("causal_conv1d only supports width between 2 and 4")
    calls.append(("dao_update", x.shape[1]))
    return _roll_in(x, conv_state, weight, bias, activation)


def fake_fla_fn(
    x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False, activation=None, **kw
):
    """fla's ``causal_conv1d`` (x (B, T, D), state (N, D, W) with column 0 unused): no shape limit."""
    calls.append(("fla", x.shape[-1]))
    hist = None if initial_state is None else initial_state[:, :, 1:]
    y = canon_loop(x, weight, bias, residual=False, activation=activation in ("silu", "swish"), init=hist)
    return (y + residual if residual is not None else y), None


def fake_fla_update(x, cache, residual=None, weight=None, bias=None, activation=None):
    calls.append(("fla_update", x.shape[-1]))
    y = _roll_in(x, cache, weight, bias, activation)
    return (y + residual if residual is not None else y), cache


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available', both Canon libraries 'importable' (the stand-ins above); fresh dispatch memo."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(_dispatch._probes, "canon.dao", ((fake_dao_fn, fake_dao_update), None))
    monkeypatch.setitem(_dispatch._probes, "canon.fla", ((fake_fla_fn, fake_fla_update), None))
    monkeypatch.setattr(canon_ops, "_select_cache", {})
    calls.clear()


# ------------------------------------------------------------------------------------------------ models
# d_model = 60 (not a multiple of 8): Canon-A/C and most short convs have C % 8 != 0, Canon-D (and Mamba2's conv1d)
# have C % 8 == 0. Canon kernel 5: every Canon-A/B/C/D layer is outside Dao's widths, the short convs ``b`` keep K = 4.
ARCHS = {
    "llama": ({"n_heads": 2}, "ABCD"),
    "gla": ({"n_heads": 2}, "ABbCD"),
    "gdn": ({"n_heads": 2, "ffn_ratio": 2.0}, "ABbCD"),
    "mamba2": ({"n_heads": 4, "ffn_ratio": 2.0}, "ABbCD"),
}
SHAPES = {"d60": (60, 4), "k5": (64, 5)}  # (d_model, Canon kernel)


def model_cfg(arch: str, shape: str, request: str, d_model: int | None = None):
    """A 1-layer ``arch`` with every Canon site. ``request`` goes to ``ops`` (llama ``auto`` / ``fused``; attention
    ``fused`` = SDPA) or is pinned as ``kernels.canon`` (linear archs keep their mixer on the reference: no mixer
    library is faked)."""
    kw, sites = ARCHS[arch]
    d, K = SHAPES[shape]
    if arch == "llama" and request in ("auto", "fused"):
        req = {"ops": request}
    else:
        req = {"ops": "auto" if arch == "llama" else "reference", "kernels": {"canon": request}}
    return build_model_config(
        {"arch": arch, "n_layers": 1, "d_model": d_model or d, **kw},
        canon={"set": sites, "kernel": K},
        vocab_size=16,
        max_seq_len=32,
        **req,
    )


def canon_layers(model) -> dict[str, Canon]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Canon)}


def sites_of(names) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n in names}


# ------------------------------------------------------------------------------------------------ fused
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_resolves_each_canon_layer_by_its_shape(fake_cuda, arch, shape):
    model = CanonLM(model_cfg(arch, shape, "fused"))
    layers = canon_layers(model)
    want_sites = {"canon_a", "canon_b", "canon_c", "canon_d"}
    want_sites |= set() if arch == "llama" else ({"conv1d"} if arch == "mamba2" else {"conv_q", "conv_k", "conv_v"})
    assert sites_of(layers) == want_sites  # every Canon layer of the architecture is in the test
    expected = {n: expected_fused(m.channels, m.kernel) for n, m in layers.items()}
    # Llama with kernel 5 has no layer Dao takes; every other model has both kinds (the check is not vacuous)
    report = "fla" if (arch, shape) == ("llama", "k5") else "dao+fla"
    assert "+".join(sorted(set(expected.values()))) == report
    for dtype in (torch.bfloat16, torch.float32):
        got = model.place(CUDA, dtype)
        assert got["canon"] == report and model.backends == got
        assert model.canon_backends == expected
        assert {n: m.backend for n, m in layers.items()} == expected
        for m in layers.values():  # what the forward and the decode step dispatch to for these modules
            be = expected_fused(m.channels, m.kernel)
            assert canon_ops._select(m.backend, "cuda", dtype, m.channels, m.kernel) == be
            assert canon_ops._select_step(m.backend, "cuda", dtype, m.channels, m.kernel) == be


@pytest.mark.parametrize("arch", list(ARCHS))
def test_auto_reports_the_same_per_layer_rule(fake_cuda, arch):
    """``auto`` modules stay ``auto`` (they follow the tensors' device); place() reports per layer what the forward
    and decode dispatch will pick on CUDA for that shape: the same rule."""
    model = CanonLM(model_cfg(arch, "d60", "auto"))
    assert model.place(CUDA, torch.bfloat16)["canon"] == "dao+fla"
    layers = canon_layers(model)
    assert {m.backend for m in layers.values()} == {"auto"}
    assert model.canon_backends == {n: expected_fused(m.channels, m.kernel) for n, m in layers.items()}
    for m in layers.values():
        be = expected_fused(m.channels, m.kernel)
        assert canon_ops._select("auto", "cuda", torch.bfloat16, m.channels, m.kernel) == be
        assert canon_ops._select_step("auto", "cuda", torch.bfloat16, m.channels, m.kernel) == be


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_forward_and_decode_run_what_place_resolved(fake_cuda, monkeypatch, arch):
    """Every Canon layer of a placed ``fused`` model, called like the model calls it (a forward, then a cached
    prefill and one-token decode steps), reaches the kernel place() chose -- Dao's stand-in, which fails like the C++
    op on a shape it refuses, or fla's -- and gives the plain-loop result. CPU tensors stand in for CUDA ones by
    making ``cuda_reason`` accept them; the resolution was done for CUDA by place()."""
    model = CanonLM(model_cfg(arch, "d60", "fused"))
    model.place(CUDA, torch.float32)
    monkeypatch.setattr(canon_ops, "cuda_reason", lambda device: None)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, m in canon_layers(model).items():
            be = expected_fused(m.channels, m.kernel)
            x = torch.randn(2, 7, m.channels, generator=g)
            want = canon_loop(x, m.weight, m.bias, residual=m.residual, activation=m.activation)
            calls.clear()
            torch.testing.assert_close(m(x), want)
            cache: dict = {}
            parts = [m(x[:, :5], cache)] + [m(x[:, t : t + 1], cache) for t in (5, 6)]
            torch.testing.assert_close(torch.cat(parts, 1), want)
            assert calls == [(be, m.channels)] * 2 + [(be + "_update", m.channels)] * 2, name


def test_fused_without_fla_refuses_a_shape_dao_cannot_take(fake_cuda, monkeypatch):
    """No fla: a layer Dao cannot take would run plain torch, which ``fused`` refuses -- at place(), naming it."""
    monkeypatch.setitem(_dispatch._probes, "canon.fla", (None, "ImportError: No module named 'fla'"))
    model = CanonLM(model_cfg("llama", "d60", "fused"))
    with pytest.raises(ConfigError) as e:
        model.place(CUDA, torch.bfloat16)
    assert (e.value.key, e.value.value) == ("model.ops", "fused")
    assert "blocks.0.canon_a: C=60, K=4" in e.value.allowed and "dao" in e.value.allowed
    ok = CanonLM(model_cfg("llama", "d60", "fused", d_model=64))  # every shape Dao takes: fla is not needed
    assert ok.place(CUDA, torch.bfloat16) == {"canon": "dao", "attention": "sdpa"}
    assert set(ok.canon_backends.values()) == {"dao"}


# ------------------------------------------------------------------------------------------------ pinned dao
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_pinned_dao_is_refused_at_place_for_a_shape_it_cannot_take(fake_cuda, arch, shape):
    model = CanonLM(model_cfg(arch, shape, "dao"))  # built on the CPU: dao is pending until placed
    layers = canon_layers(model)
    before = ({n: m.backend for n, m in layers.items()}, model.placement, dict(model.pending))
    first_bad = next((n, m) for n, m in layers.items() if not dao_takes(m.channels, m.kernel))
    with pytest.raises(ConfigError) as e:
        model.place(CUDA, torch.bfloat16)
    assert (e.value.key, e.value.value) == ("model.kernels.canon", "dao")
    name, m = first_bad
    assert f"[Canon layer {name}: C={m.channels}, K={m.kernel}]" in e.value.allowed
    assert "fla" in e.value.allowed.split("[")[0]  # what runs there instead
    reason = "K in (2, 3, 4)" if m.kernel == 5 else "C % 8 == 0"
    assert reason in e.value.allowed
    assert ({n: m.backend for n, m in layers.items()}, model.placement, dict(model.pending)) == before
    with pytest.raises(ConfigError) as e2:  # a forward is refused before any kernel work
        model(torch.zeros(1, 4, dtype=torch.long))
    assert e2.value.key == "model.kernels.canon"


def test_pinned_dao_is_placed_where_every_layer_fits(fake_cuda):
    model = CanonLM(model_cfg("llama", "d60", "dao", d_model=64))
    assert model.place(CUDA, torch.bfloat16)["canon"] == "dao" and not model.pending
    assert {m.backend for m in canon_layers(model).values()} == {"dao"}
    assert set(model.canon_backends.values()) == {"dao"}


def test_decode_step_refuses_a_pinned_dao_shape_like_the_forward(fake_cuda, monkeypatch):
    """The op-level rule on its own: ``causal_conv1d`` and ``causal_conv1d_step`` refuse ``backend="dao"`` for
    C % 8 != 0 or K = 5 with the same ConfigError (Dao's update kernel would take C = 60; the step follows the layer's
    forward), and ``auto`` picks fla for both."""
    monkeypatch.setattr(canon_ops, "cuda_reason", lambda device: None)
    for C, K in ((60, 4), (64, 5)):
        x, w, state = torch.randn(2, 3, C), torch.randn(C, K), torch.randn(2, C, K)
        for call in (
            lambda: canon_ops.causal_conv1d(x, w, backend="dao"),
            lambda: canon_ops.causal_conv1d_step(x[:, 0], state, w, backend="dao"),
        ):
            with pytest.raises(ConfigError) as e:
                call()
            assert (e.value.key, e.value.value) == ("model.kernels.canon", "dao") and f"C={C}, K={K}" in str(e.value)
        assert canon_ops._select_step("auto", "cuda", torch.float32, C, K) == "fla"
    assert not calls  # refused before any kernel was called
    assert canon_ops._select_step("auto", "cuda", torch.float32, 64, 4) == "dao"


# ------------------------------------------------------------------------------------------------ CPU, no fakes
@pytest.mark.skipif(not _native.available(), reason="native CPU Canon kernel does not build here")
def test_cpu_kernel_limit_is_checked_at_place_too():
    """The same per-layer rule on the real CPU kernel (K <= 64, ``CANON_KMAX`` in csrc/canon_cpu.c): a pinned ``cpu``
    or ``fused`` with Canon kernel 65 is refused at construction / place(), not at the first forward; ``auto`` runs
    the 65-tap layers with the torch path and the 4-tap short convs with the native kernel."""
    cfg = lambda req: build_model_config(
        {"arch": "gla", "n_layers": 1, "d_model": 32, "n_heads": 2},
        canon={"set": "AbCD", "kernel": _native.KMAX + 1},
        vocab_size=16,
        max_seq_len=32,
        ops="reference",
        kernels={"canon": req},
    )
    for req in ("cpu", "fused"):
        model = CanonLM(cfg(req))
        assert set(model.pending) == {"canon"}
        with pytest.raises(ConfigError) as e:
            model.place("cpu", torch.float32)
        assert e.value.key == "model.kernels.canon" and f"K={_native.KMAX + 1}" in e.value.allowed
    model = CanonLM(cfg("auto"))
    assert model.place("cpu", torch.float32)["canon"] == "cpu+torch"
    assert {n.rsplit(".", 1)[-1]: b for n, b in model.canon_backends.items()} == {
        "canon_a": "torch",
        "conv_q": "cpu",
        "conv_k": "cpu",
        "conv_v": "cpu",
        "canon_c": "torch",
        "canon_d": "torch",
    }
    model(torch.zeros(1, 4, dtype=torch.long))


# ------------------------------------------------------------------------------------------------ compiled
@pytest.mark.parametrize("arch", list(ARCHS))
def test_compiled_auto_runs_every_canon_layer_on_the_torch_path(fake_cuda, arch):
    """``place(..., compiled=True)`` on CUDA: an ``auto`` request puts every Canon layer (and short conv) on the
    ``torch`` shift-and-add path that inductor can fuse (fla's dispatch is a graph break); the modules carry it, so the
    forward and the decode step dispatch to it too. Uncompiled, the same model gets the kernels again."""
    model = CanonLM(model_cfg(arch, "d60", "auto"))
    layers = canon_layers(model)
    assert model.place(CUDA, torch.bfloat16, compiled=True)["canon"] == "torch"
    assert set(model.canon_backends.values()) == {"torch"} and model.canon_backends.keys() == layers.keys()
    for m in layers.values():
        assert m.backend == "torch"
        assert canon_ops._select(m.backend, "cuda", torch.bfloat16, m.channels, m.kernel) == "torch"
        assert canon_ops._select_step(m.backend, "cuda", torch.bfloat16, m.channels, m.kernel) == "torch"
    assert model.place(CUDA, torch.bfloat16)["canon"] == "dao+fla"
    assert {m.backend for m in layers.values()} == {"auto"}


@pytest.mark.parametrize("request_", ["fused", "fla"])
def test_compiled_keeps_a_pinned_or_fused_kernel(fake_cuda, request_):
    """A kernel the user asked for by name (``kernels.canon=fla``) or ``ops=fused`` is kept under compile."""
    model = CanonLM(model_cfg("llama", "d60", request_))
    got = model.place(CUDA, torch.bfloat16, compiled=True)["canon"]
    assert got == ("dao+fla" if request_ == "fused" else "fla")


def test_compiled_auto_on_cpu_keeps_the_cpu_choice():
    """On the CPU, compiled or not, ``auto`` keeps its CPU choice (the native kernel is a custom op, no graph break)."""
    model = CanonLM(model_cfg("llama", "d60", "auto"))
    assert model.place("cpu", torch.float32, compiled=True) == model.place("cpu", torch.float32)
