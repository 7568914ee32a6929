"""Strict configs: the keys canonlm reads, the command line composed as Hydra composes it, and what must hold before
Hydra makes a run directory.

**The keys canonlm reads.** A key of the composed config is read when the code declares it:

* a key of :data:`canonlm.config.rules.TRAINING_RULES` (every plain key: ``seed``, ``data.*``, ``sched.*``,
  ``strategy.*``, ``paths.*``, ...), under the choices its rule names (``strategy.find_unused_parameters`` only for
  ``strategy=ddp``, ``sched.decay_fraction`` only for ``sched=wsd``);
* ``model.*``: a field of :class:`canonlm.arch.config.ModelConfig` (and ``size``) that the architecture reads: not
  ``vocab_size`` / ``max_seq_len`` (the task's), ``ops`` / ``kernels`` (the top-level keys), and for ``arch=llama``
  none of the linear mixers' fields (:data:`LINEAR_ONLY`); ``canon.*`` / ``pos.*``: a field of ``CanonConfig`` /
  ``PosConfig``;
* ``task.*``: a key of the task named by ``task.name`` (its module's ``KEYS``, which the task itself enforces);
* ``trainer.*``: an argument of ``lightning.Trainer.__init__`` (read from Lightning's installed source without
  importing it, :func:`trainer_arguments`), except ``strategy`` / ``callbacks`` / ``logger`` / ``plugins``, which the
  config groups of those names set;
* ``optim.*``: an argument of the optimizer class ``optim._target_`` names (read from its source like the Trainer's,
  :func:`source_arguments`; else from the imported class, :func:`optimizer_problem`, which also builds it once);
* **the extension points** ``callbacks`` and ``logger`` (:data:`EXTENSION_POINTS`): any entry may be added there
  (``+callbacks.mine._target_=pkg.MyCallback``); each entry is instantiated from its ``_target_`` with its keys as
  arguments, and an argument its class refuses stops the run with one line (``canonlm.train.run``).

Any other key is refused, at any depth and whether it came from ``conf/`` or a ``+`` on the command line, with one
line naming it and the closest key canonlm reads (:func:`check_keys`, :func:`suggest`). tests/test_refusals.py checks
that every key of every ``conf/`` file is read in this sense, so the declarations cannot drift from the tree.

**The command line as Hydra composes it** (:func:`compose_jobs`): the same argument parser, search path, primary
config and override grammar as ``@hydra.main``; a ``-m`` sweep (or ``hydra.mode=MULTIRUN``) gives one config per job,
exactly as Hydra's basic sweeper splits it and its launchers compose each job (``load_sweep_config``). Hydra's own
errors (an unknown group option, a malformed override, an override of a missing key) become one
:class:`~canonlm.errors.ConfigError` naming the override and what is allowed (:func:`hydra_error`).

**Output paths** (:func:`check_output_dir`): the run (or sweep) directory Hydra will create must be creatable and
writable by this user; tried with a probe directory that is removed again (a read-only mount, a file in the way, a
folder under ``/proc``).

:func:`check_light` runs the checks of a job that import neither torch nor Lightning (the output directory, the
keys except the model's, the declared rules): ``train.py`` runs it for every job first, so most mistakes are refused
in about a second; ``canonlm.train.run.check_job`` then checks everything that needs the task and the model.

Sources: hydra-core 1.3.8 ``hydra/_internal/utils.py`` (``_run_hydra``), ``hydra/_internal/hydra.py``
(``compose_config``, ``get_mode``), ``hydra/_internal/core_plugins/basic_sweeper.py`` (``split_arguments``),
``basic_launcher.py`` and ``hydra/core/utils.py`` (``run_job``: the output directory); lightning 2.6
``lightning/pytorch/trainer/trainer.py`` (``Trainer.__init__``).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from canonlm.config.rules import BOOL, TRAINING_RULES, Rule, declared_keys, plain
from canonlm.errors import ConfigError

#: Config nodes whose entries are free (each is instantiated from its ``_target_``): documented extension points.
EXTENSION_POINTS = ("callbacks", "logger")
#: ``trainer`` arguments that the config groups of the same name set (never ``trainer.<name>``).
TRAINER_OWN = ("strategy", "callbacks", "logger", "plugins")
#: ModelConfig fields that are not ``model.*`` keys: the task sets ``vocab_size`` / ``max_seq_len``, the top-level
#: ``ops`` / ``kernels`` set those, ``canon`` / ``pos`` are their own groups.
MODEL_SET_ELSEWHERE = ("vocab_size", "max_seq_len", "ops", "kernels", "canon", "pos")
#: ModelConfig fields only the linear mixers (GLA, GDN, Mamba2) read; ``arch=llama`` refuses them.
LINEAR_ONLY = (
    "expand_k",
    "expand_v",
    "gate_low_rank_dim",
    "gate_logit_normalizer",
    "output_gate_rank",
    "key_head_dim",
    "conv_kernel",
    "no_conv_act",
    "chunk_size",
    "ssm_state",
    "mamba_expand",
    "n_groups",
)
#: Nodes whose second-level keys are declared by the code they configure (module docstring).
OPEN_NODES = ("model", "canon", "pos", "task", "trainer", "optim", *EXTENSION_POINTS)

_BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
_BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------- what canonlm reads


@functools.lru_cache(maxsize=None)
def source_arguments(target: str) -> dict[str, str] | None:
    """``{name: annotation}`` of the keyword arguments of the class ``target`` (``"pkg.module.Class"``: its
    ``__init__`` without ``self``; annotations as source text, ``""`` when none), read from the installed package's
    source with :mod:`ast`, without importing it (milliseconds instead of the seconds torch or Lightning take to
    import); a name the module imports from another (``from .adamw import AdamW`` in ``torch/optim/__init__.py``) is
    followed there. None when the module file is not found, the name is neither defined nor imported there, the
    class has no ``__init__`` of its own or takes ``**kwargs``: then the caller inspects the imported class."""
    module, _, name = str(target).rpartition(".")
    for _ in range(4):  # follow re-exports (``from .adamw import AdamW`` in torch/optim/__init__.py)
        parts = module.split(".")
        try:
            spec = importlib.util.find_spec(parts[0])  # a top-level package: nothing is imported
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        base = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts[1:])
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not path.is_file():
            return None
        body = ast.parse(path.read_text()).body
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                for f in node.body:
                    if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                        if f.args.kwarg is not None:
                            return None
                        args = [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]
                        return {
                            a.arg: (ast.unparse(a.annotation) if a.annotation is not None else "")
                            for a in args
                            if a.arg != "self"
                        }
                return None
        origin = next(
            (
                n
                for n in body
                if isinstance(n, ast.ImportFrom)
                and n.module is not None
                and any(a.name == name and a.asname in (None, name) for a in n.names)
            ),
            None,
        )
        if origin is None:
            return None
        package = parts if path.name == "__init__.py" else parts[:-1]
        module = ".".join(
            [*package[: len(package) - (origin.level - 1)], origin.module] if origin.level else [origin.module]
        )
    return None


def trainer_arguments() -> dict[str, str]:
    """``{name: annotation}`` of ``lightning.pytorch.Trainer.__init__`` (:func:`source_arguments` of
    ``lightning/pytorch/trainer/trainer.py``; ``{}`` when Lightning is not installed). tests/test_refusals.py checks
    it against ``inspect.signature(lightning.pytorch.Trainer.__init__)``."""
    return source_arguments("lightning.pytorch.trainer.trainer.Trainer") or {}


#: Annotations (spaces removed) of a boolean argument: bool only; bool or null; bool or an integer.
_BOOL_ONLY = ("bool",)
_BOOL_OR_NONE = ("Optional[bool]", "bool|None", "None|bool", "Union[bool,None]", "Union[None,bool]")
_BOOL_OR_INT = ("Union[int,bool]", "Union[bool,int]", "int|bool", "bool|int")
BOOL_ANNOTATIONS = _BOOL_ONLY + _BOOL_OR_NONE + _BOOL_OR_INT


def _bool_problem(key: str, value: Any, annotation: str) -> ConfigError | None:
    """The booleans among a class's arguments (Lightning's Trainer, the optimizer) take booleans only: ``bool``;
    ``Optional[bool]`` / ``bool | None`` (or null, the class's default); ``Union[int, bool]`` (or an integer:
    ``fast_dev_run``). Other annotations are the class's to check."""
    ann = annotation.replace(" ", "")
    if ann in _BOOL_ONLY and not isinstance(value, bool):
        return ConfigError(key, value, BOOL)
    if ann in _BOOL_OR_NONE and value is not None and not isinstance(value, bool):
        return ConfigError(key, value, f"{BOOL} (or null: the default)")
    if ann in _BOOL_OR_INT and not isinstance(value, (int, bool)):
        return ConfigError(key, value, f"{BOOL}, or a number of batches")
    return None


