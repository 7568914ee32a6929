"""CPU tests of the CUDA fast paths' compatibility checks, with fake library modules written from the libraries'
source (no GPU, no CUDA library needed):

* Mamba2's fused path (``canonlm.ops.ssd.use_fused_split`` / ``check_fused_split``): what each mamba-ssm release's
  ``mamba_ssm/ops/triton/ssd_combined.py`` binds from causal-conv1d, against what each causal-conv1d release exports
  (``causal_conv1d/cpp_functions.py`` from 1.5.1; the pybind11 ops of ``csrc/causal_conv1d.cpp``: fwd 7 / bwd 10
  arguments up to 1.5.0.post8, 8 / 12 from 1.5.1), and the xBC channel layout causal-conv1d's channel-last kernel
  needs;
* the Dao Canon path (``canonlm.ops.canon._cuda.dao_forward``): copies x / initial_state only when the strides or
  alignment causal-conv1d's channel-last kernel checks require it;
* flash-attn's limits at resolution (``canonlm.ops.attention.resolve_backend(..., head_dim)``).
"""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

from canonlm.errors import ConfigError
from canonlm.ops import _dispatch
from canonlm.ops import attention as attn
from canonlm.ops import ssd
from canonlm.ops.canon import _cuda as canon_cuda
from canonlm.ops.canon import causal_conv1d_reference
from canonlm.ops.ssd import _mamba

# ----------------------------------------------------------------------------------------------------------------
# fakes of causal-conv1d and mamba-ssm, by release
# ----------------------------------------------------------------------------------------------------------------


class PybindFn:
    """A pybind11 function: ``inspect.signature`` fails on it, the signature is the first line of ``__doc__`` (the
    causal-conv1d ops are bound with ``m.def(name, &fn, doc)``, so their arguments are ``arg0 .. argN``)."""

    def __init__(self, name: str, arg_types: list[str], ret: str, doc: str):
        self.__name__ = name
        args = ", ".join(f"arg{i}: {t}" for i, t in enumerate(arg_types))
        self.__doc__ = f"{name}({args}) -> {ret}\n\n{doc}\n"
        self.calls = []

    @property
    def __signature__(self):
        raise ValueError(f"no signature found for builtin {self.__name__}")

    def __call__(self, *args):
        if len(args) != self.__doc__.split("\n")[0].count("arg"):
            raise TypeError(f"{self.__name__}(): incompatible function arguments")
        self.calls.append(args)


T_, OPT = "torch.Tensor", "Optional[torch.Tensor]"
# csrc/causal_conv1d.cpp, causal-conv1d 1.4.0 - 1.5.0.post8: fwd(x, weight, bias_, seq_idx_, initial_states_,
# final_states_out_, silu_activation) -> Tensor; bwd(x, weight, bias_, dout, seq_idx_, initial_states_,
# dfinal_states_, dx_, return_dinitial_states, silu_activation) -> list[Tensor]
CPP_OLD = dict(
    fwd=([T_, T_, OPT, OPT, OPT, OPT, "bool"], T_),
    bwd=([T_, T_, OPT, T_, OPT, OPT, OPT, OPT, "bool", "bool"], "list[torch.Tensor]"),
)
# causal-conv1d >= 1.5.1: fwd(x, weight, bias_, seq_idx_, initial_states_, out, final_states_out_, silu_activation)
# -> void; bwd(x, weight, bias_, dout, seq_idx_, initial_states_, dfinal_states_, dx, dweight, dbias_,
# dinitial_states_, silu_activation) -> void
CPP_NEW = dict(
    fwd=([T_, T_, OPT, OPT, OPT, T_, OPT, "bool"], "None"),
    bwd=([T_, T_, OPT, T_, OPT, OPT, OPT, T_, T_, OPT, OPT, "bool"], "None"),
)


