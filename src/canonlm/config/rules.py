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
    return (
        isinstance(v, list)
        and len(v) == 2
        and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v)
    )


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
    when: ``(key, values)``: the key is read only when ``key`` has one of ``values`` (otherwise its presence is an
    unknown key, :func:`canonlm.config.strict.check_keys`).
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
    when: tuple[str, tuple[str, ...]] | None = None

    def applies(self, cfg: DictConfig) -> bool:
        """Whether canonlm reads this key under ``cfg``'s choices: always, or (``when = (key, values)``) only when
        ``key`` has one of ``values`` (``strategy.find_unused_parameters`` only for ``strategy.name=ddp``)."""
        if self.when is None:
            return True
        return str(plain(OmegaConf.select(cfg, self.when[0], default=None))) in self.when[1]

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
        if not self.applies(cfg):
            return None
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
#: The ``allowed`` text of every boolean key (``train=no`` is refused, not read as true).
BOOL = "true or false"
#: The largest seed ``lightning.seed_everything`` takes (numpy's uint32 range; a larger one is replaced by 0).
MAX_SEED = 2**32 - 1
_DDP, _FSDP = ("strategy.name", ("ddp", "ddp_spawn")), ("strategy.name", ("fsdp2",))
_BACKEND = "null (follow `ops`) or a backend name (auto, reference, ...; docs/models.md)"


def _canon_letters_once(v: Any) -> bool:
    """``canonlm.arch.config.canon_set``'s rule on repeated letters, restated so that it is checked before torch
    loads (``canonlm.arch`` imports it): each letter once, ``b`` at most twice; tests/test_refusals.py checks that
    both accept the same strings."""
    return not isinstance(v, str) or all(v.count(c) <= (2 if c == "b" else 1) for c in set(v))


def _folder_name(v: Any) -> bool:
    """One path component: a non-empty name without ``/`` or ``\\`` that is not ``.`` or ``..`` (so the run directory
    stays inside ``paths.log_dir``)."""
    if not isinstance(v, (str, int)) or isinstance(v, bool):
        return False
    s = str(v)
    return s not in ("", ".", "..") and "/" not in s and "\\" not in s and "\0" not in s


def _fraction(v: Any) -> bool:
    return 0 < v <= 1


def _tags(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, (str, int, float)) and not isinstance(t, bool) for t in v)


@dataclass(frozen=True)
class Unread:
    """A key that a config group's file sets for every option but that only some options read (``pos.fraction`` is
    read by ``pos=partial_rope`` only): under another option any value but the file's ``default`` is refused, since
    it would change nothing."""

    key: str
    default: Any
    when: tuple[str, tuple[str, ...]]

    def problem(self, cfg: DictConfig) -> ConfigError | None:
        now = plain(OmegaConf.select(cfg, self.when[0], default=None))
        v = plain(OmegaConf.select(cfg, self.key, default=_ABSENT))
        if str(now) in self.when[1] or v is _ABSENT or v == self.default:
            return None
        return ConfigError(
            self.key,
            v,
            f"a key canonlm reads ({self.key} is read only when {self.when[0]} is "
            f"{' | '.join(self.when[1])}; here {now})",
        )


_ROTARY = ("pos.type", ("rope", "partial_rope"))
#: ``conf/pos/*.yaml`` keys that some ``pos`` types ignore, with the value every file gives them.
_UNREAD_POS = (
    Unread("pos.fraction", 1.0, ("pos.type", ("partial_rope",))),
    Unread("pos.theta", 10000.0, _ROTARY),
    Unread("pos.pairing", "half", _ROTARY),
)