def model_keys(arch: Any) -> tuple[str, ...]:
    """The ``model.*`` keys the architecture ``arch`` reads (module docstring)."""
    from canonlm.arch.config import LINEAR_ARCHS, ModelConfig

    names = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in MODEL_SET_ELSEWHERE]
    if arch not in LINEAR_ARCHS:
        names = [n for n in names if n not in LINEAR_ONLY]
    return ("size", *names)


def task_keys(name: Any) -> tuple[str, ...] | None:
    """The keys of the task registered as ``name`` (its module's ``KEYS``, which its constructor enforces through
    ``merge_config``), or None for a name that is not registered (the task reports that itself)."""
    from canonlm.data import tasks

    entry = getattr(tasks, "_REGISTRY", {}).get(name) if isinstance(name, str) else None
    if entry is None:
        return None
    keys = getattr(importlib.import_module(entry.split(":")[0]), "KEYS", None)
    return tuple(keys) if keys is not None else None


def optimizer_arguments(target: Any) -> tuple[str, ...] | None:
    """The keyword arguments of the optimizer class ``target`` (``optim._target_``) other than ``params``, or None
    when it takes ``**kwargs`` or cannot be imported (reported by :func:`optimizer_problem`)."""
    import inspect

    try:
        from hydra.utils import get_class

        sig = inspect.signature(get_class(str(target)).__init__)
    except Exception:  # noqa: BLE001 -- reported with its own message
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return tuple(n for n in sig.parameters if n not in ("self", "params"))


