"""Evaluation, generation and export run a model in the precision it was trained in (``canonlm.eval.load.eval_precision``).

Oracles: the test loss and accuracy a ``train.py`` run reported in its ``results.json`` (the loaded model, in its
default precision, must reproduce them on the same test windows); Lightning's own precision plugins (what a
``Trainer`` on the CPU runs for every ``trainer.precision``); training's dtype rule for CUDA placement
(``canonlm.arch.model.compute_dtype_for``); a pinned flash kernel's resolution on a faked CUDA machine (as in
test_backend_contract.py); plain ``torch.autocast`` forwards of the same weights.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from canonlm.arch.model import CanonLM, compute_dtype_for
from canonlm.errors import ConfigError
from canonlm.config.rundir import load_run_config
from canonlm.eval.load import eval_precision, load_model
from canonlm.ops import attention as attention_ops
from canonlm.config.build import build_configs
from canonlm.config.rules import PRECISIONS

from conftest import ROOT, compose

TINY = ["task=depo1_cpu", "model.size=2L64D", "task.N=8", "task.K=4", "task.vocab_V=6", "task.context=128"]
CUDA = torch.device("cuda")


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available' on an Ampere+ GPU with flash-attn importable (backend resolution only; no GPU tensors)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention_ops, "flash_available", lambda: True)


def make_run(run: Path, overrides: list[str], seed: int = 0) -> CanonLM:
    """A run directory as train.py leaves it (.hydra/config.yaml + checkpoints/last.ckpt), random weights."""
    from omegaconf import OmegaConf

    cfg = compose([*TINY, *overrides], output_dir=run)
    _, mcfg = build_configs(cfg)
    torch.manual_seed(seed)
    model = CanonLM(mcfg).eval()
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    (run / "checkpoints").mkdir()
    torch.save(
        {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "global_step": 1},
        run / "checkpoints" / "last.ckpt",
    )
    return model


# ------------------------------------------------------------------------------------------------ the oracle run
def _train(tmp_path: Path, precision: str) -> Path:
    """A 5-step train.py run on the CPU in ``precision``, with its final test; returns the run directory."""
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *TINY,
        "data.batch_size=8",
        "data.val_windows=8",
        "data.test_windows=16",
        "trainer.max_steps=5",
        "trainer.val_check_interval=5",
        f"trainer.precision={precision}",
        "logger=none",
        "run_name=p",
        f"paths.log_dir={tmp_path}/logs",
    ]
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "WANDB_MODE": "disabled"}
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return tmp_path / "logs" / "train" / "runs" / "p"


def _test_metrics(loaded) -> tuple[float, float, float]:
    """(mean NLL over loss tokens, answer accuracy, answer-token accuracy) of ``loaded.lm``'s forward on the run's
    test windows (the same stream and batches ``trainer.test`` read)."""
    from canonlm.arch.loss import lm_loss
    from canonlm.data.metrics import score_answers
    from canonlm.data.tasks import build_task
    from canonlm.train.datamodule import SyntheticDataModule

    cfg = loaded.cfg
    task = build_task(cfg.task.name, loaded.task_cfg)
    dm = SyntheticDataModule(
        task,
        loaded.task_cfg,
        batch_size=cfg.data.batch_size,
        val_windows=cfg.data.val_windows,
        test_windows=cfg.data.test_windows,
    )
    nll = torch.zeros(2, dtype=torch.float64)
    right = total = right_tok = total_tok = 0
    with torch.inference_mode():
        for batch in dm.test_dataloader():
            tokens = batch["tokens"]
            logits = loaded.lm.forward(tokens)  # the loaded model's forward, in its precision
            out = lm_loss(logits[:, :-1], tokens[:, 1:], batch["loss_mask"][:, 1:])
            nll += torch.stack([out["nll_sum"].double(), out["n_tokens"].double()])
            pred = torch.full_like(tokens, -1)
            pred[:, 1:] = logits[:, :-1].argmax(-1)
            c = score_answers(pred, batch, task.num_groups)
            right += int(c["answers_correct"].sum())
            total += int(c["answers_total"].sum())
            right_tok += int(c["tokens_correct"].sum())
            total_tok += int(c["tokens_total"].sum())
    return float(nll[0] / nll[1]), right / total, right_tok / total_tok


@pytest.mark.parametrize(
    "precision, param_dtype, autocast",
    [("bf16-mixed", torch.float32, torch.bfloat16), ("bf16-true", torch.bfloat16, None)],
)
def test_default_precision_reproduces_the_runs_test_metrics(tmp_path, precision, param_dtype, autocast):
    """A run trained on the CPU in bf16, loaded with the defaults, gives the test loss and accuracy the run itself
    reported in results.json; the fp32 override does not (so the comparison can fail)."""
    rd = _train(tmp_path, precision)
    reported = json.loads((rd / "results.json").read_text())["test"]
    loaded = load_model(rd, device="cpu")
    assert (loaded.precision.name, loaded.precision.param_dtype, loaded.precision.autocast) == (
        precision,
        param_dtype,
        autocast,
    )
    assert {p.dtype for p in loaded.model.parameters()} == {param_dtype}
    assert loaded.model.placement == (torch.device("cpu"), torch.bfloat16)
    assert loaded.describe()["precision"]["name"] == precision
    loss, acc, token_acc = _test_metrics(loaded)
    assert loss == pytest.approx(reported["loss"], rel=1e-9, abs=0)
    assert (acc, token_acc) == (reported["overall"]["acc"], reported["overall"]["token_acc"])
    fp32 = load_model(rd, device="cpu", precision="32-true")
    assert fp32.precision.compute_dtype == torch.float32 and fp32.model.placement[1] == torch.float32
    assert abs(_test_metrics(fp32)[0] - reported["loss"]) > 1e-6


# ------------------------------------------------------------------------------------------------ the decision
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cpu_precision_is_what_lightning_runs(precision):
    """On the CPU every trainer.precision is run as a Lightning Trainer on the CPU runs it: its precision plugin's
    autocast dtype (``16-mixed`` becomes bf16 there) and the dtype its ``convert_module`` gives the parameters."""
    import lightning.pytorch as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    plugin = trainer.precision_plugin
    want_autocast = plugin.autocast_context_manager().fast_dtype if isinstance(plugin, MixedPrecision) else None
    want_param = plugin.convert_module(torch.nn.Linear(2, 2)).weight.dtype
    cfg = compose([f"trainer.precision={precision}"])
    for got in (eval_precision("auto", "cpu", cfg), eval_precision(precision, "cpu")):
        assert (got.param_dtype, got.autocast, got.device_type) == (want_param, want_autocast, "cpu")
    ctx = eval_precision(precision, "cpu").context()
    if want_autocast is None:
        assert not isinstance(ctx, torch.autocast)
    else:
        assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == want_autocast and ctx.device == "cpu"


@pytest.mark.parametrize("strategy", [[], ["strategy=fsdp2"], ["strategy=fsdp2", "strategy.param_dtype=fp32"]])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cuda_compute_dtype_is_the_training_placement_dtype(precision, strategy):
    """On CUDA the dtype a loaded model is placed for is the one training placed it for
    (``compute_dtype_for(trainer.precision, FSDP2 param_dtype)``); FSDP2's bf16 param_dtype casts the parameters."""
    cfg = compose([f"trainer.precision={precision}", *strategy])
    fsdp = cfg.strategy.get("param_dtype") if cfg.strategy.name == "fsdp2" else None
    got = eval_precision("auto", CUDA, cfg)
    assert got.device_type == "cuda"
    if precision == "16-mixed" and fsdp == "bf16":  # fp16 autocast over bf16 parameters: the matmuls run in fp16
        assert (got.param_dtype, got.autocast, got.compute_dtype) == (torch.bfloat16, torch.float16, torch.float16)
    else:
        assert got.compute_dtype == compute_dtype_for(precision, fsdp)
    if fsdp == "bf16":
        assert got.param_dtype == torch.bfloat16 and "param_dtype=bf16" in got.source


