"""The paper's real-life runs as presets (conf/experiment/reallife/): every preset composes as ``train.py`` composes
it, passes ``train.py``'s own checks (:func:`canonlm.train.run.check_job`: the strict key check, task, model,
schedule, batch split, optimizer) on fake prepared corpora, and holds the paper's numbers, asserted against tables
written here from the paper, not read from the presets:

* Result 12 (Allen-Zhu 2025, Physics of Language Models Part 4.1, App. B / C.1): 24 layers, d 2048, Llama 32 heads,
  GLA 4, GDN 12, Mamba2(mlp) 16; context 4096, global batch 48, 510,000 steps; AdamW (0.9, 0.98), eps 1e-6, weight
  decay 0.03; learning rates {1e-3, 2e-3} (Llama), {5e-4, 1e-3, 2e-3} (linear); SlimPajama and FineWeb-Edu
  concatenated; ≈ 1.35B parameters; recurrent states 256d (GLA), 192d (GDN), 128d (Mamba2).
* Part 4.2 (the release's lingua recipes): sizes, contexts x batches, steps, warm-ups, (lr, weight decay) pairs;
  AdamW (0.9, 0.95), eps 1e-8, clip 1.0, cosine to 1 %, seed 777, compile, FSDP2 bf16 / fp32 reduce; QK-norm and
  z-loss for Llama 1B / 3B; Canon recipes with rope_dim = d_head / 4.

A prepared corpus is faked by its ``meta.json`` and one small shard per split (nothing is downloaded or trained)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from conftest import CONF, ROOT

PRESETS = CONF / "experiment" / "reallife"
LLAMA2_VOCAB, LLAMA3_VOCAB = 32_000, 128_256

# ------------------------------------------------------------------------------------- the paper's numbers

#: Result 12: name -> (arch, Canon set, positions (None: linear, no positions), heads, the paper's lr set).
LLAMA_LRS, LINEAR_LRS = (1e-3, 2e-3), (5e-4, 1e-3, 2e-3)
RESULT12 = {
    "llama_1b": ("llama", "", "rope", 32, LLAMA_LRS),
    "llama_canon_1b": ("llama", "ABCD", "rope", 32, LLAMA_LRS),
    "llama_nope_1b": ("llama", "", "nope", 32, LLAMA_LRS),
    "llama_nope_canon_1b": ("llama", "ABCD", "nope", 32, LLAMA_LRS),
    "llama_partialrope_canon_1b": ("llama", "ABCD", "partial_rope", 32, LLAMA_LRS),
    "gla_1b": ("gla", "", None, 4, LINEAR_LRS),
    "gla_canon_1b": ("gla", "AbCD", None, 4, LINEAR_LRS),
    "gdn_1b": ("gdn", "b", None, 12, LINEAR_LRS),
    "gdn_noconv_1b": ("gdn", "", None, 12, LINEAR_LRS),
    "gdn_canon_1b": ("gdn", "AbCD", None, 12, LINEAR_LRS),
    "mamba2_1b": ("mamba2", "b", None, 16, LINEAR_LRS),
    "mamba2_noconv_1b": ("mamba2", "", None, 16, LINEAR_LRS),
    "mamba2_canon_1b": ("mamba2", "AbCD", None, 16, LINEAR_LRS),
}
#: Result 12's recurrent state per layer, in units of d (paper App. C: GLA 256d, GDN 192d, Mamba2(mlp) 128d).
STATE_PER_D = {"gla": 256, "gdn": 192, "mamba2": 128}

#: Part 4.2 sizes: size -> (layers, d, heads).
P42_SHAPE = {"1b": (24, 2048, None), "3b": (26, 3072, None), "8b": (32, 4096, None)}
#: Llama / LlamaCanon: size -> (heads, kv heads, d_ff, context, batch, steps, warm-up, (lr, wd) pairs, QK-norm +
#: z-loss, rope theta, vocabulary).
P42_LLAMA = {
    "1b": (
        32,
        32,
        5632,
        4096,
        1024,
        240_000,
        8000,
        ((2e-3, 0.02), (3e-3, 0.0133), (5e-3, 0.008)),
        True,
        1e4,
        LLAMA2_VOCAB,
    ),
    "3b": (24, 24, 8192, 4096, 1536, 160_000, 4000, ((2e-3, 0.03), (3e-3, 0.02)), True, 1e4, LLAMA2_VOCAB),
    "8b": (32, 8, 14336, 4096, 1536, 160_000, 3000, ((2e-3, 0.03), (3e-3, 0.02)), False, 1e5, LLAMA3_VOCAB),
}
#: GLA5 / GDN2 / Mamba2: size -> (heads, MLP width, context, batch, steps, warm-up, (lr, wd) pairs).
P42_LINEAR = {
    "1b": (16, 4096, 16384, 128, 480_000, 12000, ((2e-3, 0.01), (3e-3, 0.00667), (5e-3, 0.004))),
    "3b": (24, 6144, 12288, 256, 320_000, 8000, ((2e-3, 0.005), (3e-3, 0.01), (5e-3, 0.006))),
    "8b": (32, 9472, 4096, 512, 480_000, 9000, ((2e-3, 0.01), (3e-3, 0.00667))),
}
P42_ARCH = {"gla5": "gla", "gdn2": "gdn", "mamba2": "mamba2"}
P42 = {
    **{f"p42_{m}_{s}": ("llama", m, s) for m in ("llama", "llamacanon") for s in P42_LLAMA},
    **{f"p42_{m}_{v}_{s}": (m, v, s) for m in P42_ARCH for v in ("conv", "canon") for s in P42_LINEAR},
}


def test_every_preset_is_in_a_table():
    """Each reallife/*.yaml (the _-prefixed shared parts aside) is checked below against the paper."""
    files = {p.stem for p in PRESETS.glob("*.yaml") if not p.stem.startswith("_")}
    assert files == set(RESULT12) | set(P42)


# ------------------------------------------------------------------------------------------- fake corpora


def _fake_corpus(d: Path, vocab: int, tokens: int = 20_000) -> Path:
    d.mkdir()
    dtype = "uint16" if vocab <= 65_536 else "uint32"
    meta = {
        "format": "canonlm-text-v1",
        "dtype": dtype,
        "vocab_size": vocab,
        "eos_id": 2,
        "tokenizer": {},
        "splits": {},
    }
    for split in ("train", "val", "test"):
        np.zeros(tokens, dtype=dtype).tofile(d / f"{split}_00000.bin")
        np.save(d / f"{split}_00000.idx.npy", np.zeros((1, 2), dtype=np.int64))
        meta["splits"][split] = {
            "tokens": tokens,
            "documents": 1,
            "shards": [{"file": f"{split}_00000.bin", "tokens": tokens, "documents": 1}],
        }
    (d / "meta.json").write_text(json.dumps(meta))
    return d


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[str]:
    """``paths.corpora.*`` overrides naming four fake prepared corpora (Llama-2 vocabulary; Llama-3 for the 8B
    Llama recipes)."""
    root = tmp_path_factory.mktemp("corpora")
    names = {
        "slimpajama": LLAMA2_VOCAB,
        "fineweb_edu": LLAMA2_VOCAB,
        "nemotron_cc": LLAMA2_VOCAB,
        "nemotron_cc_llama3": LLAMA3_VOCAB,
    }
    return [f"paths.corpora.{n}={_fake_corpus(root / n, v)}" for n, v in names.items()]


def _job(name: str, corpora: list[str], tmp_path: Path, *extra: str):
    """The one job of ``python train.py experiment=reallife/<name> <corpora> <extra>``, checked by train.py's own
    check_job (no device checks: no GPU here), with the task and model config it builds."""
    from canonlm.config.strict import compose_jobs
    from canonlm.train.run import check_job

    (job,) = compose_jobs(
        [f"experiment=reallife/{name}", *corpora, f"paths.log_dir={tmp_path / 'logs'}", *extra], CONF, "train"
    )
    with job.active() as cfg:
        task, mcfg, _ = check_job(cfg, device_checks=False)
        return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), task, mcfg


def _params(mcfg) -> int:
    import torch

    from canonlm.arch.model import LlamaCanon

    with torch.device("meta"):
        return LlamaCanon(mcfg).num_params()


# ------------------------------------------------------------------------------------------------ Result 12


@pytest.mark.parametrize("name", sorted(RESULT12))
def test_result12_preset_holds_the_papers_numbers(name, corpora, tmp_path):
    arch, canon, pos, heads, lrs = RESULT12[name]
    cfg, task, m = _job(name, corpora, tmp_path)
    assert (m.arch, m.n_layers, m.d_model, m.n_heads) == (arch, 24, 2048, heads)
    assert m.canon.set == canon and m.mlp == "gated" and not m.tie_embeddings
    if pos is not None:
        assert m.pos.type == pos and m.head_dim == 64 and m.ffn_dim == 5632
        assert m.rope_dim == {"rope": 64, "nope": 0, "partial_rope": 16}[pos]
    else:  # recurrent state per layer H x d_k x d_v, the paper's multiple of d
        assert m.n_heads * m.head_k_dim * m.head_v_dim == STATE_PER_D[arch] * 2048
    assert m.vocab_size == LLAMA2_VOCAB
    assert (cfg.task.vocab_size, cfg.task.tokenizer_name) == (LLAMA2_VOCAB, "Llama-2")  # estimated before the corpora
    n = _params(m)
    assert 1.30e9 < n < 1.40e9, n  # "1.3B-class models (~1.35B parameters)"
    # data (default): the two corpora, in this order, concatenated; random 4096-token windows
    assert cfg.task.mix == "concat" and list(cfg.task.sources) == ["slimpajama", "fineweb_edu"]
    assert task.context == 4096 and task.source_names == ["slimpajama", "fineweb_edu"]
    assert cfg.data.batch_size == 48 and cfg.trainer.max_steps == 510_000
    assert cfg.trainer.max_steps * cfg.data.batch_size * task.context == pytest.approx(
        100.2e9, rel=1e-3
    )  # "≈ 100.2B tokens"
    assert list(cfg.optim.betas) == [0.9, 0.98] and cfg.optim.eps == 1e-6 and cfg.optim.weight_decay == 0.03
    assert cfg.optim.lr in lrs
    assert (cfg.sched.name, cfg.sched.warmup_steps, cfg.sched.min_lr_ratio) == ("cosine", 1000, 0.1)  # [gap]: App. A's
    assert cfg.strategy.name == "fsdp2" and cfg.task.seed == 0  # one data order for every architecture


@pytest.mark.parametrize("name", ["llama_1b", "gla_canon_1b"])
def test_result12_multirun_sweeps_the_papers_learning_rates(name, corpora, tmp_path):
    """``-m`` runs the paper's lr set (hydra.sweeper.params); without it, one run; a command-line lr wins."""
    from canonlm.config.strict import compose_jobs

    base = [f"experiment=reallife/{name}", *corpora, f"paths.log_dir={tmp_path / 'logs'}"]
    jobs = compose_jobs(["-m", *base], CONF, "train")
    lrs = []
    for job in jobs:
        with job.active() as cfg:
            lrs.append(cfg.optim.lr)
    assert sorted(lrs) == sorted(RESULT12[name][4])
    assert len(compose_jobs(base, CONF, "train")) == 1
    one = compose_jobs(["-m", *base, "optim.lr=2e-3", "seed=1,2"], CONF, "train")
    assert len(one) == 2


@pytest.mark.parametrize("corpus", ["slimpajama", "fineweb_edu"])
def test_result12_runs_on_one_corpus_alone(corpus, corpora, tmp_path):
    """experiment/reallife/data=<corpus>: the same model and schedule on one prepared corpus (no mixture)."""
    cfg, task, m = _job("gdn_canon_1b", corpora, tmp_path, f"experiment/reallife/data={corpus}")
    assert cfg.task.sources is None and Path(cfg.task.data_dir).name == corpus and not task.is_mixture
    assert (m.arch, m.n_heads, m.canon.set, task.context, cfg.data.batch_size) == ("gdn", 12, "AbCD", 4096, 48)


def test_corpora_named_once_in_a_local_config_serve_a_sweep_over_presets(corpora, tmp_path):
    """The corpora written once into ``local/default.yaml`` (here through ``--config-dir``, as conf/local/ is read):
    a ``-m`` sweep over several presets and the paper's lrs composes and passes check_job for every job."""
    from canonlm.config.strict import compose_jobs
    from canonlm.train.run import check_job

    local = tmp_path / "extra" / "local"
    local.mkdir(parents=True)
    paths = "".join(f"    {c.split('=')[0].rsplit('.', 1)[1]}: {c.split('=')[1]}\n" for c in corpora)
    (local / "default.yaml").write_text("# @package _global_\npaths:\n  corpora:\n" + paths)
    jobs = compose_jobs(
        [
            "--config-dir",
            str(tmp_path / "extra"),
            "-m",
            "experiment=reallife/llama_1b,reallife/gla_canon_1b",
            "optim.lr=1e-3,2e-3",
            f"paths.log_dir={tmp_path / 'logs'}",
        ],
        CONF,
        "train",
    )
    seen = set()
    for job in jobs:
        with job.active() as cfg:
            task, mcfg, _ = check_job(cfg, device_checks=False)
            seen.add((mcfg.arch, cfg.optim.lr))
            assert task.source_names == ["slimpajama", "fineweb_edu"]
    assert seen == {("llama", 1e-3), ("llama", 2e-3), ("gla", 1e-3), ("gla", 2e-3)}


def test_an_unset_corpus_is_refused_naming_it(tmp_path):
    from canonlm.errors import ConfigError

    with pytest.raises(ConfigError, match=r"paths\.corpora\.slimpajama"):
        _job("llama_1b", [], tmp_path)
    with pytest.raises(ConfigError, match=r"paths\.corpora\.nemotron_cc"):
        _job("p42_gla5_conv_1b", [], tmp_path)


def test_a_corpus_of_another_vocabulary_is_refused_for_training(corpora, tmp_path):
    """A preset declares its tokenizer's vocabulary (``task.vocab_size``: Llama-2's 32,000); a prepared corpus whose
    meta.json says 4,096 would train another model than the preset's, so train.py's checks refuse it naming
    ``task.vocab_size``, both numbers and the way out; ``task.vocab_size=4096`` (or null) trains that model, with
    the corpus' vocabulary."""
    from canonlm.errors import ConfigError

    bpe = _fake_corpus(tmp_path / "bpe4096", 4096)
    one = ["experiment/reallife/data=slimpajama", f"paths.corpora.slimpajama={bpe}"]
    with pytest.raises(ConfigError) as e:
        _job("llama_1b", corpora, tmp_path, *one)
    assert (e.value.key, e.value.value) == ("task.vocab_size", LLAMA2_VOCAB)
    assert (
        f"the corpus {bpe} has a vocabulary of 4,096 (its meta.json); task.vocab_size declares 32,000 (the "
        "Llama-2 tokenizer)"
        in e.value.allowed
        and "task.vocab_size=4096 (or null)" in e.value.allowed
    )
    for declared in ("4096", "null"):
        _, task, m = _job(
            "llama_1b", corpora, tmp_path, *one, f"task.vocab_size={declared}", "task.tokenizer_name=null"
        )
        assert m.vocab_size == task.vocab_size == 4096


def test_a_run_resumes_whatever_tokenizer_the_plan_keys_name():
    """``task.vocab_size`` / ``task.tokenizer_name`` describe a plan and change nothing that trains (the model's
    vocabulary is checked through the weights' shapes): a checkpoint written before they existed, or with other
    values, is compared without them; any other task key still counts."""
    from types import SimpleNamespace

    from canonlm.train.checkpoint import _diff
    from canonlm.train.run import _task_cfg_as_saved

    now = {"name": "text", "data_dir": "/d", "context": 4096, "vocab_size": 32000, "tokenizer_name": "Llama-2"}
    for saved in (
        {"name": "text", "data_dir": "/d", "context": 4096},
        {"name": "text", "data_dir": "/d", "context": 4096, "vocab_size": 128256, "tokenizer_name": "x"},
    ):
        assert _diff(saved, _task_cfg_as_saved(now, SimpleNamespace(meta={"task": saved})), "task") == []
    saved = {"name": "text", "data_dir": "/d", "context": 2048}
    assert _diff(saved, _task_cfg_as_saved(now, SimpleNamespace(meta={"task": saved})), "task") == [
        "task.context: checkpoint 2048, config 4096"
    ]


def test_train_py_prints_a_preset_with_cfg_job():
    """``python train.py experiment=reallife/llama_1b --cfg job`` (Hydra's own output; nothing is checked or
    written): the composed job with the paper's numbers."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "experiment=reallife/llama_1b", "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert (cfg.model.size, cfg.model.n_heads, cfg.task.context, cfg.data.batch_size, cfg.trainer.max_steps) == (
        "24L2048D",
        32,
        4096,
        48,
        510_000,
    )
    assert OmegaConf.is_missing(cfg.paths.corpora, "slimpajama")  # named once, by the user


# ------------------------------------------------------------------------------------------------- Part 4.2


@pytest.mark.parametrize("name", sorted(P42))
def test_part42_recipe_holds_the_releases_numbers(name, corpora, tmp_path):
    family, variant, size = P42[name]
    L, d, _ = P42_SHAPE[size]
    cfg, task, m = _job(name, corpora, tmp_path)
    assert (m.n_layers, m.d_model) == (L, d)
    if family == "llama":
        heads, kv, dff, ctx, batch, steps, warm, pairs, qk_z, theta, vocab = P42_LLAMA[size]
        canon = variant == "llamacanon"
        assert (m.arch, m.n_heads, m.kv_heads, m.ffn_dim) == ("llama", heads, kv, dff)
        assert m.canon.set == ("ABCD" if canon else "")
        assert m.pos.type == ("partial_rope" if canon else "rope") and m.pos.theta == theta
        assert m.rope_dim == (m.head_dim // 4 if canon else m.head_dim)  # Canon recipes: rope_dim = d_head / 4
        assert m.pos.pairing == "interleaved" and m.init == "lingua" and m.norm_eps == 1e-5
        assert (m.qk_norm == "whole") == qk_z and (cfg.loss.z_loss == "lingua") == qk_z
        assert m.vocab_size == vocab
        assert (cfg.task.vocab_size, cfg.task.tokenizer_name) == (
            vocab,
            "Llama-2" if vocab == LLAMA2_VOCAB else "Llama-3",
        )
        expect = L * (4 * d * d - 2 * d * d * (heads - kv) // heads + 3 * d * dff + 2 * d) + 2 * vocab * d + d
        n = _params(m)
        extra = n - expect  # QK-norm gains and Canon taps only
        assert 0 <= extra < 0.002 * expect, (n, expect)
    else:
        heads, mlp, ctx, batch, steps, warm, pairs = P42_LINEAR[size]
        assert (m.arch, m.n_heads, m.ffn_dim) == (P42_ARCH[family], heads, mlp)
        assert m.canon.set == ("AbCD" if variant == "canon" else "b")  # the release's AbbCD / bb
        assert m.n_heads * m.head_k_dim * m.head_v_dim == 256 * d  # "recurrent memory 256d for all linear models"
        if family == "mamba2":
            assert (m.ssm_state, m.head_v_dim) == (128, 256)
        else:
            assert (m.head_k_dim, m.head_v_dim, m.output_gate_rank) == (128, 256, 16)
        assert m.vocab_size == LLAMA2_VOCAB
        assert (cfg.task.vocab_size, cfg.task.tokenizer_name) == (LLAMA2_VOCAB, "Llama-2")
        per_layer = (12 if size != "8b" else 6 + 3 * mlp / d) * d * d  # ≈ 6d² mixer + 3·d·I MLP
        n = _params(m)
        assert n == pytest.approx(L * per_layer + 2 * LLAMA2_VOCAB * d, rel=0.06)
    assert (task.context, cfg.data.batch_size, cfg.trainer.max_steps, cfg.sched.warmup_steps) == (
        ctx,
        batch,
        steps,
        warm,
    )
    assert ctx * batch * steps == pytest.approx(1.0e12, rel=0.01)  # 1T tokens
    assert (cfg.optim.lr, cfg.optim.weight_decay) == pairs[0]
    text = (PRESETS / f"{name}.yaml").read_text()  # the other pairs are given in the preset's comment
    for lr, wd in pairs[1:]:
        assert f"optim.lr={lr:.1e} optim.weight_decay={wd}".replace("e-0", "e-") in text
    # common settings
    assert list(cfg.optim.betas) == [0.9, 0.95] and cfg.optim.eps == 1e-8 and cfg.trainer.gradient_clip_val == 1.0
    assert (cfg.sched.name, cfg.sched.min_lr_ratio) == ("cosine", 0.01)
    assert cfg.seed == 777 and cfg.compile is True and cfg.activation_checkpointing is False
    assert (cfg.strategy.name, cfg.strategy.param_dtype, cfg.strategy.reduce_dtype) == ("fsdp2", "bf16", "fp32")
    assert cfg.task.sources is None and not task.is_mixture
