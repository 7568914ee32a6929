"""Load a trained model from a run directory or a checkpoint file.

A training run (``python train.py ...``) lives in ``logs/<task_name>/runs/<run_name>/`` and holds
``.hydra/config.yaml`` (the composed config, written by Hydra), ``.hydra/hydra.yaml`` (Hydra's runtime: the original
working directory) and ``checkpoints/last.ckpt`` (Lightning; model weights under ``state_dict`` with keys prefixed
``model.``). :func:`load_model` rebuilds the model config exactly as training did
(:func:`canonlm.train.run.build_configs`), builds :class:`canonlm.arch.model.CanonLM`, loads the weights, switches
to eval mode and wraps it in :class:`canonlm.data.lm.LanguageModel`.

The model may be rebuilt with a longer ``max_seq_len`` than it was trained with (RoPE tables are computed, not
stored), so length-generalisation evaluations (multi-hop L = 5k / 6k after 4k training) can run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from canonlm.data.lm import LanguageModel

CHECKPOINT = Path("checkpoints") / "last.ckpt"


@dataclass
class LoadedModel:
    """A trained model ready for evaluation.

    model: ``CanonLM`` in eval mode on ``device``. lm: the :class:`LanguageModel` around it (greedy generation /
    log-probabilities; ``max_len`` = ``model_cfg.max_seq_len``). cfg: the run's composed config (DictConfig).
    task_cfg: the resolved ``task`` node (dict). model_cfg: the rebuilt ``ModelConfig``. run_dir / ckpt: where it was
    loaded from. step: the checkpoint's global step (None if not recorded). trained_context: ``task.context``.
    """

    model: Any
    lm: LanguageModel
    cfg: Any
    task_cfg: dict[str, Any]
    model_cfg: Any
    run_dir: Path
    ckpt: Path
    device: torch.device
    step: int | None
    trained_context: int

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (paths, step, architecture)."""
        m = self.model_cfg
        return dict(run_dir=str(self.run_dir), ckpt=str(self.ckpt), step=self.step, arch=m.arch,
                    size=f"{m.n_layers}L{m.d_model}D", n_heads=m.n_heads, canon=m.canon.set, pos=m.pos.type,
                    vocab_size=m.vocab_size, trained_context=self.trained_context, max_seq_len=m.max_seq_len,
                    params=int(self.model.num_params()), task=self.task_cfg.get("name"))


def resolve_run(run: str | Path, ckpt: str | Path | None = None) -> tuple[Path, Path]:
    """(run directory, checkpoint file) for ``run`` = a run directory or a ``.ckpt`` file inside
    ``<run>/checkpoints/``. ``ckpt`` overrides the checkpoint (default ``<run>/checkpoints/last.ckpt``).
    Raises FileNotFoundError naming what is missing."""
    p = Path(run).expanduser()
    if p.is_file():
        ck = p
        run_dir = p.parent.parent if p.parent.name == "checkpoints" else p.parent
    elif p.is_dir():
        run_dir = p
        ck = p / CHECKPOINT
    else:
        raise FileNotFoundError(f"--run {run}: no such run directory or checkpoint file")
    if ckpt is not None:
        ck = Path(ckpt).expanduser()
    if not (run_dir / ".hydra" / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} has no .hydra/config.yaml (not a run directory written by train.py)")
    if ck.is_dir():
        raise FileNotFoundError(f"{ck} is a directory (a distributed FSDP2 checkpoint); consolidate it to a single "
                                "file first (lightning.pytorch.utilities.consolidate_checkpoint)")
    if not ck.is_file():
        raise FileNotFoundError(f"checkpoint {ck} does not exist")
    return run_dir.resolve(), ck.resolve()


def load_run_config(run_dir: str | Path):
    """The run's composed config with Hydra-runtime paths made concrete (``paths.root_dir`` = the run's original
    working directory from ``.hydra/hydra.yaml``, ``paths.output_dir`` = ``run_dir``), so it resolves outside Hydra;
    a relative ``task.data_dir`` that does not exist from here is resolved against that working directory."""
    from omegaconf import OmegaConf, open_dict

    from canonlm.train.resolvers import register_resolvers

    register_resolvers()
    run_dir = Path(run_dir)
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    cwd = None
    hy = run_dir / ".hydra" / "hydra.yaml"
    if hy.is_file():
        cwd = OmegaConf.select(OmegaConf.load(hy), "hydra.runtime.cwd", default=None)
    with open_dict(cfg):
        if "paths" in cfg:
            cfg.paths.root_dir = str(cwd or Path.cwd())
            cfg.paths.output_dir = str(run_dir)
            if "log_dir" in cfg.paths and "hydra:" in str(OmegaConf.to_container(cfg.paths)["log_dir"]):
                cfg.paths.log_dir = str(Path(cfg.paths.root_dir) / "logs")
        dd = OmegaConf.select(cfg, "task.data_dir", default=None)
        if isinstance(dd, str) and dd and not Path(dd).is_absolute() and not Path(dd).exists() and cwd:
            if (Path(cwd) / dd).exists():
                cfg.task.data_dir = str(Path(cwd) / dd)
    return cfg