def _node_keys(cfg: DictConfig, top: str) -> tuple[str, ...] | None:
    """The second-level keys canonlm reads under the open node ``top``; None when any key is accepted there."""
    if top in EXTENSION_POINTS:
        return None
    if top == "model":
        return model_keys(OmegaConf.select(cfg, "model.arch", default="llama"))
    if top in ("canon", "pos"):
        from canonlm.arch.config import CanonConfig, PosConfig

        return tuple(f.name for f in dataclasses.fields(CanonConfig if top == "canon" else PosConfig))
    if top == "task":
        return task_keys(OmegaConf.select(cfg, "task.name", default=None))
    if top == "trainer":
        names = trainer_arguments()
        return ("_target_", *(n for n in names if n not in TRAINER_OWN)) if names else None
    if top == "optim":
        args = optimizer_arguments(OmegaConf.select(cfg, "optim._target_", default=None))
        return None if args is None else ("_target_", "_partial_", *args)
    return None


def leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf below ``node`` (a plain dict); a list or an empty dict is a leaf."""
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from leaves(v, key + ".")
        else:
            yield key, v


#: Open nodes whose declarations need torch (the model's dataclasses, the optimizer's class): not in a light check.
HEAVY_NODES = ("model", "canon", "pos", "optim")


def known_keys(cfg: DictConfig, light: bool = False) -> list[str]:
    """Every key canonlm reads under ``cfg``'s choices, as dotted paths (the candidates of :func:`suggest`);
    ``light``: without the nodes of :data:`HEAVY_NODES` (no torch import)."""
    out = set(declared_keys(cfg))
    for top in OPEN_NODES:
        if light and top in HEAVY_NODES:
            continue
        names = _node_keys(cfg, top)
        if names is not None:
            out |= {f"{top}.{n}" for n in names}
    raw = OmegaConf.to_container(cfg, resolve=False)
    out |= {k for k, _ in leaves({t: raw[t] for t in EXTENSION_POINTS if isinstance(raw.get(t), dict)})}
    return sorted(out)


def _unknown(cfg: DictConfig, key: str, value: Any, light: bool) -> ConfigError:
    """:func:`unknown_key_error` with the candidates of :func:`known_keys`: the light ones first, all of them when
    none of those is close."""
    if light:
        cands = known_keys(cfg, light=True)
        if suggest(key, cands) is not None:
            return unknown_key_error(key, value, cands)
    return unknown_key_error(key, value, known_keys(cfg))


def suggest(key: str, candidates: list[str]) -> str | None:
    """The candidate closest to ``key`` (:func:`difflib.get_close_matches`): on the whole dotted path first
    (``data.batchsize`` -> ``data.batch_size``), else on the last part (``lr`` -> ``optim.lr``, preferring the same
    parent); None when nothing is close."""
    cands = [c for c in candidates if c != key]
    hit = difflib.get_close_matches(key, cands, n=1, cutoff=0.8)
    if hit:
        return hit[0]
    parent, _, leaf = key.rpartition(".")
    by_leaf: dict[str, list[str]] = {}
    for c in cands:
        by_leaf.setdefault(c.rpartition(".")[2], []).append(c)
    close = difflib.get_close_matches(leaf, list(by_leaf), n=3, cutoff=0.75)
    if not close:
        return None
    options = by_leaf[close[0]]
    same = [c for c in options if c.rpartition(".")[0] == parent]
    return (same or sorted(options, key=len))[0]


def unknown_key_error(key: str, value: Any, candidates: list[str], allowed: str | None = None) -> ConfigError:
    """The one-line refusal of a key canonlm does not read: its value, and the closest key it reads."""
    s = suggest(key, candidates)
    hint = f"did you mean {s}?" if s else "python train.py --cfg job lists the keys"
    return ConfigError(key, value, allowed or f"a key canonlm reads ({key} is not one; {hint})")


def check_keys(cfg: DictConfig, light: bool = False) -> None:
    """Refuse the first key of ``cfg`` that canonlm does not read (module docstring), at any depth, naming it and the
    closest key it reads; then the booleans among ``trainer``'s arguments (:func:`trainer_arguments`). ``cfg``: the
    job's config (no ``hydra`` node needed). ``light``: skip the nodes whose declarations need torch
    (:data:`HEAVY_NODES`; the keys of ``optim`` are checked against its class's arguments read from the source,
    :func:`source_arguments`, or else by :func:`optimizer_problem`). Raises ConfigError."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    declared = declared_keys(cfg)
    node_cache: dict[str, tuple[str, ...] | None] = {}
    for key, value in leaves({k: v for k, v in raw.items() if k != "hydra"}):
        top, _, rest = key.partition(".")
        if top in OPEN_NODES:
            if top == "optim":  # its class's arguments from the source (no import); else optimizer_problem's check
                if top not in node_cache:
                    src = source_arguments(str(OmegaConf.select(cfg, "optim._target_", default="")))
                    node_cache[top] = (
                        None if src is None else ("_target_", "_partial_", *(n for n in src if n != "params"))
                    )
            elif light and top in HEAVY_NODES:
                continue
            if top not in node_cache:
                node_cache[top] = _node_keys(cfg, top)
            names = node_cache[top]
            if names is None or not rest:
                continue
            second = rest.split(".")[0]
            if second in names:
                continue
            if top == "trainer" and second in TRAINER_OWN:
                raise ConfigError(
                    f"trainer.{second}",
                    _value(raw, f"trainer.{second}"),
                    "set by the strategy / callbacks / logger config groups, not trainer.*",
                )
            if top == "optim":
                raise unknown_key_error(
                    f"optim.{second}", _value(raw, f"optim.{second}"), [f"optim.{n}" for n in names]
                )
            if top == "model" and second in LINEAR_ONLY:
                arch = OmegaConf.select(cfg, "model.arch", default=None)
                raise ConfigError(
                    f"model.{second}",
                    _value(raw, f"model.{second}"),
                    f"a key canonlm reads (model."
                    f"{second} is read only by the linear mixers, model.arch gla | gdn | mamba2; here "
                    f"{arch})",
                )
            raise _unknown(cfg, f"{top}.{second}", _value(raw, f"{top}.{second}"), light)
        if key in declared or any(key.startswith(d + ".") for d in declared):
            continue
        rule = next((r for r in TRAINING_RULES if isinstance(r, Rule) and r.key == key and r.when), None)
        if rule is not None:  # a key of another option of its group
            now = plain(OmegaConf.select(cfg, rule.when[0], default=None))
            raise ConfigError(
                key,
                value,
                f"a key canonlm reads ({key} is read only when {rule.when[0]} is "
                f"{' | '.join(rule.when[1])}; here {now})",
            )
        raise _unknown(cfg, key, value, light)
    optim = OmegaConf.select(cfg, "optim._target_", default=None)
    for top, args in (("trainer", trainer_arguments()), ("optim", source_arguments(str(optim)) if optim else None)):
        for name in (raw.get(top) or {}) if args else ():
            ann = args.get(name, "").replace(" ", "")
            if ann in BOOL_ANNOTATIONS:
                err = _bool_problem(f"{top}.{name}", plain(cfg[top][name]), ann)
                if err is not None:
                    raise err