def test_flash_pinned_bf16_run_is_placed_in_bf16_on_cuda(tmp_path, fake_cuda):
    """A run that pinned flash and trained in bf16-mixed on CUDA: the default precision is bf16-mixed (bf16 autocast)
    and the model is placed with flash; fp32, the earlier default, is refused by flash-attn's dtype rule. The same
    for 32-true + FSDP2's bf16 param_dtype (bf16 parameters, no autocast)."""
    for name, overrides, param, autocast in (
        ("bf16-mixed", ["trainer.precision=bf16-mixed"], torch.float32, torch.bfloat16),
        ("32-true", ["trainer.precision=32-true", "strategy=fsdp2"], torch.bfloat16, None),
    ):
        run = tmp_path / name
        make_run(run, ["trainer=gpu", "kernels.attention=flash", *overrides])
        cfg = load_run_config(run)
        prec = eval_precision("auto", "cuda", cfg)
        assert (prec.name, prec.param_dtype, prec.autocast, prec.compute_dtype) == (
            name,
            param,
            autocast,
            torch.bfloat16,
        )
        _, mcfg = build_configs(cfg)
        model = CanonLM(mcfg)
        assert "attention" in model.pending  # built on the CPU: flash waits for place()
        with pytest.raises(ConfigError) as e:
            model.place(CUDA, eval_precision("fp32", "cuda", cfg).compute_dtype)
        assert e.value.key == "model.kernels.attention" and "fp16/bf16" in str(e.value)
        assert model.place(CUDA, prec.compute_dtype)["attention"] == "flash" and not model.pending
        assert model.placement == (CUDA, torch.bfloat16)