def fake_causal_conv1d(version: str) -> dict[str, types.ModuleType]:
    """sys.modules entries of causal-conv1d ``version`` ('1.5.0.post8' or '1.5.1' / '1.6.1')."""
    new = version not in ("1.4.0", "1.5.0", "1.5.0.post8")
    spec = CPP_NEW if new else CPP_OLD
    ext = types.ModuleType("causal_conv1d_cuda")
    ext.causal_conv1d_fwd = PybindFn("causal_conv1d_fwd", *spec["fwd"], "Causal conv1d forward")
    ext.causal_conv1d_bwd = PybindFn("causal_conv1d_bwd", *spec["bwd"], "Causal conv1d backward")
    pkg = types.ModuleType("causal_conv1d")
    pkg.__version__ = version
    pkg.causal_conv1d_fn = (
        lambda x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None: None
    )
    mods = {"causal_conv1d": pkg, "causal_conv1d_cuda": ext}
    if new:
        cpp = types.ModuleType("causal_conv1d.cpp_functions")

        def causal_conv1d_fwd_function(x, weight, bias, seq_idx, initial_states, final_states_out, silu_activation):
            out = torch.empty_like(x)
            ext.causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, out, final_states_out, silu_activation)
            return out

        def causal_conv1d_bwd_function(
            x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, return_dinitial_states, silu_activation
        ):
            return dx, None, None, None

        cpp.causal_conv1d_fwd_function = causal_conv1d_fwd_function
        cpp.causal_conv1d_bwd_function = causal_conv1d_bwd_function
        cpp.causal_conv1d_update_function = (
            lambda x, conv_state, weight, bias, silu_activation, cache_seqlens, conv_state_indices: None
        )
        pkg.__path__ = []  # a package, so `causal_conv1d.cpp_functions` resolves
        pkg.cpp_functions = cpp
        mods["causal_conv1d.cpp_functions"] = cpp
    return mods


def fake_ssd_combined(mamba: str, cc_mods: dict) -> types.ModuleType:
    """``mamba_ssm.ops.triton.ssd_combined`` of mamba-ssm ``mamba`` as imported next to ``cc_mods`` (its module-level
    ``try: from causal_conv1d... except ImportError: ... = None``)."""
    mod = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    mod.mamba_chunk_scan_combined = lambda *a, **k: None
    mod.mamba_split_conv1d_scan_combined = lambda *a, **k: None
    cpp = cc_mods.get("causal_conv1d.cpp_functions")
    if mamba in ("2.2.0", "2.2.4"):  # import causal_conv1d_cuda
        mod.causal_conv1d_cuda = cc_mods.get("causal_conv1d_cuda")
        mod.causal_conv1d_fn = None if mod.causal_conv1d_cuda is None else cc_mods["causal_conv1d"].causal_conv1d_fn
    else:  # from causal_conv1d.cpp_functions import ...
        for n in ("causal_conv1d_fwd_function", "causal_conv1d_bwd_function", "causal_conv1d_update_function"):
            setattr(mod, n, None if cpp is None else getattr(cpp, n))
        if mamba in ("2.2.5", "2.2.6"):
            mod.rearrange_and_update_stride = lambda tensor, pattern=None, dim=2: tensor
        else:  # 2.3.x
            mod.ensure_stride = lambda inp: inp
    return mod


@pytest.fixture
def fresh_probes(monkeypatch):
    """Empty probe / selection caches for the test (and again after it); CUDA reported available."""
    monkeypatch.setattr(_dispatch, "_probes", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ssd, "_split_warned", set())
    ssd._select.cache.clear()
    ssd._split_cache.clear()
    yield
    ssd._select.cache.clear()
    ssd._split_cache.clear()


def install(monkeypatch, mamba: str, cc: str | None):
    cc_mods = {} if cc is None else fake_causal_conv1d(cc)
    for name in ("causal_conv1d", "causal_conv1d_cuda", "causal_conv1d.cpp_functions"):
        if name in cc_mods:
            monkeypatch.setitem(sys.modules, name, cc_mods[name])
        else:
            monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError (not installed)
    pkg = types.ModuleType("mamba_ssm")
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "mamba_ssm", pkg)
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", fake_ssd_combined(mamba, cc_mods))
    sel = types.ModuleType("mamba_ssm.ops.triton.selective_state_update")
    sel.selective_state_update = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.selective_state_update", sel)


