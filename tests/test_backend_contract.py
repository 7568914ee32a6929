"""The backend contract of CanonLM on a machine without a GPU: requests (``model.ops``, ``model.kernels.<op>``) are
checked by name at construction and resolved where the model runs -- ``CanonLM.place(device, dtype)``, called by
``LMModule.configure_model`` (the strategy's root device, bf16 under bf16 precision or an FSDP2 bf16 param_dtype),
by ``canonlm.eval.load.load_model`` after the move, and checked early by ``prepare_run``. A request that cannot be
met is one ConfigError naming the key, before any step.

"CUDA" is faked where a test needs it: ``torch.cuda.is_available`` returns True and the kernel libraries' import
probes succeed, so the real resolvers run with their real device and dtype rules (flash refuses fp32), while no
tensor ever goes to a GPU."""

from __future__ import annotations

import pytest
import torch

from canonlm.arch import model as model_mod
from canonlm.arch import CanonLM, ConfigError, build_model_config
from canonlm.arch.canon import Canon
from canonlm.arch.mixers import Attention
from canonlm.ops import attention as attention_ops
from canonlm.ops import canon as canon_ops

from conftest import compose

CUDA = torch.device("cuda")
V = 16


def llama(canon="ABCD", **kw):
    return build_model_config({"size": "2L64D"}, canon={"set": canon}, vocab_size=V, max_seq_len=32, **kw)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available' with flash-attn and Dao's causal-conv1d importable (resolution only; no GPU tensors)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention_ops, "flash_available", lambda: True)
    monkeypatch.setattr(canon_ops._cuda, "dao_functions", lambda: ((object(), object()), None))


def canon_backends(model):
    return {m.backend for m in model.modules() if isinstance(m, Canon)}


def ids(device="cpu"):
    return torch.randint(0, V, (2, 8), device=device)


# ------------------------------------------------------------------------------------------------ construction
def test_unknown_names_still_fail_at_construction():
    for kw, key in (
        ({"kernels": {"attention": "xformers"}}, "model.kernels.attention"),
        ({"kernels": {"canon": "nope"}}, "model.kernels.canon"),
    ):
        with pytest.raises(ConfigError) as e:
            CanonLM(llama(**kw))
        assert e.value.key == key and "allowed" in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_pinned_flash_on_cpu_is_refused_at_placement_not_construction():
    model = CanonLM(llama(kernels={"attention": "flash"}))  # e.g. built on the CPU before .cuda()
    assert set(model.pending) == {"attention"} and model.backends["attention"] == "flash"
    for call in (lambda: model.place("cpu", torch.bfloat16), lambda: model(ids())):
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.key == "model.kernels.attention" and e.value.value == "flash"
        assert "CUDA" in str(e.value)


def test_defaults_are_placed_at_construction_and_unchanged():
    """The CPU behaviour of a default build: resolved for the construction device, modules keep ``auto``."""
    model = CanonLM(llama())
    assert model.placement == (torch.device("cpu"), torch.get_default_dtype()) and not model.pending
    assert model.backends["attention"] == "sdpa" and canon_backends(model) == {"auto"}
    model(ids())  # runs without an explicit place()
    with torch.device("meta"):
        meta = CanonLM(llama(ops="fused"))
    assert meta.placement is None and set(meta.pending) == {"canon"}  # fused is only decided by place()


# ------------------------------------------------------------------------------------------------ placement
def test_fused_canon_switches_off_the_cpu_kernel_when_placed_on_cuda(fake_cuda):
    model = CanonLM(llama(ops="fused"))
    cpu_native = canon_ops.available_backends("cpu", torch.float32)["cpu"] is None
    if cpu_native:  # built on the CPU: the native kernel, device-bound
        assert canon_backends(model) == {"cpu"}
    got = model.place(CUDA, torch.bfloat16)
    assert got == {"canon": "dao", "attention": "sdpa"} and model.backends == got
    assert canon_backends(model) == {"dao"} and model.placement == (CUDA, torch.bfloat16)
    assert all(b.attn.backend == "sdpa" for b in model.blocks)
    with pytest.raises(ConfigError, match="place") as e:  # resolved for CUDA, fed CPU tensors: a clear error
        model(ids())
    assert e.value.key == "model.ops"
    if cpu_native:
        assert model.place("cpu", torch.float32)["canon"] == "cpu"
        model(ids())