@contextlib.contextmanager
def interpolation_errors(cfg: DictConfig) -> Iterator[None]:
    """Within: an OmegaConf error raised while a value of ``cfg`` is resolved (``trainer.max_steps=${oops}``: a key
    that does not exist, a resolver that fails) is re-raised as one ConfigError naming the key and its text."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", "") or "config")
        raw = _value(OmegaConf.to_container(cfg, resolve=False), key) if key != "config" else None
        first = _one_line(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, 200)
        raise ConfigError(key, raw, f"a value whose interpolations resolve ({first})") from None


def check_light(job: "Job") -> None:
    """The checks of a job that import neither torch nor Lightning (so most mistakes are refused before torch
    loads): the directory Hydra will create for it (:func:`check_output_dir`, naming ``paths.log_dir``
    when the directory lies below it, else the Hydra key that places it), the keys (:func:`check_keys`, light) and
    the declared rules (``TRAINING_RULES``; ``trainer.max_steps: auto`` is left to the job, which resolves it from
    the task). Call within ``job.active()``. Raises ConfigError."""
    with interpolation_errors(job.cfg):
        _check_light(job)


def _check_light(job: "Job") -> None:
    from canonlm.config.rules import check_training

    cfg = job.cfg
    target = job.output_dir.parent if job.dir_key == "hydra.sweep.dir" else job.output_dir
    log_dir = Path(os.path.abspath(str(cfg.paths.log_dir)))
    if target == log_dir or log_dir in target.parents:
        check_output_dir(target, "paths.log_dir", str(cfg.paths.log_dir))
    else:
        check_output_dir(target, job.dir_key, str(target))
    check_keys(cfg, light=True)
    auto = OmegaConf.select(cfg, "trainer.max_steps", default=None) == "auto"
    check_training(cfg, tuple(r for r in TRAINING_RULES if not (auto and getattr(r, "key", "") == "trainer.max_steps")))


def _value(raw: dict[str, Any], key: str) -> Any:
    node: Any = raw
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def optimizer_problem(cfg: DictConfig) -> ConfigError | None:
    """The first problem of the ``optim`` node, before any optimizer is built for the model: ``_target_`` not an
    importable class, a key that is not one of its arguments (with the closest one), a boolean argument (its
    default is a bool, or it is annotated ``Optional[bool]``) that is not a boolean; then the class is constructed
    once on a one-element tensor, and an error it raises (AdamW: ``Invalid weight_decay value: -1``) is returned
    naming the argument its message names. None when all is well."""
    import inspect

    import torch
    from hydra.utils import get_class

    node = cfg.get("optim")
    if not isinstance(node, DictConfig):
        return ConfigError("optim", plain(node), "an optimizer node with _target_ (conf/optim/adamw.yaml)")
    target = node.get("_target_")
    try:
        cls = get_class(str(target))
    except Exception as e:  # noqa: BLE001 -- Hydra's locate error
        return ConfigError("optim._target_", target, f"an importable optimizer class ({_one_line(e, 200)})")
    sig = inspect.signature(cls.__init__)
    params = {n: p for n, p in sig.parameters.items() if n not in ("self", "params")}
    open_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in plain(node).items() if k not in ("_target_", "_partial_")}
    for key, value in kwargs.items():
        p = params.get(key)
        if p is None:
            if open_kw:
                continue
            return unknown_key_error(f"optim.{key}", value, [f"optim.{n}" for n in params])
        ann = str(p.annotation).replace("typing.", "").replace(" ", "")
        if isinstance(p.default, bool) or ann in ("bool", "<class'bool'>"):
            if not isinstance(value, bool):
                return ConfigError(f"optim.{key}", value, BOOL)
        elif (
            ann in ("Optional[bool]", "bool|None", "Union[bool,NoneType]")
            and value is not None
            and not isinstance(value, bool)
        ):
            return ConfigError(f"optim.{key}", value, f"{BOOL} (or null)")
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        msg = _one_line(e, 300)
        key = _named_argument(msg, list(kwargs)) or "optim"
        value = kwargs.get(key.partition(".")[2], plain(node)) if key != "optim" else plain(node)
        return ConfigError(key, value, f"a value {cls.__name__} accepts ({msg})")
    return None


_ALIASES = {"learning rate": "lr", "epsilon": "eps", "beta": "betas", "momentum": "momentum"}


def _named_argument(message: str, names: list[str]) -> str | None:
    import re

    low = message.lower()
    hits = [(m.start(), n) for n in names for m in [re.search(rf"(?<![a-z_]){re.escape(n)}(?![a-z_])", low)] if m]
    if hits:
        return "optim." + min(hits)[1]
    for words, name in _ALIASES.items():
        if words in low and name in names:
            return f"optim.{name}"
    return None


# ----------------------------------------------------------------------------------------------- output paths


def check_output_dir(path: str | os.PathLike, key: str, value: Any) -> None:
    """Refuse (ConfigError naming ``key`` = ``value``) a directory that this user cannot create or write: a file in
    the way, a read-only mount, a system folder (``/proc/x``). Tried for real: a probe directory is created in the
    deepest existing folder of ``path`` (or in ``path`` itself when it exists) and removed again, so nothing is left
    behind. Source of the failure mode: Hydra's ``run_job`` creates the directory with ``mkdir(parents=True)``
    before the task function runs (hydra/core/utils.py), which otherwise ends in Hydra's multi-line traceback."""
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            key, value, f"a folder this user can create and write ({existing} is a file, so {p} cannot be created)"
        )
    try:
        probe = tempfile.mkdtemp(prefix=".canonlm-probe-", dir=existing)
        os.rmdir(probe)
    except OSError as e:
        raise ConfigError(
            key,
            value,
            f"a folder this user can create and write ({p} cannot be created: {e.strerror or e} in {existing})",
        ) from None


