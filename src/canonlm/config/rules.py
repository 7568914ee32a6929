"""The accepted values of the training keys, declared once as a table and checked by one loop.

Each :class:`Rule` says what one key of the composed config (``conf/train.yaml`` and its groups) accepts: a type,
allowed values, a range, whether it may be null or absent, and the ``allowed`` text of the error. Training checks
the whole table before anything is built or written (:func:`check_training`); the callbacks that receive one of
these values directly (``StepCheckpoint``, ``Preemption``) check it against the same rule (:func:`check_value`), so
each rule is written here only. Keys whose checks need the model or the task (``model.*``, ``canon.*``,
``task.*``) are checked where those are built (:func:`canonlm.arch.config.build_model_config`, the task classes).

Errors are :class:`canonlm.errors.ConfigError` (``invalid config: <key>=<value>; allowed: <allowed>``).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, ListConfig, OmegaConf

from canonlm.errors import ConfigError

#: ``strategy.name`` options (``conf/strategy/*.yaml``).
STRATEGIES = ("auto", "ddp", "ddp_spawn", "fsdp2")
#: ``sched.name`` options (:func:`canonlm.train.schedule.lr_multiplier`).
SCHEDULES = ("cosine", "linear", "constant", "wsd")
#: ``trainer.precision`` values training accepts (Lightning's names; see :func:`canonlm.eval.load.eval_precision`).
PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "64-true")

_ABSENT = object()


def plain(v: Any) -> Any:
    """``v`` as plain Python containers (interpolations resolved) when it is an OmegaConf node, else ``v``."""
    return OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v


def _betas(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v)


def _existing_or_auto(v: Any) -> bool:
    return v == "auto" or Path(str(v)).exists()


def _steps_or_fraction(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return v >= 1 if isinstance(v, int) else 0 < v <= 1


def _catchable_signal(v: Any) -> bool:
    """A signal name Python can install a handler for, other than SIGTERM (which Preemption always handles)."""
    return isinstance(getattr(signal, str(v), None), signal.Signals) and v not in ("SIGKILL", "SIGSTOP", "SIGTERM")


@dataclass(frozen=True)
class Rule:
    """What one config key accepts.

    key: dotted path in the composed config. allowed: the error's ``allowed`` text. type: ``int`` (an integer, not a
    bool), ``float`` (an int or float, not a bool), ``bool``, ``str`` or None (any). choices: allowed values
    (compared as ``str(value)``). min / above: inclusive / exclusive lower bound. null: None is accepted. optional:
    the key may be absent (its default in the code that reads it applies); a rule under a node that is null or
    absent (a disabled callback) is skipped. test: a further predicate for what a type and a range cannot say.
    """

    key: str
    allowed: str
    type: type | None = None
    choices: tuple[str, ...] = ()
    min: float | None = None
    above: float | None = None
    null: bool = False
    optional: bool = False
    test: Callable[[Any], bool] | None = None

    def accepts(self, v: Any) -> bool:
        """Whether ``v`` (a plain Python value) is allowed."""
        if v is None:
            return self.null
        if self.type in (int, float) and isinstance(v, bool):
            return False
        if self.type is not None and not isinstance(v, (int, float) if self.type is float else self.type):
            return False
        if self.choices and str(v) not in self.choices:
            return False
        if self.min is not None and not v >= self.min:
            return False
        if self.above is not None and not v > self.above:
            return False
        return self.test is None or bool(self.test(v))

    def problem(self, cfg: DictConfig) -> ConfigError | None:
        """The error for this key of ``cfg``, or None when its value is allowed (or the rule does not apply)."""
        parent, _, _ = self.key.rpartition(".")
        if parent and not isinstance(OmegaConf.select(cfg, parent, default=None), DictConfig):
            return None  # a disabled node (callbacks.checkpoint: null)
        v = plain(OmegaConf.select(cfg, self.key, default=_ABSENT))
        if v is _ABSENT:
            if self.optional:
                return None
            v = None
        return None if self.accepts(v) else ConfigError(self.key, v, self.allowed)


@dataclass(frozen=True)
class KnownKeys:
    """The node ``key`` may hold only the keys ``names``; another is refused naming it and the known ones."""

    key: str
    names: tuple[str, ...]

    def problem(self, cfg: DictConfig) -> ConfigError | None:
        node = OmegaConf.select(cfg, self.key, default=None)
        if node is not None and not isinstance(node, DictConfig):
            return ConfigError(self.key, plain(node), f"null or a mapping of {', '.join(self.names)}")
        unknown = sorted(set(node or {}) - set(self.names))
        if not unknown:
            return None
        return ConfigError(f"{self.key}.{unknown[0]}", plain(node[unknown[0]]), f"a known key: {', '.join(self.names)}")


_POSITIVE = "a positive integer"

#: The training keys, in the order they are checked (the first bad one is reported).
TRAINING_RULES: tuple[Rule | KnownKeys, ...] = (
    Rule("loss.z_loss", "none | lingua | palm", choices=("none", "lingua", "palm"), optional=True),
    Rule("loss.z_coef", "a number >= 0", float, min=0),
    Rule("optim.betas", "two numbers in [0, 1), e.g. [0.9, 0.98]", null=True, optional=True, test=_betas),
    Rule("optim.eps", "a positive number", float, above=0, null=True, optional=True),
    Rule("optim.weight_decay", "a number >= 0", float, min=0, null=True, optional=True),
    Rule("strategy.name", " | ".join(STRATEGIES), choices=STRATEGIES),
    Rule("trainer.precision", " | ".join(PRECISIONS), choices=PRECISIONS),
    Rule("trainer.max_steps", "a positive integer (training is step-based)", int, min=1),
    Rule("optim.lr", "a positive float", float, above=0),
    Rule("sched.name", " | ".join(SCHEDULES), choices=SCHEDULES),
    Rule("sched.warmup_steps", "an integer >= 0 (optimizer steps of linear warm-up)", int, min=0, null=True,
         optional=True),
    Rule("sched.min_lr_ratio", "a number in [0, 1] (the final lr as a fraction of optim.lr)", float, min=0,
         optional=True, test=lambda v: v <= 1),
    Rule("sched.decay_fraction", "a number in (0, 1] (wsd: the last fraction of steps that decays; checked for "
         "every schedule)", float, above=0, optional=True, test=lambda v: v <= 1),
    Rule("ckpt_path", "null | auto | an existing checkpoint path", null=True, optional=True, test=_existing_or_auto),
    Rule("data.batch_size", _POSITIVE, int, min=1),
    Rule("trainer.accumulate_grad_batches", _POSITIVE, int, min=1, optional=True),
    Rule("trainer.val_check_interval", "null, a positive integer (optimizer steps) or a fraction of an epoch in (0, 1]",
         null=True, optional=True, test=_steps_or_fraction),
    Rule("data.val_windows", _POSITIVE, int, min=1),
    Rule("data.test_windows", _POSITIVE, int, min=1),
    Rule("callbacks.checkpoint.keep_last", "null (keep all) or a positive integer", int, min=1, null=True,
         optional=True),
    Rule("callbacks.checkpoint.every_n_train_steps", _POSITIVE, int, min=1, optional=True),
    Rule("callbacks.preemption.signal_name", "a catchable signal name other than SIGTERM, e.g. SIGUSR2 or SIGUSR1",
         str, optional=True, test=_catchable_signal),
    Rule("max_nonfinite_steps", "a positive integer (consecutive skipped steps before the run stops)", int, min=1,
         optional=True),
    Rule("data.num_workers", "an integer >= 0", int, min=0),
    KnownKeys("data.gen_eval", ("samples", "batch_size", "on_val")),
    Rule("data.gen_eval.samples", "null (the task's default) or an integer >= 0", int, min=0, null=True,
         optional=True),
    Rule("data.gen_eval.batch_size", _POSITIVE, int, min=1, optional=True),
    Rule("data.gen_eval.on_val", "true | false", bool, optional=True),
)
_BY_KEY = {r.key: r for r in TRAINING_RULES if isinstance(r, Rule)}


def check_training(cfg: DictConfig, rules: tuple[Rule | KnownKeys, ...] = TRAINING_RULES) -> None:
    """Check every rule of ``rules`` against the composed config ``cfg``, in order; raises ConfigError for the first
    key whose value is not allowed."""
    for rule in rules:
        err = rule.problem(cfg)
        if err is not None:
            raise err


def check_value(key: str, value: Any) -> Any:
    """``value`` when the rule of ``key`` (a key of :data:`TRAINING_RULES`) accepts it; raises ConfigError(key, value,
    allowed) otherwise, and KeyError for a key without a rule."""
    rule = _BY_KEY[key]
    if not rule.accepts(plain(value)):
        raise ConfigError(key, plain(value), rule.allowed)
    return value


def micro_batch(batch_size: int, world_size: int, accumulate: int) -> int:
    """Windows per rank per micro-batch: ``data.batch_size`` (global windows per optimizer step) split over
    ``world_size`` ranks x ``accumulate`` (``trainer.accumulate_grad_batches``) micro-batches. Raises
    ConfigError("data.batch_size", ...) unless it divides evenly."""
    parts = world_size * accumulate
    if batch_size < 1 or parts < 1 or batch_size % parts:
        raise ConfigError("data.batch_size", batch_size,
                          f"a positive multiple of world_size x accumulate_grad_batches = {world_size} x {accumulate}")
    return batch_size // parts


__all__ = ["PRECISIONS", "SCHEDULES", "STRATEGIES", "KnownKeys", "Rule", "TRAINING_RULES", "check_training", "check_value",
           "micro_batch", "plain"]