def test_pinned_kernels_resolve_for_the_compute_dtype(fake_cuda):
    """flash takes fp16/bf16 only: placing on 'CUDA' in fp32 is the ConfigError, in bf16 every module gets flash."""
    model = CanonLM(llama(kernels={"attention": "flash", "canon": "dao"}))
    assert set(model.pending) == {"attention", "canon"}
    with pytest.raises(ConfigError) as e:
        model.place(CUDA, torch.float32)
    assert e.value.key == "model.kernels.attention" and "fp16/bf16" in str(e.value)
    assert set(model.pending) == {"attention", "canon"}  # a refused placement changes nothing
    assert model.place(CUDA, torch.bfloat16) == {"canon": "dao", "attention": "flash"} and not model.pending
    assert {m.backend for m in model.modules() if isinstance(m, Attention)} == {"flash"}
    assert canon_backends(model) == {"dao"}


@pytest.mark.parametrize("op, arch", [("gla", "gla"), ("gdn", "gdn"), ("ssd", "mamba2")])
def test_linear_fused_and_pinned_resolve_at_placement(monkeypatch, fake_cuda, op, arch):
    fast = "mamba_ssm" if op == "ssd" else "fla"
    mod = model_mod._LINEAR_OPS[op]

    def fake_resolve(name, device, dtype):  # the fast kernel 'imports' on CUDA only
        device = torch.device(device)
        if name == fast and device.type != "cuda":
            raise ConfigError(mod.CONFIG_KEY, name, f"auto | reference ({fast} needs a CUDA device)")
        return fast if name in (fast, "auto") and device.type == "cuda" else ("reference" if name == "auto" else name)

    monkeypatch.setattr(mod, "resolve_backend", fake_resolve)
    if op == "ssd":  # the fused conv+scan check probes the real library (tested in test_kernel_compat.py)
        monkeypatch.setattr(mod, "check_fused_split", lambda *a, **k: False)
    kw = {"ffn_ratio": 2.0} if arch != "gla" else {}
    for req in ({"ops": "fused"}, {"kernels": {op: fast}}):
        cfg = build_model_config({"arch": arch, "size": "2L64D", **kw}, canon={"set": "AbCD"}, vocab_size=V, **req)
        model = CanonLM(cfg)
        assert op in model.pending
        got = model.place(CUDA, torch.bfloat16)
        assert got[op] == fast and got["canon"] == "dao"
        mixers = [b.attn for b in model.blocks]
        assert all(m.backend == fast for m in mixers)
        assert canon_backends(model) == ({"dao"} if "ops" in req else {"auto"})  # an auto request stays auto


# ------------------------------------------------------------------------------------------------ training
def _module(cfg, fsdp=None):
    from canonlm.train.module import LMModule

    return LMModule(cfg, optimizer=torch.optim.AdamW, sched={}, total_steps=1, loss={}, num_groups=1, fsdp=fsdp)


class _Trainer:  # what LMModule.place_model reads from a Lightning Trainer
    def __init__(self, precision, device):
        self.precision = precision
        self.strategy = type("S", (), {"root_device": torch.device(device)})()