# -------------------------------------------------------------------------------------------- Hydra's command line


@dataclass
class Job:
    """One job of a command line, composed as Hydra composes it.

    cfg: the job's config without the ``hydra`` node (what the task function receives). hydra: the job's whole
    config with its ``hydra`` node (``runtime.output_dir`` set, as ``run_job`` sets it). output_dir: the directory
    Hydra will create for it. dir_key: the key that places it (``hydra.run.dir`` or ``hydra.sweep.dir``). local: the
    job runs on this machine (Hydra's basic launcher), so this machine's devices and memory are the job's.
    overrides: the job's own overrides (a sweep job's values included)."""

    cfg: DictConfig
    hydra: DictConfig
    output_dir: Path
    dir_key: str
    local: bool
    overrides: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def active(self) -> Iterator[DictConfig]:
        """Within: Hydra's runtime is this job's (``${hydra:runtime.output_dir}`` and the multirun mode resolve as
        in the job); yields :attr:`cfg`. Hydra's runtime is unset again afterwards."""
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(self.hydra)
        try:
            yield self.cfg
        finally:
            HydraConfig.instance().cfg = None


def _args(argv: list[str]):
    """Hydra's own argument parser (``hydra._internal.utils.get_args_parser``) on ``argv``; its usage error (an
    option after the overrides, an unknown flag) is a ConfigError instead of argparse's usage text."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def error(message: str):
        raise ConfigError(
            "command line",
            " ".join(argv),
            "python train.py [--multirun] [key=value ...]: options "
            f"such as -m come before the overrides ({_one_line(message, 200)})",
        )

    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args(argv)


def runs_jobs(argv: list[str]) -> bool:
    """Whether ``argv`` (``train.py``'s arguments) runs jobs: not ``--help``, ``--hydra-help``, ``--cfg``,
    ``--info`` or ``--shell-completion`` (those print and exit, Hydra's own business)."""
    a = _args(argv)
    return not (a.help or a.hydra_help or a.cfg or a.info or a.shell_completion)


def compose_jobs(
    argv: list[str], config_dir: str | os.PathLike, config_name: str = "train", task_name: str = "train"
) -> list[Job]:
    """Every job ``python train.py <argv>`` would run, composed as ``@hydra.main(config_path=<config_dir>,
    config_name=<config_name>)`` composes it (module docstring), without running any, creating any directory or
    configuring logging. ``--config-path`` / ``--config-name`` / ``--config-dir`` are honoured. A multirun (``-m``
    or ``hydra.mode=MULTIRUN``) gives one job per combination of the basic sweeper's values (another sweeper: one job
    with the sweep overrides left out). ``task_name``: Hydra's name of the application (the script's stem,
    ``hydra.job.name``). Raises ConfigError (:func:`hydra_error`) for any error Hydra would report. Leaves Hydra's
    global state cleared."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException

    from canonlm.config.resolvers import register_resolvers

    register_resolvers()
    a = _args(argv)
    config_name = a.config_name or config_name
    config_path = os.path.abspath(str(config_dir))
    if a.config_path:  # as @hydra.main: relative to the script's folder (the one holding config_dir)
        config_path = (
            a.config_path
            if os.path.isabs(a.config_path) or a.config_path.startswith("pkg://")
            else os.path.normpath(os.path.join(os.path.dirname(config_path), a.config_path))
        )
    overrides = list(a.overrides)
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        parser = OverridesParser.create()
        try:
            parser.parse_overrides(overrides)
        except HydraException as e:
            raise hydra_error(e, overrides) from None
        if a.config_dir is not None and not os.path.isdir(a.config_dir):
            raise ConfigError("--config-dir", a.config_dir, "an existing directory of configs")
        search_path = create_automatic_config_search_path(None, None, config_path)
        if a.config_dir is not None:
            from hydra.core.config_search_path import SearchPathQuery

            search_path.prepend(
                provider="command-line",
                path=f"file://{os.path.abspath(a.config_dir)}",
                anchor=SearchPathQuery(provider="schema"),
            )
        try:
            hydra = Hydra.create_main_hydra2(task_name=task_name, config_search_path=search_path)
            # hydra/_internal/utils.py _run_app: the mode the config asks for, else the command line's
            mode, extra = hydra.get_mode(config_name=config_name, overrides=overrides), []
            if mode is None:
                mode = RunMode.MULTIRUN if a.multirun else RunMode.RUN
                extra = [f"hydra.mode={mode.name}"]
            elif a.multirun and mode == RunMode.RUN:
                mode, extra = RunMode.MULTIRUN, ["hydra.mode=MULTIRUN"]
            if mode == RunMode.RUN:
                cfg = hydra.compose_config(
                    config_name,
                    [*overrides, *extra],
                    run_mode=RunMode.RUN,
                    from_shell=True,
                    with_log_configuration=False,
                )
                return [_job(cfg, "hydra.run.dir", None, True, overrides)]
            master_overrides = [*overrides, *extra]
            master = hydra.compose_config(
                config_name, master_overrides, run_mode=RunMode.MULTIRUN, from_shell=True, with_log_configuration=False
            )
            local = OmegaConf.select(master, "hydra.launcher._target_", default=None) == _BASIC_LAUNCHER
            task_overrides = list(OmegaConf.to_container(master.hydra.overrides.task))
            if OmegaConf.select(master, "hydra.sweeper._target_", default=None) == _BASIC_SWEEPER:
                from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

                params = [f"{k}={v}" for k, v in (OmegaConf.select(master, "hydra.sweeper.params") or {}).items()]
                parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(
                    [*params, *task_overrides]
                )
                batches = BasicSweeper.split_arguments(parsed, None)[0]
            else:  # another sweeper picks its own values: check the fixed part of the command line
                parsed = parser.parse_overrides(task_overrides)
                batches = [[o.input_line for o in parsed if not o.is_sweep_override()]]
            jobs = []
            for idx, job_overrides in enumerate(batches):
                cfg = hydra.config_loader.load_sweep_config(master, list(job_overrides))
                with _open(cfg):
                    cfg.hydra.job.id = idx
                    cfg.hydra.job.num = idx
                jobs.append(_job(cfg, "hydra.sweep.dir", "hydra.sweep.subdir", local, list(job_overrides)))
            return jobs
        except (HydraException, OmegaConfBaseException) as e:
            raise hydra_error(e, overrides, lambda bad: _candidates(config_path, config_name, overrides, bad)) from None
    finally:
        GlobalHydra.instance().clear()


@contextlib.contextmanager
def _open(cfg: DictConfig) -> Iterator[None]:
    from omegaconf import open_dict, read_write

    with read_write(cfg), open_dict(cfg):
        yield


def _job(cfg: DictConfig, dir_key: str, subdir_key: str | None, local: bool, overrides: list[str]) -> Job:
    """A :class:`Job` from a composed config with its ``hydra`` node, as ``hydra.core.utils.run_job`` derives the
    output directory and the task function's config."""
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)  # ${hydra:...} in the directory keys resolve as in run_job
    try:
        try:
            out = str(OmegaConf.select(cfg, dir_key))
            if subdir_key is not None:
                out = os.path.join(out, str(OmegaConf.select(cfg, subdir_key)))
        except Exception as e:  # noqa: BLE001 -- an interpolation in the directory keys that does not resolve
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                dir_key,
                _value(OmegaConf.to_container(cfg, resolve=False), dir_key),
                f"a directory whose interpolations resolve ({_one_line(first, 200)})",
            ) from None
        with _open(cfg.hydra.runtime):
            cfg.hydra.runtime.output_dir = os.path.abspath(out)
    finally:
        HydraConfig.instance().cfg = None
    task_cfg = cfg.copy()
    with _open(task_cfg):
        del task_cfg["hydra"]
    return Job(
        cfg=task_cfg,
        hydra=cfg,
        output_dir=Path(os.path.abspath(out)),
        dir_key=dir_key,
        local=local,
        overrides=overrides,
    )