# The Mamba2 preset at d = 256: d_inner 512, H 16, G 1, N 64 -> conv_dim 640, in_proj 2·512 + 128 + 16 = 1168.
DIMS = dict(d_inner=512, conv_dim=640, nheads=16)

PAIRS = [
    # (mamba-ssm, causal-conv1d, fused path runs?, words of the reason)
    ("2.2.4", "1.5.0.post8", True, None),
    ("2.2.4", "1.5.1", False, "out` argument"),  # 7-argument call of the 8-argument C++ op
    ("2.2.4", "1.6.1", False, "takes [8]"),
    ("2.2.4", None, False, "causal_conv1d_cuda"),  # causal-conv1d not installed
    ("2.2.5", "1.5.0.post8", False, "cpp_functions"),  # names left None by the failed import
    ("2.2.5", "1.5.1", True, None),
    ("2.2.6", "1.6.1", True, None),
    ("2.3.0", "1.6.1", True, None),
    ("2.3.1", "1.5.0", False, "cpp_functions"),
    ("2.3.1", None, False, "cpp_functions"),
]


@pytest.mark.parametrize("mamba,cc,ok,words", PAIRS)
def test_fused_split_probe_per_library_pair(monkeypatch, fresh_probes, mamba, cc, ok, words):
    install(monkeypatch, mamba, cc)
    dev, dt = "cuda", torch.bfloat16
    assert ssd.resolve_backend("auto", dev, dt) == "mamba_ssm"  # the unfused kernels import in every case
    why = ssd.fused_split_reason(dev, dt, 4, **DIMS)
    assert (why is None) == ok, why
    if ok:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ssd.use_fused_split("mamba_ssm", dev, dt, 4, **DIMS) is True
            assert ssd.check_fused_split("mamba_ssm", dev, dt, 4, **DIMS) is True
            assert ssd.check_fused_split("auto", dev, dt, 4, **DIMS) is True
        return
    assert words in why
    with pytest.warns(RuntimeWarning, match="fused mamba_split_conv1d_scan_combined path cannot run"):
        assert ssd.use_fused_split("mamba_ssm", dev, dt, 4, **DIMS) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per reason and process: already given
        assert ssd.check_fused_split("auto", dev, dt, 4, **DIMS) is False  # auto: the unfused mamba_ssm path
    assert ssd.check_fused_split("reference", dev, dt, 4, **DIMS) is False
    with pytest.raises(ConfigError) as e:
        ssd.check_fused_split("mamba_ssm", dev, dt, 4, **DIMS)
    assert e.value.key == "model.kernels.ssd" and e.value.value == "mamba_ssm" and words in e.value.allowed


def test_fake_cpp_ops_fail_like_the_real_pair(monkeypatch, fresh_probes):
    """The fakes reproduce the crash the probe prevents: mamba-ssm 2.2.4's 7-argument forward call against the
    8-argument op of causal-conv1d 1.5.1 raises a TypeError; 1.5.1's own cpp_functions wrapper takes 7."""
    new, old = fake_causal_conv1d("1.5.1"), fake_causal_conv1d("1.5.0.post8")
    args = (torch.zeros(1, 8, 4), torch.zeros(8, 4), None, None, None, None, True)
    with pytest.raises(TypeError, match="incompatible"):
        new["causal_conv1d_cuda"].causal_conv1d_fwd(*args)
    old["causal_conv1d_cuda"].causal_conv1d_fwd(*args)
    new["causal_conv1d.cpp_functions"].causal_conv1d_fwd_function(*args)
    assert _mamba.positional_arities(new["causal_conv1d_cuda"].causal_conv1d_fwd) == {8}
    assert _mamba.positional_arities(old["causal_conv1d_cuda"].causal_conv1d_bwd) == {10}
    assert _mamba.positional_arities(new["causal_conv1d.cpp_functions"].causal_conv1d_bwd_function) == {10}