@pytest.mark.parametrize(
    "precision, fsdp, dtype",
    [
        ("bf16-mixed", None, torch.bfloat16),
        ("bf16-true", None, torch.bfloat16),
        ("32-true", None, torch.float32),
        ("16-mixed", None, torch.float16),
        ("32-true", {"param_dtype": "bf16"}, torch.bfloat16),
        ("32-true", {"param_dtype": "fp32"}, torch.float32),
    ],
)
def test_lmmodule_places_for_precision_and_fsdp_param_dtype(fake_cuda, precision, fsdp, dtype):
    """LMModule.configure_model places the model on the strategy's root device with the compute dtype; the pinned
    flash kernel (fp16/bf16 only) shows which dtype reached the resolver."""
    module = _module(llama(kernels={"attention": "flash"}), fsdp=fsdp)
    module._trainer = _Trainer(precision, "cuda")
    assert module.compute_dtype() == dtype
    if dtype == torch.float32:
        with pytest.raises(ConfigError) as e:
            module.configure_model()
        assert e.value.key == "model.kernels.attention"
    else:
        module.configure_model()
        assert module.model.placement == (CUDA, dtype) and module.model.backends["attention"] == "flash"


def test_lmmodule_cpu_placement_keeps_cpu_behaviour():
    module = _module(llama(ops="reference"))
    module._trainer = _Trainer("bf16-mixed", "cpu")
    module.configure_model()
    assert module.model.placement == (torch.device("cpu"), torch.bfloat16)
    assert module.model.backends == {"canon": "reference", "attention": "reference"}
    assert canon_backends(module.model) == {"reference"}