def _override_parts(line: str) -> tuple[str, Any]:
    """(key, value) of an override line; the value as Hydra's grammar reads it (``4`` an int) when it parses, else
    the text after ``=``."""
    key, _, value = line.partition("=")
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_override(line).value()
    except Exception:  # noqa: BLE001 -- a line the grammar refuses: its text
        return key.lstrip("+~"), value
    plain_types = (str, int, float, bool, type(None), list, dict)
    return key.lstrip("+~"), (parsed if isinstance(parsed, plain_types) else value)  # a sweep: as typed


def hydra_error(e: BaseException, overrides: list[str], candidates=None) -> ConfigError:
    """One :class:`ConfigError` for an error Hydra (or OmegaConf) raises while composing ``overrides``: an unknown
    group option (the group's options, and the closest), a malformed override (the grammar's first complaint), an
    override of a key that does not exist (the closest key), a ``+`` on a key that exists, a sweep without
    ``--multirun``, a value of Hydra's own schema, an interpolation that does not resolve. The message is one line.
    ``candidates(override)``: the keys canonlm reads without that override (for the suggestion), optional."""
    import re

    from hydra.errors import MissingConfigException, OverrideParseException

    text = str(e)
    first = _one_line(text.strip().splitlines()[0] if text.strip() else type(e).__name__, 300)
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and "/" in str(e.missing_cfg_file):
        group, _, option = str(e.missing_cfg_file).rpartition("/")
        options = sorted(o for o in (e.options or []) if not o.startswith("_"))
        close = difflib.get_close_matches(option, options, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        return ConfigError(
            group, option, (" | ".join(options) if options else f"an option of the {group} group") + hint
        )
    if isinstance(e, MissingConfigException):
        return ConfigError("--config-name", e.missing_cfg_file, f"a primary config on the search path ({first})")
    if isinstance(e, OverrideParseException):
        key, value = _override_parts(e.override or "")
        lines = [ln.strip() for ln in text.splitlines()[1:] if ln.strip() and not ln.startswith("See ")]
        why = _one_line(lines[0] if lines else first, 200)
        return ConfigError(
            key or "override",
            value or e.override,
            f"an override in Hydra's grammar, key=value ({why}); quote a value with special characters: key='...'",
        )
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        key = m.group(1)
        line = next((o for o in overrides if _override_parts(o)[0] == key), f"{key}=")
        value = _override_parts(line)[1]
        did = re.search(r"Did you mean to override (.+)\?", text)
        if did:
            return ConfigError(
                key, value, f"an override of a group in the defaults list (did you mean {did.group(1)}?)"
            )
        return unknown_key_error(key, value, candidates(line) if candidates else [])
    m = re.search(r"An item is already at '([^']+)'", text)
    if m:
        key = m.group(1)
        value = next((_override_parts(o)[1] for o in overrides if _override_parts(o)[0] == key), None)
        return ConfigError(key, value, f"{key}=<value> without '+' ({key} exists; '+' adds a key that does not)")
    m = re.search(r"Ambiguous value for argument '([^']+)'", text)
    if m:
        key, value = _override_parts(m.group(1))
        return ConfigError(
            key,
            value,
            "one value; to sweep over several, add --multirun (-m); a list is key=[a,b]; "
            "a string with commas is key='a,b'",
        )
    m = re.search(r"looks like a config group override, but config group '([^']+)' does not exist", text)
    if m:
        return ConfigError(
            m.group(1),
            next((_override_parts(o)[1] for o in overrides if _override_parts(o)[0] == m.group(1)), None),
            "a config group (arch, canon, pos, task, optim, sched, trainer, strategy, logger, "
            "callbacks, paths, experiment, debug, hydra/launcher, ...)",
        )
    cause = e.__cause__ or e.__context__
    full_key = getattr(cause, "full_key", None) or getattr(e, "full_key", None)
    m = re.search(r"Error merging override (\S+)", text)
    if m:
        key, value = _override_parts(m.group(1))
        why = _one_line(str(cause).splitlines()[0] if cause is not None else first, 200)
        return ConfigError(key, value, f"a value of the right type ({why})")
    if full_key:
        return ConfigError(str(full_key), None, f"a value that composes ({first})")
    hit = next((o for o in overrides if _override_parts(o)[0] and _override_parts(o)[0] in text), None)
    if hit is not None:
        key, value = _override_parts(hit)
        return ConfigError(key, value, f"an override Hydra accepts ({first})")
    return ConfigError("command line", " ".join(overrides), f"overrides Hydra accepts ({first})")


def _candidates(config_path: str, config_name: str, overrides: list[str], bad: str) -> list[str]:
    """The keys canonlm reads for the command line without its override ``bad`` (the candidates of a suggestion for
    an override Hydra refused as a missing key); [] when that does not compose either."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        rest = [o for o in overrides if o != bad and not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=config_path, version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=rest)
        light = known_keys(cfg, light=True)
        key = _override_parts(bad)[0]
        return light if suggest(key, light) is not None else known_keys(cfg)
    except Exception:  # noqa: BLE001 -- a suggestion is optional
        return []
    finally:
        GlobalHydra.instance().clear()


__all__ = [
    "EXTENSION_POINTS",
    "HEAVY_NODES",
    "Job",
    "LINEAR_ONLY",
    "OPEN_NODES",
    "TRAINER_OWN",
    "check_keys",
    "check_light",
    "check_output_dir",
    "interpolation_errors",
    "compose_jobs",
    "hydra_error",
    "known_keys",
    "leaves",
    "model_keys",
    "optimizer_arguments",
    "optimizer_problem",
    "runs_jobs",
    "source_arguments",
    "suggest",
    "task_keys",
    "trainer_arguments",
    "unknown_key_error",
]