def test_positional_arities_reads_signatures_and_pybind_docstrings():
    def f(a, b, c=1):
        return a

    assert _mamba.positional_arities(f) == {2, 3}
    assert _mamba.positional_arities(lambda *a: a) is None
    over = PybindFn("op", [T_], T_, "")
    over.__doc__ = (
        "op(*args, **kwargs)\nOverloaded function.\n\n1. op(arg0: torch.Tensor) -> None\n\n"
        "2. op(arg0: torch.Tensor, arg1: Dict[str, Tuple[int, int]]) -> None\n"
    )
    assert _mamba.positional_arities(over) == {1, 2}
    nodoc = PybindFn("op", [T_], T_, "")
    nodoc.__doc__ = None
    assert _mamba.positional_arities(nodoc) is None  # unknown: not held against the library


def test_split_shape_reason():
    """causal-conv1d's channel-last rules on the xBC slice (conv channels % 8; an uncopied view also needs the row
    stride 2*d_inner + 2GN + H and the start offset d_inner to be multiples of 8)."""
    assert ssd.split_shape_reason(512, 640, 16) is None  # the Mamba2 preset at d = 256
    assert ssd.split_shape_reason(512, 640, 16, stride_fix=False) is None
    assert "644" in ssd.split_shape_reason(512, 644, 16)
    assert ssd.split_shape_reason(512, 640, 12, stride_fix=True) is None
    assert "in_proj's width" in ssd.split_shape_reason(512, 640, 12, stride_fix=False)
    assert "d_inner = 500" in ssd.split_shape_reason(500, 632, 20)  # 500 + 632 + 20 = 1152: uncopied, misaligned
    assert ssd.split_shape_reason(500, 632, 16) is None  # 1148: copied by mamba-ssm >= 2.2.5
    assert "in_proj's width" in ssd.split_shape_reason(500, 632, 16, stride_fix=False)


def test_fused_split_checks_width_and_layout(monkeypatch, fresh_probes):
    install(monkeypatch, "2.3.0", "1.6.1")
    dev, dt = "cuda", torch.float32
    assert ssd.fused_split_reason(dev, dt, 4, **DIMS) is None
    assert "conv kernel width 5" in ssd.fused_split_reason(dev, dt, 5, **DIMS)
    bad = dict(d_inner=512, conv_dim=644, nheads=16)
    assert "644" in ssd.fused_split_reason(dev, dt, 4, **bad)
    with pytest.warns(RuntimeWarning, match="644"):
        assert ssd.use_fused_split("mamba_ssm", dev, dt, 4, **bad) is False
    with pytest.raises(ConfigError, match="644"):
        ssd.check_fused_split("mamba_ssm", dev, dt, 4, **bad)
    with pytest.raises(ConfigError, match="kernel width 5"):
        ssd.check_fused_split("mamba_ssm", dev, dt, 5, **DIMS)
    assert "float64" in ssd.fused_split_reason(dev, torch.float64, 4, **DIMS)
    assert ssd.use_fused_split("reference", dev, dt, 4, **DIMS) is False  # no warning: not requested
    assert ssd.check_fused_split("fused", dev, dt, 4, **DIMS) is True


def test_fused_split_off_cuda_and_on_meta():
    assert "CUDA" in ssd.fused_split_reason("cpu", torch.float32, 4, **DIMS)
    assert ssd.use_fused_split("auto", "cpu", torch.float32, 4, **DIMS) is False
    assert ssd.check_fused_split("auto", "cpu", torch.float32, 4, **DIMS) is False
    assert ssd.check_fused_split("mamba_ssm", "meta", torch.float32, 4, **DIMS) is False
    with pytest.raises(ConfigError, match="model.kernels.ssd"):
        ssd.check_fused_split("mamba_ssm", "cpu", torch.float32, 4, **DIMS)