# ------------------------------------------------------------------------------------------------ prepare_run
def _prepare(tmp_path, *overrides):
    from canonlm.train.run import prepare_run

    cfg = compose(["model.size=2L64D", "callbacks=none", "logger=none", *overrides], output_dir=tmp_path / "run")
    return prepare_run(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_prepare_run_refuses_flash_on_cpu(tmp_path):
    with pytest.raises(ConfigError) as e:
        _prepare(tmp_path, "kernels.attention=flash")
    assert e.value.key == "model.kernels.attention"


@pytest.mark.parametrize(
    "overrides, ok",
    [
        (["trainer.precision=bf16-mixed"], True),
        (["trainer.precision=32-true"], False),
        (["trainer.precision=32-true", "strategy=fsdp2"], True),  # FSDP2 param_dtype bf16
        (["trainer.precision=32-true", "strategy=fsdp2", "strategy.param_dtype=fp32"], False),
    ],
)
def test_prepare_run_uses_the_training_compute_dtype(fake_cuda, tmp_path, overrides, ok):
    args = ["trainer.accelerator=gpu", "kernels.attention=flash", *overrides]
    if ok:
        _prepare(tmp_path, *args)
    else:
        with pytest.raises(ConfigError) as e:
            _prepare(tmp_path, *args)
        assert e.value.key == "model.kernels.attention" and "fp16/bf16" in str(e.value)


# ------------------------------------------------------------------------------------------------ evaluation
def test_load_model_places_after_the_move(tmp_path, monkeypatch):
    """eval.load_model builds on the CPU, moves, then places with the eval dtype: a pinned flash kernel is refused
    there (CPU, fp32) with the ConfigError -- from place(), not from the constructor."""
    from omegaconf import OmegaConf

    from canonlm.eval.load import load_model
    from canonlm.config.build import build_configs

    run = tmp_path / "run"
    cfg = compose(["model.size=2L64D", "kernels.attention=flash"], output_dir=run)
    _, mcfg = build_configs(cfg)
    model = CanonLM(mcfg)  # the constructor accepts it
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    (run / "checkpoints").mkdir()
    torch.save(
        {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, run / "checkpoints" / "last.ckpt"
    )
    calls = []
    orig = CanonLM.place

    def spy(self, device=None, dtype=None):
        calls.append((torch.device(device), dtype))
        return orig(self, device, dtype)

    monkeypatch.setattr(CanonLM, "place", spy)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError) as e:
            load_model(run, device="cpu")
        assert e.value.key == "model.kernels.attention"
        assert calls == [(torch.device("cpu"), torch.float32)]
    cfg2 = compose(["model.size=2L64D"], output_dir=run)
    OmegaConf.save(cfg2, run / ".hydra" / "config.yaml")
    calls.clear()
    lm = load_model(run, device="cpu", precision="bf16")  # bf16 = bf16-mixed: CPU bf16 autocast, as Lightning runs it
    assert calls == [(torch.device("cpu"), torch.bfloat16)]
    assert lm.model.placement == (torch.device("cpu"), torch.bfloat16)


# ------------------------------------------------------------------------------------------------ what ran


def test_every_entry_point_exists():
    """Every canonlm function of ``canonlm.ops.calls.ENTRY_POINTS`` exists: a renamed wrapper fails here, not only
    when the self-check first runs on a GPU."""
    import importlib

    from canonlm.ops.calls import ENTRY_POINTS, INLINE_PATHS, OPS

    points = [(m, a) for pts in ENTRY_POINTS.values() for m, a in pts] + [(m, a) for _, _, m, a in INLINE_PATHS]
    missing = [
        f"{m}.{a}"
        for m, a in points
        if m.startswith("canonlm.") and not callable(getattr(importlib.import_module(m), a, None))
    ]
    assert not missing, missing
    assert {op for op, _ in ENTRY_POINTS} == set(OPS)
    for op in OPS:  # every backend an op can resolve to (auto aside) has an entry point
        backends = set(importlib.import_module(f"canonlm.ops.{op}").BACKENDS) - {"auto", "fused"}
        assert backends <= {be for o, be in ENTRY_POINTS if o == op}, op


def test_backend_calls_counts_the_backend_each_dispatch_ran():
    """``canonlm.ops.backend_calls`` counts one call per dispatch, under the backend that ran (the ops' CPU backends;
    the fast ones are counted in tests/test_selfcheck.py with stand-ins), and restores every function on exit."""
    from canonlm.ops import backend_calls, gdn, gla, ssd

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 6, 8, generator=g), torch.randn(8, 4, generator=g)
    q, k, v = (torch.randn(1, 5, 2, 4, generator=g) for _ in range(3))
    gk, beta = -torch.rand(1, 5, 2, 4, generator=g), torch.rand(1, 5, 2, generator=g)
    sx, dt, A = torch.randn(1, 5, 2, 3, generator=g), torch.randn(1, 5, 2, generator=g), -torch.rand(2, generator=g)
    sB = torch.randn(1, 5, 1, 4, generator=g)
    originals = (canon_ops.causal_conv1d_torch, canon_ops.causal_conv1d_step, gla.chunk_gla_reference)
    with backend_calls(["canon", "attention", "gla", "gdn", "ssd"]) as ran:
        canon_ops.causal_conv1d(x, w, backend="torch")
        canon_ops.causal_conv1d(x, w, backend="reference")
        canon_ops.causal_conv1d_step(x[:, 0], torch.zeros(1, 8, 4), w, backend="torch")
        attention_ops.attention(q, k, v, backend="sdpa")
        attention_ops.attention(q, k, v, backend="reference")
        gla.chunk_gla(q, k, v, gk, backend="reference")
        gdn.chunk_gated_delta_rule(q, k, v, gk[..., 0], beta, backend="reference")
        ssd.ssd_scan(sx, dt, A, sB, sB, chunk_size=4, backend="reference")
    assert ran == {
        "canon": {"torch": 2, "reference": 1},
        "attention": {"sdpa": 1, "reference": 1},
        "gla": {"reference": 1},
        "gdn": {"reference": 1},
        "ssd": {"reference": 1},
    }
    assert (canon_ops.causal_conv1d_torch, canon_ops.causal_conv1d_step, gla.chunk_gla_reference) == originals
    with pytest.raises(ValueError, match="ops=\\['mlp'\\]; allowed: canon, attention, gla, gdn, ssd"):
        with backend_calls(["canon", "mlp"]):
            pass