#: The training keys, in the order they are checked (the first bad one is reported). Together with the nodes
#: whose keys are declared elsewhere (``model`` / ``canon`` / ``pos``: the fields of the model config; ``task``: the
#: task's keys; ``trainer``: the arguments of ``lightning.Trainer``; ``optim``: the arguments of its ``_target_``;
#: the extension points ``callbacks`` and ``logger``), these keys are every key canonlm reads: any other key is
#: refused (:func:`canonlm.config.strict.check_keys`), and tests/test_refusals.py checks that every key of every
#: ``conf/`` file is one of them.
TRAINING_RULES: tuple[Rule | KnownKeys | Unread, ...] = (
    Rule(
        "seed",
        f"an integer in [0, {MAX_SEED}] (model init and torch's RNG; the data has task.seed)",
        int,
        min=0,
        test=lambda v: v <= MAX_SEED,
    ),
    Rule(
        "canon.set",
        "each letter at most once (the release's 'AbbCD' / 'bb' may double the b); which letters an "
        "architecture takes is the model's check",
        null=True,
        test=_canon_letters_once,
    ),
    *_UNREAD_POS,
    Rule(
        "pos.fraction",
        "a number in (0, 1] (the fraction of each head's dims that partial_rope rotates)",
        float,
        optional=True,
        test=_fraction,
    ),
    Rule("train", BOOL, bool, optional=True),
    Rule("test", BOOL, bool, optional=True),
    Rule("compile", BOOL, bool, optional=True),
    Rule("activation_checkpointing", BOOL, bool, optional=True),
    Rule("task_name", "one folder name, no path separator and not . or .. (logs/<task_name>/...)", test=_folder_name),
    Rule(
        "run_name",
        "one folder name, no path separator and not . or .. (logs/<task_name>/runs/<run_name>, inside paths.log_dir)",
        test=_folder_name,
    ),
    Rule("tags", "a list of tags, e.g. [baseline,lr_sweep]", optional=True, test=_tags),
    Rule("ops", "auto | reference | fused", choices=("auto", "reference", "fused"), optional=True),
    *(
        Rule(f"kernels.{op}", _BACKEND, str, null=True, optional=True)
        for op in ("canon", "attention", "gla", "gdn", "ssd")
    ),
    Rule(
        "init_from",
        "null or a canonlm checkpoint, run directory or Hugging Face directory",
        str,
        null=True,
        optional=True,
    ),
    Rule("paths.root_dir", "a directory path", str),
    Rule("paths.log_dir", "a directory path", str),
    Rule("paths.output_dir", "a directory path", str),
    Rule("paths.kernel_cache", "null or a directory path (docs/kernel_cache.md)", str, null=True, optional=True),
    # The prepared corpora of the reallife/* presets, named once (conf/experiment/reallife/_corpora.yaml); read where
    # the presets interpolate them (task.sources.<name>.data_dir / task.data_dir), whose checks name the task key.
    KnownKeys("paths.corpora", ("slimpajama", "fineweb_edu", "nemotron_cc", "nemotron_cc_llama3")),
    Rule("strategy.find_unused_parameters", BOOL, bool, optional=True, when=_DDP),
    Rule("strategy.param_dtype", "bf16 | fp32", choices=("bf16", "fp32"), optional=True, when=_FSDP),
    Rule("strategy.reduce_dtype", "bf16 | fp32", choices=("bf16", "fp32"), optional=True, when=_FSDP),
    Rule("strategy.reshard_after_forward", BOOL, bool, optional=True, when=_FSDP),
    Rule("callbacks.checkpoint.save_last", BOOL, bool, optional=True),
    Rule("callbacks.progress.force", "null | bar | lines", choices=("bar", "lines"), null=True, optional=True),
    Rule("logger.wandb.offline", BOOL, bool, optional=True),
    Rule(
        "logger.wandb.log_model", "true | false | all", optional=True, test=lambda v: isinstance(v, bool) or v == "all"
    ),
    Rule(
        "trainer.deterministic",
        "true | false | warn",
        null=True,
        optional=True,
        test=lambda v: isinstance(v, bool) or v == "warn",
    ),
    Rule("loss.z_loss", "none | lingua | palm", choices=("none", "lingua", "palm"), optional=True),
    Rule("loss.z_coef", "a number >= 0", float, min=0),
    Rule(
        "optim._partial_",
        "true (the optimizer is built later, on the model's parameter groups)",
        bool,
        test=lambda v: v is True,
    ),
    Rule("optim.betas", "two numbers in [0, 1), e.g. [0.9, 0.98]", null=True, optional=True, test=_betas),
    Rule("optim.eps", "a positive number", float, above=0, null=True, optional=True),
    Rule("optim.weight_decay", "a number >= 0", float, min=0, null=True, optional=True),
    Rule("strategy.name", " | ".join(STRATEGIES), choices=STRATEGIES),
    Rule("trainer.precision", " | ".join(PRECISIONS), choices=PRECISIONS),
    Rule(
        "trainer.max_steps",
        "a positive integer (training is step-based), or null with data.max_tokens",
        int,
        min=1,
        null=True,
    ),
    Rule(
        "data.max_tokens",
        "null or a number >= 1: the run's length in tokens (trainer.max_steps = ceil(max_tokens / "
        "(data.batch_size x task.context)); give exactly one of trainer.max_steps and data.max_tokens)",
        float,
        min=1,
        null=True,
        optional=True,
    ),
    Rule("optim.lr", "a positive float", float, above=0),
    Rule("sched.name", " | ".join(SCHEDULES), choices=SCHEDULES),
    Rule(
        "sched.warmup_steps",
        "an integer >= 0 (optimizer steps of linear warm-up)",
        int,
        min=0,
        null=True,
        optional=True,
    ),
    Rule(
        "sched.min_lr_ratio",
        "a number in [0, 1] (the final lr as a fraction of optim.lr)",
        float,
        min=0,
        optional=True,
        test=lambda v: v <= 1,
    ),
    Rule(
        "sched.decay_fraction",
        "a number in (0, 1] (wsd: the last fraction of steps that decays)",
        float,
        above=0,
        optional=True,
        test=lambda v: v <= 1,
        when=("sched.name", ("wsd",)),
    ),
    Rule("ckpt_path", "null | auto | an existing checkpoint path", null=True, optional=True, test=_existing_or_auto),
    Rule("data.batch_size", _POSITIVE, int, min=1),
    Rule("trainer.accumulate_grad_batches", _POSITIVE, int, min=1, optional=True),
    Rule(
        "trainer.val_check_interval",
        "null, a positive integer (optimizer steps) or a fraction of an epoch in (0, 1]",
        null=True,
        optional=True,
        test=_steps_or_fraction,
    ),
    Rule("data.val_windows", _POSITIVE, int, min=1),
    Rule("data.test_windows", _POSITIVE, int, min=1),
    Rule(
        "callbacks.checkpoint.keep_last", "null (keep all) or a positive integer", int, min=1, null=True, optional=True
    ),
    Rule("callbacks.checkpoint.every_n_train_steps", _POSITIVE, int, min=1, optional=True),
    Rule(
        "callbacks.preemption.signal_name",
        "a catchable signal name other than SIGTERM, e.g. SIGUSR2 or SIGUSR1",
        str,
        optional=True,
        test=_catchable_signal,
    ),
    Rule(
        "max_nonfinite_steps",
        "a positive integer (consecutive skipped steps before the run stops)",
        int,
        min=1,
        optional=True,
    ),
    Rule("data.num_workers", "an integer >= 0", int, min=0),
    KnownKeys("data.gen_eval", ("samples", "batch_size", "on_val")),
    Rule("data.gen_eval.samples", "null (the task's default) or an integer >= 0", int, min=0, null=True, optional=True),
    Rule("data.gen_eval.batch_size", _POSITIVE, int, min=1, optional=True),
    Rule("data.gen_eval.on_val", BOOL, bool, optional=True),
)
_BY_KEY = {r.key: r for r in TRAINING_RULES if isinstance(r, Rule)}


def declared_keys(cfg: DictConfig, rules: tuple[Rule | KnownKeys | Unread, ...] = TRAINING_RULES) -> set[str]:
    """The keys of ``rules`` that canonlm reads under ``cfg``'s choices (each rule's ``when``), with the keys a
    :class:`KnownKeys` node holds."""
    out: set[str] = set()
    for r in rules:
        if isinstance(r, KnownKeys):
            out |= {f"{r.key}.{n}" for n in r.names}
        elif isinstance(r, Rule) and r.applies(cfg):
            out.add(r.key)
    return out


def check_training(cfg: DictConfig, rules: tuple[Rule | KnownKeys | Unread, ...] = TRAINING_RULES) -> None:
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
        raise ConfigError(
            "data.batch_size",
            batch_size,
            f"a positive multiple of world_size x accumulate_grad_batches = {world_size} x {accumulate}",
        )
    return batch_size // parts


__all__ = [
    "BOOL",
    "MAX_SEED",
    "PRECISIONS",
    "SCHEDULES",
    "STRATEGIES",
    "KnownKeys",
    "Rule",
    "TRAINING_RULES",
    "Unread",
    "check_training",
    "check_value",
    "declared_keys",
    "micro_batch",
    "plain",
]