# ----------------------------------------------------------------------------------------------------------------
# Dao Canon path: copies only when causal-conv1d's channel-last checks require it
# ----------------------------------------------------------------------------------------------------------------


class FakeCausalConv1dFn:
    """``causal_conv1d_fn`` with the checks of ``causal_conv1d_fwd`` (csrc/causal_conv1d.cpp, 1.4 - 1.6) for the
    channel-last layout, plus the 16-byte alignment its vector loads need; computes with the reference."""

    def __init__(self):
        self.inputs = []

    def __call__(
        self,
        x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None,
    ):
        B, C, T = x.shape
        assert x.stride(1) == 1 and x.stride(2) > 1, "channel-last view expected"
        assert C % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now"
        assert x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, "strides must be multiples of 8"
        assert x.data_ptr() % 16 == 0, "misaligned address"
        if initial_states is not None:
            assert initial_states.stride(1) == 1 and initial_states.dtype == x.dtype
            assert initial_states.data_ptr() % 16 == 0
        if bias is not None:
            assert bias.dtype == weight.dtype
        self.inputs.append((x, initial_states))
        y = causal_conv1d_reference(
            x.transpose(1, 2),
            weight,
            bias,
            residual=False,
            activation=activation == "silu",
            initial_state=initial_states,
        )
        return y.transpose(1, 2)


@pytest.fixture
def fake_dao(monkeypatch):
    fn = FakeCausalConv1dFn()
    monkeypatch.setitem(_dispatch._probes, "canon.dao", ((fn, None), None))
    return fn