def test_without_a_run_config_the_saved_dtype_decides(tmp_path):
    """A checkpoint that records its model but has no .hydra/ (imported, or copied out of its run): bf16 weights
    run as bf16-true (bf16 parameters: the logits of the bf16 model itself), float32 weights as 32-true; an explicit
    precision wins."""
    cfg = compose(TINY)
    _, mcfg = build_configs(cfg)
    torch.manual_seed(0)
    ref = CanonLM(mcfg).eval().to(torch.bfloat16)
    ck = tmp_path / "bf16.ckpt"
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in ref.state_dict().items()},
            "canonlm": {"model": dataclasses.asdict(mcfg), "task": {"name": "hf_import", "context": 128}},
        },
        ck,
    )
    lm = load_model(ck, device="cpu")
    assert (lm.precision.name, lm.precision.param_dtype, lm.precision.autocast) == ("bf16-true", torch.bfloat16, None)
    assert "bfloat16 weights" in lm.precision.source
    x = torch.randint(0, mcfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = lm.lm.forward(x), ref(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    over = load_model(ck, device="cpu", precision="bf16")
    assert (over.precision.name, over.precision.param_dtype, over.precision.autocast) == (
        "bf16-mixed",
        torch.float32,
        torch.bfloat16,
    )
    torch.save(
        {
            "state_dict": {f"model.{k}": v.float() for k, v in ref.state_dict().items()},
            "canonlm": {"model": dataclasses.asdict(mcfg), "task": {}},
        },
        tmp_path / "fp32.ckpt",
    )
    assert load_model(tmp_path / "fp32.ckpt", device="cpu").precision.name == "32-true"


# ------------------------------------------------------------------------------------------------ generation
def test_generate_defaults_to_the_runs_precision(tmp_path):
    """``canonlm.generate`` on a bf16-mixed run: greedy tokens == an argmax loop over full forwards of the same
    weights under CPU bf16 autocast; ``--precision fp32`` == the loop without autocast."""
    from canonlm.generate import load_generator, run

    model = make_run(tmp_path / "run", ["trainer.precision=bf16-mixed"])
    prompt = "<bos> p3.e1 e2 p4.e5 <query_1> p3.e1 <ans>"

    def argmax_loop(ids: list[int], n: int, autocast: bool) -> list[int]:
        seq = list(ids)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq]))[0, -1].float().argmax()))
        return seq[len(ids) :]

    g = load_generator(tmp_path / "run", device="cpu")
    assert g.precision.name == "bf16-mixed" and g.info["precision"]["autocast"] == "bfloat16"
    for flags, autocast in (([], True), (["--precision", "fp32"], False)):
        rec = run([str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens", "8", *flags], out=io.StringIO())[0]
        assert rec["continuation_ids"] == argmax_loop(rec["prompt_ids"], 8, autocast)


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_precision_is_one_error_before_any_work(tmp_path, capsys):
    from canonlm.eval.reallife import main as reallife_main
    from canonlm.generate import main as generate_main

    missing = tmp_path / "no_such_run"  # the precision is checked before the run is looked at
    with pytest.raises(ConfigError) as e:
        load_model(missing, precision="bf17")
    assert e.value.key == "precision" and e.value.value == "bf17"
    assert all(p in e.value.allowed for p in ("auto", *PRECISIONS, "fp32", "bf16"))
    make_run(tmp_path / "run", [])
    assert generate_main([str(tmp_path / "run"), "--prompt", "<bos>", "--precision", "bf17"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "canonlm.generate: error: --precision='bf17' is not allowed; allowed: auto | 32-true"
    )
    out = tmp_path / "r.json"
    assert reallife_main(["--run", str(missing), "--task", "multihop", "--precision", "bf17", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--precision='bf17'" in err[0] and "allowed: auto | 32-true" in err[0]
    assert not out.exists()


# ------------------------------------------------------------------------------------------------ export
def test_export_of_a_flash_pinned_bf16_run(tmp_path):
    """Export builds no model and places no kernel: a flash-pinned bf16-mixed run exports on the CPU, its weights
    come back unchanged, and the exported directory generates in float32 (the weights' dtype)."""
    hf = pytest.importorskip("canonlm.hf")
    from canonlm.generate import load_generator

    model = make_run(tmp_path / "run", ["trainer=gpu", "trainer.precision=bf16-mixed", "kernels.attention=flash"])
    info = hf.export_model(tmp_path / "run", tmp_path / "out")
    assert info["format"] == "canonlm"  # a Canon model: canonlm's own format
    _, sd, hcfg = hf.hf_to_canonlm(tmp_path / "out")
    want = model.state_dict()
    assert hcfg["torch_dtype"] == "float32" and set(sd) <= set(want)
    assert all(torch.equal(sd[k], want[k]) for k in sd)
    g = load_generator(tmp_path / "out", device="cpu")
    assert g.precision.name == "32-true" and g.model.placement == (torch.device("cpu"), torch.float32)
    assert g.info["precision"]["param_dtype"] == "float32"
    ids = np.array([1, 2, 3], dtype=np.int64)
    assert g.generate([ids], 4)[0].shape == (4,)