def _load_state(ck: Path) -> dict[str, Any]:
    """The checkpoint dict, read with ``torch.load(weights_only=True)`` (no pickled code runs; canonlm's own
    checkpoints hold only tensors and plain values). Raises ValueError naming the file when it cannot be read that
    way (damaged, or a foreign file that pickles objects)."""
    try:
        return torch.load(ck, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- reported with the reader's first line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise ValueError(f"checkpoint {ck} cannot be read with torch.load(weights_only=True): {first[:300]}; "
                         "canonlm never unpickles code from a checkpoint") from None


def load_model(run: str | Path, *, ckpt: str | Path | None = None, device: str = "auto",
               max_seq_len: int | None = None, batch_size: int = 8, precision: str = "fp32") -> LoadedModel:
    """Rebuild and load a trained model.

    Args:
        run: run directory, or a checkpoint file inside ``<run>/checkpoints/``.
        ckpt: checkpoint file (default ``<run>/checkpoints/last.ckpt``).
        device: ``auto`` (cuda if available) | ``cpu`` | ``cuda`` | ``cuda:N``.
        max_seq_len: positions the rebuilt model accepts (default: the trained context); may exceed it.
        batch_size: prompts per forward pass of the returned :class:`LanguageModel`.
        precision: ``fp32`` | ``bf16`` (autocast on CUDA).
    Returns a :class:`LoadedModel`.
    Raises FileNotFoundError (run / config / checkpoint missing), ConfigError (the run's config no longer builds,
        e.g. a moved ``task.data_dir``, or a pinned kernel / ``ops=fused`` that cannot run on the device in the
        compute dtype: ``CanonLM.place`` after the move), ValueError (bad device / precision, or weights that do
        not fit the model).
    """
    from canonlm.arch.model import CanonLM
    from canonlm.train.run import build_configs

    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r} is not allowed; allowed: fp32 | bf16")
    run_dir, ck = resolve_run(run, ckpt)
    cfg = load_run_config(run_dir)
    _, mcfg = build_configs(cfg)
    from omegaconf import OmegaConf

    task_cfg = OmegaConf.to_container(cfg.task, resolve=True)
    trained = int(task_cfg["context"])
    if max_seq_len is not None:
        if int(max_seq_len) < 1:
            raise ValueError(f"max_seq_len={max_seq_len!r} is not allowed; allowed: an integer >= 1")
        mcfg = dataclasses.replace(mcfg, max_seq_len=int(max_seq_len))
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"device={device!r} is not allowed; allowed: auto | cpu | cuda | cuda:N") from None
    state = _load_state(ck)
    sd = state.get("state_dict", state)
    sd = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")} or dict(sd)
    model = CanonLM(mcfg)  # backends are resolved below, for the device and dtype it runs in
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {ck} does not fit the run's model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    model.eval().to(dev)
    dtype = torch.bfloat16 if precision == "bf16" and dev.type == "cuda" else torch.float32
    model.place(dev, dtype)  # ConfigError when a pinned kernel / ops=fused cannot run on (dev, dtype)

    def forward(x: torch.Tensor) -> torch.Tensor:
        ctx = (torch.autocast("cuda", dtype=torch.bfloat16) if dtype == torch.bfloat16
               else contextlib.nullcontext())
        with ctx:
            return model(x)

    lm = LanguageModel(forward, vocab_size=mcfg.vocab_size, device=dev, batch_size=batch_size,
                       max_len=mcfg.max_seq_len)
    step = state.get("global_step") if isinstance(state, dict) else None
    return LoadedModel(model=model, lm=lm, cfg=cfg, task_cfg=task_cfg, model_cfg=mcfg, run_dir=run_dir, ckpt=ck,
                       device=dev, step=None if step is None else int(step), trained_context=trained)


def run_tokenizer(task_cfg: dict[str, Any]) -> tuple[str | None, str | None]:
    """(tokenizer path, eos token) recorded by a ``text`` run's prepared data (meta.json); (None, None) for other
    tasks or when the meta is unreadable."""
    if task_cfg.get("name") != "text" or not task_cfg.get("data_dir"):
        return None, None
    f = Path(task_cfg["data_dir"]) / "meta.json"
    try:
        t = json.loads(f.read_text()).get("tokenizer", {})
    except (OSError, json.JSONDecodeError):
        return None, None
    return t.get("path"), t.get("eos_token")


__all__ = ["LoadedModel", "load_model", "resolve_run", "load_run_config", "run_tokenizer", "CHECKPOINT"]