def _strided(B, T, C, row, batch, offset=0, dtype=torch.float32, seed=0):
    """A (B, T, C) view with strides (batch, row, 1) at element ``offset`` into a fresh buffer."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(offset + (B - 1) * batch + (T - 1) * row + C + 64, generator=g).to(dtype)
    return buf.as_strided((B, T, C), (batch, row, 1), offset)


@pytest.mark.parametrize(
    "case,copied",
    [
        ("contiguous", False),
        ("slice_of_wider", False),  # channels 16..48 of a 64-wide row: strides (T*64, 64, 1), 64-byte offset
        ("misaligned_slice", True),  # starts 2 fp32 elements into the buffer: 8-byte offset
        ("row_not_mult_8", True),  # row stride 36
        ("batch1_odd_stride", True),  # B = 1 with stride(0) = 7: `.contiguous()` would return it unchanged
    ],
)
def test_dao_forward_copies_only_when_needed(fake_dao, case, copied):
    B, T, C, K = 2, 9, 32, 4
    if case == "contiguous":
        x = torch.randn(B, T, C)
    elif case == "slice_of_wider":
        x = torch.randn(B, T, 64)[..., 16:48]
    elif case == "misaligned_slice":
        x = _strided(B, T, C, row=64, batch=T * 64, offset=2)
    elif case == "row_not_mult_8":
        x = _strided(B, T, C, row=36, batch=T * 36)
    else:
        x = _strided(1, T, C, row=C, batch=7)
        assert x.is_contiguous() and x.contiguous().stride(0) == 7
    w, b = torch.randn(C, K), torch.randn(C)
    y = canon_cuda.dao_forward(x, w, b, True, True, None)
    torch.testing.assert_close(y, causal_conv1d_reference(x, w, b, residual=True, activation=True))
    passed = fake_dao.inputs[-1][0]
    assert (passed.data_ptr() != x.data_ptr()) == copied
    assert canon_cuda.dao_channel_last_ok(passed.transpose(1, 2))


def test_dao_forward_initial_state_and_grads(fake_dao):
    B, T, C, K = 2, 7, 16, 4
    x = torch.randn(B, T, C, requires_grad=True)
    w = torch.randn(C, K, requires_grad=True)
    h = torch.randn(B, C, K - 1, requires_grad=True)  # (B, C, K-1) channel-first: must become channel-last
    y = canon_cuda.dao_forward(x, w, None, True, False, h)
    yr = causal_conv1d_reference(x, w, None, residual=True, initial_state=h)
    torch.testing.assert_close(y, yr)
    gy = torch.randn_like(y)
    g = torch.autograd.grad(y, (x, w, h), gy)
    gr = torch.autograd.grad(yr, (x, w, h), gy)
    for a, b_ in zip(g, gr):
        torch.testing.assert_close(a, b_)
    init = fake_dao.inputs[-1][1]
    assert init.stride(1) == 1 and init.data_ptr() != h.data_ptr()
    # already channel-last and aligned: passed as is
    h_cl = torch.randn(B, K - 1, C).transpose(1, 2)
    canon_cuda.dao_forward(x.detach(), w.detach(), None, False, False, h_cl)
    assert fake_dao.inputs[-1][1].data_ptr() == h_cl.data_ptr()
    # another dtype than x: converted (the op requires initial_states.dtype == x.dtype)
    canon_cuda.dao_forward(x.detach(), w.detach(), None, False, False, h_cl.double())
    assert fake_dao.inputs[-1][1].dtype == x.dtype


def test_dao_channel_last_ok_rules():
    ok = canon_cuda.dao_channel_last_ok
    assert ok(torch.randn(2, 5, 16))
    assert not ok(torch.randn(2, 5, 12))  # row stride 12
    assert not ok(torch.randn(2, 16, 5).transpose(1, 2))  # channel stride 5
    assert not ok(torch.randn(2, 1, 16).as_strided((2, 1, 16), (16, 1, 1)))  # stride(1) == 1: not channel-last
    assert not ok(_strided(2, 3, 16, row=16, batch=48, offset=1))  # 4-byte offset


# ----------------------------------------------------------------------------------------------------------------
# flash-attn limits at resolution
# ----------------------------------------------------------------------------------------------------------------


def test_flash_head_dim_checked_at_resolution(monkeypatch):
    assert attn.flash_shape_reason(256) is None and attn.flash_shape_reason(None) is None
    assert attn.flash_shape_reason(100) is None  # padded to 104 by flash_attn_func
    assert "256" in attn.flash_shape_reason(257)
    assert attn.resolve_backend("auto", "cpu", torch.float32, head_dim=512) == "sdpa"
    assert attn.resolve_backend("fused", "cuda", torch.float32, head_dim=512) == "sdpa"
    assert attn.resolve_backend("flash", "meta", torch.bfloat16, head_dim=128) == "flash"
    with pytest.raises(ConfigError, match="head dim"):
        attn.resolve_backend("flash", "meta", torch.bfloat16, head_dim=320)
    with pytest.raises(ConfigError, match="CUDA"):
        attn.resolve_backend("flash", "cpu", torch.bfloat16, head_dim=64)
    # a CUDA machine with flash_attn, as far as the checks can tell
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attn, "flash_available", lambda: True)
    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    assert attn.resolve_backend("flash", "cuda", torch.bfloat16, head_dim=256) == "flash"
    assert attn.resolve_backend("flash", "cuda", torch.float16) == "flash"
    with pytest.raises(ConfigError) as e:
        attn.resolve_backend("flash", "cuda", torch.bfloat16, head_dim=320)
    assert e.value.key == "model.kernels.attention" and e.value.value == "flash" and "256" in e.value.allowed
    with pytest.raises(ConfigError, match="fp16/bf16"):
        attn.resolve_backend("flash", "cuda", torch.float32, head_dim=64)
    cap[0] = (7, 5)
    with pytest.raises(ConfigError, match="Ampere"):
        attn.resolve_backend("flash", "cuda", torch.bfloat16, head_dim=64)


def test_flash_attention_call_refuses_large_head_dim():
    q = torch.randn(1, 4, 2, 320)
    with pytest.raises(ValueError, match="head dim"):
        attn.attention(q, q, q, backend="flash")
    # the SDPA default takes it
    assert attn.attention(q, q, q).shape == q.shape
    torch.testing.assert_close(attn.attention(q, q, q), attn.attention_reference(q, q, q), rtol=1e-4, atol=1e-5)
