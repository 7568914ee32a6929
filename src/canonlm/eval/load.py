"""Load a trained model from a run directory or a checkpoint file.

A training run (``python train.py ...``) lives in ``logs/<task_name>/runs/<run_name>/`` and holds
``.hydra/config.yaml`` (the composed config, written by Hydra), ``.hydra/hydra.yaml`` (Hydra's runtime: the original
working directory) and ``checkpoints/last.ckpt`` (Lightning; model weights under ``state_dict`` with keys prefixed
``model.``); :mod:`canonlm.config.rundir` finds and reads them. :func:`load_model` rebuilds the model config exactly
as training did (:func:`canonlm.config.build.build_configs`), builds :class:`canonlm.arch.model.CanonLM`, loads the weights, switches
to eval mode and wraps it in :class:`canonlm.data.lm.LanguageModel` (through a forward object that offers the
model's ``new_cache()``, so generation decodes with caches instead of re-running every prefix).

A checkpoint without a run's ``.hydra/config.yaml`` beside it (``python -m canonlm.export --from-hf`` output, or a
training checkpoint copied out of its run directory) loads too when it records its model:
``checkpoint["canonlm"]["model"]`` (a ``ModelConfig`` as a dict) gives the model config and
``checkpoint["canonlm"]["task"]`` the task (``{"name": "hf_import", "context": ...}`` for an imported model).

The model may be rebuilt with a longer ``max_seq_len`` than it was trained with (RoPE tables are computed, not
stored), so length-generalisation evaluations (multi-hop L = 5k / 6k after 4k training) can run.

Precision: by default the model computes as its training run did (:func:`eval_precision`: the run's
``trainer.precision`` and FSDP2 ``strategy.param_dtype``, reproduced the way Lightning runs them), so an evaluation
gives the loss and accuracy the run reported, and a kernel that only runs in fp16/bf16
(``model.kernels.attention=flash``) is placed in the dtype it was trained in. ``precision=`` overrides it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping

import torch

from canonlm.config.build import build_configs
from canonlm.config.rules import PRECISIONS
from canonlm.config.rundir import has_run_config, load_run_config, read_checkpoint, resolve_run
from canonlm.data.lm import LanguageModel
from canonlm.errors import ConfigError

#: ``precision=`` names kept from earlier versions: ``fp32`` = ``32-true``, ``bf16`` = ``bf16-mixed``.
PRECISION_ALIASES = {"fp32": "32-true", "bf16": "bf16-mixed"}


@dataclass(frozen=True)
class EvalPrecision:
    """How a loaded model computes (chosen by :func:`eval_precision`).

    name: the Lightning ``trainer.precision`` it reproduces (``32-true`` | ``32`` | ``bf16-mixed`` | ``16-mixed`` |
    ``bf16-true`` | ``64-true``). param_dtype: the parameters' dtype (float32; bfloat16 for ``bf16-true`` or an FSDP2
    bf16 ``param_dtype``; float64 for ``64-true``). autocast: the ``torch.autocast`` dtype of a mixed precision
    (bfloat16 / float16), else None. device_type: the autocast device type (``cpu`` | ``cuda``). source: where the
    choice came from (the run's config, the saved weights, or ``precision=``), for messages and results files.
    """

    name: str
    param_dtype: torch.dtype
    autocast: torch.dtype | None
    device_type: str
    source: str

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the kernels see (what ``CanonLM.place`` resolves for): the autocast dtype, else the
        parameters'."""
        return self.autocast or self.param_dtype

    def context(self) -> ContextManager:
        """A new context manager for one forward pass: ``torch.autocast(device_type, dtype=autocast,
        cache_enabled=False)`` (Lightning's ``MixedPrecision.autocast_context_manager``), or a null context."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast, cache_enabled=False)

    def describe(self) -> dict[str, str | None]:
        """JSON-able summary: name, param_dtype, autocast (dtype names such as ``bfloat16``), source."""

        def short(d: torch.dtype | None) -> str | None:
            return None if d is None else str(d).removeprefix("torch.")

        return dict(
            name=self.name, param_dtype=short(self.param_dtype), autocast=short(self.autocast), source=self.source
        )


def check_precision(precision: str, key: str = "precision") -> str:
    """``precision`` with an alias replaced (``fp32`` -> ``32-true``, ``bf16`` -> ``bf16-mixed``): ``auto`` or a
    ``trainer.precision`` name training accepts (:data:`canonlm.config.rules.PRECISIONS`). Raises ConfigError(key,
    precision, allowed) for anything else."""
    allowed = ("auto", *PRECISIONS, *PRECISION_ALIASES)
    if precision not in allowed:
        raise ConfigError(key, precision, " | ".join(allowed))
    return PRECISION_ALIASES.get(precision, precision)


def eval_precision(
    precision: str, device: torch.device | str, cfg: Any = None, state_dict: Mapping[str, torch.Tensor] | None = None
) -> EvalPrecision:
    """The precision a model runs in on ``device`` for evaluation and generation: its training run's, unless
    overridden.

    Args:
        precision: ``auto`` = the training run's: ``trainer.precision`` of ``cfg`` and, when it trained with
            ``strategy.name=fsdp2``, its ``strategy.param_dtype`` (``bf16``: FSDP2's ``MixedPrecisionPolicy`` ran
            the forward on bf16 copies of the parameters); without ``cfg``, the dtype of the floating tensors of
            ``state_dict`` (all bfloat16: ``bf16-true``, all float64: ``64-true``, else ``32-true``; imported and
            exported models are float32). Otherwise a ``trainer.precision`` name or alias (:func:`check_precision`)
            used whatever the run trained in.
        device: where the model runs. cfg: the run's composed config (DictConfig) or None. state_dict: the saved
            weights (read only without ``cfg``).
    Each precision runs as Lightning runs it (``_AcceleratorConnector._check_and_init_precision`` in
    ``lightning/pytorch/trainer/connectors/accelerator_connector.py``, plugins in
    ``lightning/pytorch/plugins/precision/``): ``32-true``: fp32 parameters (``Precision``); ``bf16-mixed`` /
    ``16-mixed``: fp32 parameters under ``torch.autocast(device type, bf16 / fp16)`` (``MixedPrecision``), and
    ``16-mixed`` off CUDA is ``bf16-mixed`` (Lightning: "AMP with fp16 is not supported on CPU"); ``bf16-true`` /
    ``64-true``: parameters cast to bf16 / fp64 (``HalfPrecision`` / ``DoublePrecision.convert_module``). So a bf16
    run evaluated on the CPU runs under CPU bf16 autocast, as Lightning trained and tested it there, and gives the
    test loss and accuracy the run reported.
    Returns :class:`EvalPrecision`.
    Raises ConfigError("precision", value, allowed) for an unknown ``precision``, ConfigError("trainer.precision",
    value, allowed) when the run's config holds one training does not accept.
    """
    name = check_precision(precision)
    dev = torch.device(device)
    fsdp = None
    source = f"precision={precision}"
    if name == "auto" and cfg is not None:
        name = str(cfg.trainer.get("precision"))
        source = f"the run's trainer.precision={name}"
        strategy = cfg.get("strategy") or {}
        if strategy.get("name") == "fsdp2":
            fsdp = str(strategy.get("param_dtype", "bf16"))
            source += f" with FSDP2 strategy.param_dtype={fsdp}"
        if name not in PRECISIONS:
            raise ConfigError("trainer.precision", name, " | ".join(PRECISIONS) + " (or pass the precision to use)")
    elif name == "auto":
        floats = {v.dtype for v in (state_dict or {}).values() if torch.is_floating_point(v)}
        saved = floats.pop() if len(floats) == 1 else torch.float32
        name = {torch.bfloat16: "bf16-true", torch.float64: "64-true"}.get(saved, "32-true")
        source = f"the saved {str(saved).removeprefix('torch.')} weights (no run config)"
    if name == "16-mixed" and dev.type != "cuda":
        name = "bf16-mixed"
        source += " (16-mixed runs as bf16-mixed off CUDA, as in Lightning)"
    param = (
        torch.bfloat16
        if fsdp == "bf16"
        else {"bf16-true": torch.bfloat16, "64-true": torch.float64}.get(name, torch.float32)
    )
    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(name)
    return EvalPrecision(name, param, autocast, dev.type, source)


@dataclass
class LoadedModel:
    """A trained model ready for evaluation.

    model: ``CanonLM`` in eval mode on ``device``. lm: the :class:`LanguageModel` around it (greedy generation with
    decode caches / log-probabilities; ``max_len`` = ``model_cfg.max_seq_len``). cfg: the run's composed config
    (DictConfig), or None for a checkpoint loaded from its recorded metadata (no ``.hydra/config.yaml``). task_cfg:
    the resolved ``task`` node (dict; ``checkpoint["canonlm"]["task"]`` without a run config). model_cfg: the rebuilt
    ``ModelConfig``. run_dir / ckpt: where it was loaded from (run_dir = the checkpoint's folder, or the run above
    ``checkpoints/``). step: the checkpoint's global step (None if not recorded). trained_context: ``task.context``
    (the recorded ``max_seq_len`` when the task has none). precision: how it computes (:class:`EvalPrecision`;
    ``lm`` runs every forward pass under ``precision.context()``).
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
    precision: EvalPrecision

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (paths, step, architecture, precision)."""
        m = self.model_cfg
        return dict(
            run_dir=str(self.run_dir),
            ckpt=str(self.ckpt),
            step=self.step,
            arch=m.arch,
            size=f"{m.n_layers}L{m.d_model}D",
            n_heads=m.n_heads,
            canon=m.canon.set,
            pos=m.pos.type,
            vocab_size=m.vocab_size,
            trained_context=self.trained_context,
            max_seq_len=m.max_seq_len,
            params=int(self.model.num_params()),
            task=self.task_cfg.get("name"),
            precision=self.precision.describe(),
        )


def _kernel_cache(cfg) -> None:
    """Configure the kernel cache (:func:`canonlm.utils.kernel_cache.configure`) as the run did: its
    ``paths.kernel_cache`` when the run's config records one, else ``$CANONLM_KERNEL_CACHE`` or the default, so that
    evaluation and generation reuse the kernels training compiled. A recorded directory that no longer works falls
    back to the default (the run's weights do not depend on it)."""
    from canonlm.errors import ConfigError
    from canonlm.utils.kernel_cache import configure

    recorded = None
    if cfg is not None and cfg.get("paths") is not None:
        recorded = cfg.paths.get("kernel_cache")
    try:
        configure(recorded if isinstance(recorded, str) else None)
    except ConfigError:
        configure(None)


def load_model(
    run: str | Path,
    *,
    ckpt: str | Path | None = None,
    device: str = "auto",
    max_seq_len: int | None = None,
    batch_size: int = 8,
    precision: str = "auto",
) -> LoadedModel:
    """Rebuild and load a trained model.

    Args:
        run: run directory, or a checkpoint file inside ``<run>/checkpoints/``; or, without ``.hydra/config.yaml``,
            a checkpoint file / directory with ``checkpoints/last.ckpt`` whose ``checkpoint["canonlm"]`` records the
            model (module docstring).
        ckpt: checkpoint file (default ``<run>/checkpoints/last.ckpt``).
        device: ``auto`` (cuda if available) | ``cpu`` | ``cuda`` | ``cuda:N``.
        max_seq_len: positions the rebuilt model accepts (default: the trained context); may exceed it.
        batch_size: prompts per forward pass of the returned :class:`LanguageModel`.
        precision: ``auto`` (the run's training precision) or a ``trainer.precision`` name / ``fp32`` / ``bf16``
            that overrides it (:func:`eval_precision`). The parameters are cast to its ``param_dtype``, the model
            is placed for its ``compute_dtype`` and ``lm`` runs under its autocast.
    Returns a :class:`LoadedModel`.
    Raises FileNotFoundError (run / config / checkpoint missing), ConfigError (an unknown ``precision``, checked
        first; the run's or the recorded config no longer builds, e.g. a moved ``task.data_dir``; or a pinned
        kernel / ``ops=fused`` that cannot run on the device in the compute dtype: ``CanonLM.place`` after the
        move), ValueError (bad device, an unreadable checkpoint, or weights that do not fit the model).
    """
    from canonlm.arch.model import CanonLM

    check_precision(precision)
    run_dir, ck = resolve_run(run, ckpt)
    state = read_checkpoint(ck)
    if has_run_config(run_dir):
        cfg = load_run_config(run_dir)
        _, mcfg = build_configs(cfg)
        from omegaconf import OmegaConf

        task_cfg = OmegaConf.to_container(cfg.task, resolve=True)
    else:  # resolve_run checked that the checkpoint records its model
        from canonlm.arch.config import build_model_config

        meta = state["canonlm"]
        cfg, md = None, dict(meta["model"])
        canon, pos = md.pop("canon", None), md.pop("pos", None)
        try:
            mcfg = build_model_config(md, canon, pos)
        except TypeError as e:  # an unknown field: ConfigError itself propagates
            raise ValueError(f"checkpoint {ck}: its recorded model config does not build: {e}") from None
        task_cfg = dict(meta.get("task") or {})
    trained = int(task_cfg.get("context") or mcfg.max_seq_len)
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
    sd = state.get("state_dict", state)
    sd = {k[len("model.") :]: v for k, v in sd.items() if k.startswith("model.")} or dict(sd)
    prec = eval_precision(precision, dev, cfg, sd)
    model = CanonLM(mcfg)  # backends are resolved below, for the device and dtype it runs in
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {ck} does not fit the run's model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.eval().to(dev, dtype=prec.param_dtype)
    _kernel_cache(cfg)
    model.place(dev, prec.compute_dtype)  # ConfigError when a pinned kernel / ops=fused cannot run there

    forward = ModelForward(model, context=prec.context)
    lm = LanguageModel(forward, vocab_size=mcfg.vocab_size, device=dev, batch_size=batch_size, max_len=mcfg.max_seq_len)
    step = state.get("global_step") if isinstance(state, dict) else None
    return LoadedModel(
        model=model,
        lm=lm,
        cfg=cfg,
        task_cfg=task_cfg,
        model_cfg=mcfg,
        run_dir=run_dir,
        ckpt=ck,
        device=dev,
        step=None if step is None else int(step),
        trained_context=trained,
        precision=prec,
    )


class ModelForward:
    """The forward object :func:`load_model` hands to :class:`LanguageModel`: ``__call__(ids, cache=None)`` runs the
    model (inside ``context()`` when given, e.g. :meth:`EvalPrecision.context`: the autocast of a mixed precision)
    and, when the model has ``new_cache()``, so does this object -- ``LanguageModel`` then generates with decode
    caches (O(T) token-forwards instead of re-running every prefix). Same role as
    :class:`canonlm.generate.CachedForward`, without its top-k truncation."""

    def __init__(self, model: Any, context: Callable[[], ContextManager] | None = None):
        self.model = model
        self.context = context or contextlib.nullcontext
        if callable(getattr(model, "new_cache", None)):
            self.new_cache = self._new_cache

    def _new_cache(self) -> Any:
        return self.model.new_cache()

    def __call__(self, ids: torch.Tensor, cache: Any = None) -> torch.Tensor:
        with self.context():
            return self.model(ids) if cache is None else self.model(ids, cache)


__all__ = [
    "EvalPrecision",
    "LoadedModel",
    "ModelForward",
    "check_precision",
    "eval_precision",
    "load_model",
    "PRECISION_ALIASES",
]
