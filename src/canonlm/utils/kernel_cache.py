"""One kernel cache per user: Triton's compiled kernels, fla's and mamba-ssm's autotune results and inductor's caches in
one directory, configured once (:func:`configure`) for every process and SLURM job.

Layout (``<root>`` is the one directory :func:`configure` resolves):

* ``<root>/triton/`` -- ``TRITON_CACHE_DIR``: Triton's compiled kernels (cubins, launchers, metadata) of fla,
  mamba-ssm and inductor, and fla's autotune results: fla-core 0.6.0 decorates its kernels with
  ``triton.autotune(..., cache_results=FLA_CACHE_RESULTS)`` (``fla/utils/env.py``; on by default,
  ``FLA_CACHE_RESULTS=0`` turns it off), and Triton's ``Autotuner.check_disk_cache`` writes ``<fn>.autotune.json``
  through its cache manager.
  Triton reads ``TRITON_CACHE_DIR`` each time it creates a cache manager (``triton/knobs.py`` ``cache_knobs.dir``,
  ``triton/runtime/cache.py`` ``FileCacheManager.__init__``, triton 3.6.0 and 3.9.0), i.e. per kernel compiled or
  looked up, so setting it before the first kernel compiles is enough.
* ``<root>/autotune/`` -- mamba-ssm's autotune choices (below).
* ``<root>/inductor/`` -- ``TORCHINDUCTOR_CACHE_DIR`` (``torch/_inductor/runtime/cache_dir_utils.py`` ``cache_dir()``,
  read at each use, torch 2.11 and 2.13): with ``compile=true``, inductor's FX graph cache (``fxgraph/``), AOTAutograd
  cache, generated code and its autotune results (``torch._inductor.config.fx_graph_cache``,
  ``autotune_local_cache``, ``torch._functorch.config.enable_autograd_cache``: all on by default, left as they are).
  Inductor's own Triton kernels go to ``TRITON_CACHE_DIR`` when it is set (``triton_heuristics.py`` sets it to
  ``<inductor>/triton/<device>`` only when unset), so they land in ``<root>/triton/`` too.

mamba-ssm's autotune choices. mamba-ssm 2.3.1 decorates its kernels with a plain ``triton.autotune`` (no
``cache_results``), so every new process benchmarks every config of every kernel again. ``TRITON_CACHE_AUTOTUNING=1``
would cache them, except that Triton's ``Autotuner.check_disk_cache`` benchmarks anyway when any config carries a
``pre_hook`` ("We can't serialize prehooks"), and the backward kernels' configs do (``init_to_zero([...])``, which
zeroes the buffers the kernel accumulates into with atomics). So canonlm keeps its own record: for each autotuned
kernel of a ``mamba_ssm.ops.triton.*`` module, one JSON file per tuning key holding the *index* of the best config in
the kernel's config list (plus the list's description, to check it). In a later process the same key restores
``autotuner.configs[index]`` -- the very ``triton.Config`` object, its ``pre_hook`` included -- into the autotuner's
in-memory cache before ``Autotuner.run`` looks there, so ``run`` skips only the benchmark: the chosen config's
pre-hook runs before the kernel exactly as after a benchmark in the same process. The record is ignored (and the
kernel benchmarked and recorded again) when the kernel's source, its config list (parameters and pre-hooks), Triton's
or mamba-ssm's version, the device (name and compute capability) or, for autotuners that prune, the pruned set do
not match. The Autotuner instances are wrapped in place (their class becomes a subclass whose ``run`` does this) when
a ``mamba_ssm.ops.triton.*`` module is imported after :func:`configure` (an import hook) or, if it was imported
before, by :func:`configure` itself. Written against ``triton/runtime/autotuner.py`` of triton 3.6.0 (the GPU's)
and 3.9.0: ``Autotuner.run`` builds its key from the ``key`` arguments plus every argument's dtype and looks it up
in ``self.cache`` before benchmarking.

Which directory. ``configure(path)``: ``path`` (the config key ``paths.kernel_cache``), else ``$CANONLM_KERNEL_CACHE``,
else ``<canonlm cache>/kernels`` where ``<canonlm cache>`` is the native Canon kernel's root
(:func:`canonlm.utils.trust.user_cache_root`: ``$CANONLM_CACHE``, ``$XDG_CACHE_HOME/canonlm``, ``~/.cache/canonlm``).
``~`` is expanded and a relative path is resolved once, against ``base`` (``paths.root_dir``: where ``train.py`` was
started) or the working directory, because Triton's cache index (``__grp__*.json``) stores absolute paths: the
cache must sit at one absolute path, the same on every node of a cluster (a shared filesystem). The resolved root is
exported as ``CANONLM_KERNEL_CACHE``, so subprocesses that call :func:`configure` without a path use it too.

Trust rule (:mod:`canonlm.utils.trust`, the native Canon kernel's rule): the root must be a real directory owned by
this user that nobody else can write (created with mode 0o700). A configured root that fails it is not used: the
kernels are cached in ``<canonlm cache>/kernels`` if that passes, else in a private temp directory removed at exit,
with one warning naming the refused directory and why. A configured value that cannot be a directory at all (cannot
be created, is a file, is not writable) raises :class:`canonlm.errors.ConfigError` naming the key.

Environment variables a user set. An explicit ``TRITON_CACHE_DIR`` or ``TORCHINDUCTOR_CACHE_DIR`` (one that differs
from what canonlm would set and was not set by canonlm or by torch's own defaults) wins: it is left as it is and one
warning says that this part of the cache lives there instead. ``$TRITON_HOME`` only moves Triton's default cache
(``$TRITON_HOME/.triton/cache``); ``TRITON_CACHE_DIR`` takes precedence over it, so with ``TRITON_HOME`` set the log
says where Triton's cache went.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.abc
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

from canonlm.errors import ConfigError
from canonlm.utils.trust import unsafe_dir_reason, usable_dir, user_cache_root

log = logging.getLogger("canonlm")

ENV = "CANONLM_KERNEL_CACHE"
# subfolder -> the environment variable that points the library at it
ENV_DIRS = {"triton": "TRITON_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR"}
AUTOTUNE = "autotune"
# modules whose Triton autotuners get their choices recorded (mamba-ssm: plain triton.autotune, pre-hooks)
PERSIST_PREFIXES = ("mamba_ssm.ops.triton.",)

_lock = threading.RLock()


class _State:
    def __init__(self) -> None:
        self.root: Optional[Path] = None  # the directory in use
        self.requested: Optional[tuple] = None  # (raw value, key it came from, base) of the last configure()
        self.env_set: dict[str, str] = {}  # environment variables canonlm set, with the values it set
        self.env_prev: dict[str, Optional[str]] = {}  # their values before canonlm first set them
        self.kept: dict[str, str] = {}  # user-set variables that were left as they are
        self.warned: set[str] = set()
        self.private: Optional[Path] = None  # mkdtemp fallback, one per process
        self.hook: Optional["_ImportHook"] = None


_state = _State()
# counters of the mamba-ssm autotune record in this process (read by canonlm.warmup)
_stats = {"restored": 0, "benchmarked": 0, "bench_s": 0.0, "saved": 0, "ignored": 0}


# ------------------------------------------------------------------------------------------------------------------
# configure
# ------------------------------------------------------------------------------------------------------------------


def configure(
    path: Optional[os.PathLike | str] = None,
    *,
    key: str = "paths.kernel_cache",
    base: Optional[os.PathLike | str] = None,
) -> Path:
    """Resolve, check and apply the kernel cache; returns its root directory (absolute). Idempotent and cheap: a second
    call with the same request returns at once. Imports neither triton nor torch.

    Args:
        path: the configured directory (``paths.kernel_cache``); None or "" -> ``$CANONLM_KERNEL_CACHE``, else
            ``<canonlm cache>/kernels`` (module docstring).
        key: the name errors give the configured value (``paths.kernel_cache``; ``CANONLM_KERNEL_CACHE`` is named
            when the value came from there).
        base: directory a relative ``path`` is resolved against (default: the working directory), once.

    Sets ``TRITON_CACHE_DIR=<root>/triton`` and ``TORCHINDUCTOR_CACHE_DIR=<root>/inductor`` unless the user set them
    (then they win, with one warning), ``CANONLM_KERNEL_CACHE=<root>``, and records mamba-ssm's autotune choices in
    ``<root>/autotune``. Call it before the first kernel is compiled (``canonlm.train.run`` does, first thing).

    Raises:
        ConfigError: the configured value (``key``) or ``$CANONLM_KERNEL_CACHE`` cannot be a directory of this user's:
            it cannot be created, is not a directory, or is not writable. A directory that exists but fails the trust
            rule is not an error: it is replaced by a safe one, with a warning.
    """
    with _lock:
        if path is not None and str(path).strip() != "":
            raw, source = str(path), key
        elif os.environ.get(ENV, "").strip():
            raw, source = os.environ[ENV].strip(), ENV
        else:
            raw, source = None, "default"
        request = (raw, source, None if base is None else str(base))
        if _state.root is not None and _state.requested == request and _env_intact():
            return _state.root
        if raw is None:
            root = _default_root()
        else:
            root = _absolute(raw, base)
        root = _checked(root, raw, source)
        _apply(root, source)
        _state.requested = request
        return root


def _absolute(raw: str, base: Optional[os.PathLike | str]) -> Path:
    p = Path(raw).expanduser()
    if not p.is_absolute():
        p = Path(base if base is not None else os.getcwd()).expanduser() / p
    return Path(os.path.abspath(p))


def _default_root() -> Path:
    return Path(os.path.abspath(user_cache_root().expanduser() / "kernels"))


def _env_intact() -> bool:
    """The variables canonlm set still hold what it set (nobody changed them since)."""
    return all(os.environ.get(var) == val for var, val in _state.env_set.items())


def _unusable(d: Path) -> tuple[Optional[str], bool]:
    """(why ``d`` cannot be the cache root, whether that is a trust refusal rather than an impossible value)."""
    why = usable_dir(d)
    if why is not None:
        return why, not why.startswith("cannot be created")
    if not os.access(d, os.W_OK | os.X_OK):
        return "is not writable by this user", False
    for sub in (*ENV_DIRS, AUTOTUNE):
        why = usable_dir(d / sub)
        if why is not None:
            return f"has a subfolder {sub}/ that {why}", not why.startswith("cannot be created")
    return None, False


def _checked(root: Path, raw: Optional[str], source: str) -> Path:
    """``root`` if usable; a ConfigError for an impossible explicit value; else the fallback (warns once)."""
    why, trust = _unusable(root)
    if why is None:
        return root
    if source != "default" and not trust:
        raise ConfigError(
            source,
            raw,
            f"a directory this user can create and write, at one absolute path (the same "
            f"on every node of a cluster; null = ${ENV} or <canonlm cache>/kernels): "
            f"{root} {why}",
        )
    fallback = None
    default = _default_root()
    if default != root and _unusable(default)[0] is None:
        fallback = default
    if fallback is None:
        fallback = _private_dir()
    if str(root) not in _state.warned:
        _state.warned.add(str(root))
        risk = (
            ", so a kernel there could have been planted by someone else (use a directory you own that only you "
            "can write, e.g. chmod 700)"
            if trust
            else ""
        )
        warnings.warn(
            f"canonlm: not using the kernel cache {root}: it {why}{risk}. Caching kernels in {fallback} instead.",
            RuntimeWarning,
            stacklevel=3,
        )
    return fallback


def _private_dir() -> Path:
    if _state.private is None or unsafe_dir_reason(_state.private) is not None:
        _state.private = Path(tempfile.mkdtemp(prefix="canonlm-kernels-"))  # mode 0o700, owned by us
        atexit.register(shutil.rmtree, str(_state.private), ignore_errors=True)
        for sub in (*ENV_DIRS, AUTOTUNE):
            (_state.private / sub).mkdir(mode=0o700, exist_ok=True)
    return _state.private


def _set_by_torch(var: str, value: str) -> bool:
    """True when ``value`` of ``var`` is one torch sets itself (inductor's default cache dir, or its Triton dir under
    it), so it is not a user's choice. Only when torch's module is already loaded (nothing is imported here)."""
    mod = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if mod is None:
        return False
    try:
        default = os.path.abspath(mod.default_cache_dir())
    except Exception:  # noqa: BLE001 -- getpass can fail without a user name
        return False
    value = os.path.abspath(value)
    if var == "TORCHINDUCTOR_CACHE_DIR":
        return value == default
    return value.startswith(os.path.join(default, "triton") + os.sep)


def _apply(root: Path, source: str) -> None:
    """Point the libraries at ``root``'s subfolders (respecting user-set variables), export the root, wrap
    mamba-ssm's autotuners."""
    changed = root != _state.root
    kept = {}
    inherited_root = os.environ.get(ENV)  # a canonlm parent process exported its root and its subfolders
    for sub, var in ENV_DIRS.items():
        want = str(root / sub)
        have = os.environ.get(var)
        ours = have is not None and (
            _state.env_set.get(var) == have
            or (inherited_root is not None and have == os.path.join(inherited_root, sub))
        )
        if have is None or have == want or ours or _set_by_torch(var, have):
            _setenv(var, want)
        else:
            kept[var] = have
            _state.env_set.pop(var, None)
            if (var, have) not in _state.warned:
                _state.warned.add((var, have))
                what = (
                    "Triton's compiled kernels and fla's autotune results"
                    if sub == "triton"
                    else "inductor's caches (compile=true)"
                )
                warnings.warn(
                    f"canonlm: {var}={have} is set in the environment and wins: {what} are cached there, "
                    f"not in the kernel cache {root / sub} (unset {var} to use it).",
                    RuntimeWarning,
                    stacklevel=3,
                )
    _setenv(ENV, str(root))
    _state.kept = kept
    _state.root = root
    if changed:
        triton_home = os.environ.get("TRITON_HOME")
        extra = (
            f"; TRITON_HOME={triton_home} is set, but Triton's cache is {os.environ['TRITON_CACHE_DIR']}"
            if triton_home and "TRITON_CACHE_DIR" not in kept
            else ""
        )
        log.info(
            "kernel cache: %s (from %s): Triton kernels and fla autotune in %s, inductor in %s, mamba-ssm "
            "autotune in %s%s",
            root,
            source,
            os.environ.get("TRITON_CACHE_DIR"),
            os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
            root / AUTOTUNE,
            extra,
        )
    _install_autotune_record()


def _setenv(var: str, value: str) -> None:
    if var not in _state.env_prev:
        _state.env_prev[var] = os.environ.get(var)
    os.environ[var] = value
    _state.env_set[var] = value


def _reset_for_tests() -> None:
    """Undo :func:`configure` in this process: the variables canonlm set get their earlier values back (or are
    removed), the state is forgotten, the import hook removed (wrapped autotuners keep their class but record
    nothing)."""
    with _lock:
        for var, val in _state.env_set.items():
            if os.environ.get(var) == val:
                prev = _state.env_prev.get(var)
                if prev is None:
                    del os.environ[var]
                else:
                    os.environ[var] = prev
        if _state.hook is not None and _state.hook in sys.meta_path:
            sys.meta_path.remove(_state.hook)
        _state.__init__()
        for k in _stats:
            _stats[k] = 0.0 if k == "bench_s" else 0


# ------------------------------------------------------------------------------------------------------------------
# mamba-ssm autotune record
# ------------------------------------------------------------------------------------------------------------------


class _WrappingLoader(importlib.abc.Loader):
    """Runs the real loader, then wraps the module's autotuners (:func:`_wrap_module`)."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _wrap_module(module)

    def __getattr__(self, name):  # get_source, get_filename, is_package, ... of the real loader
        return getattr(self._loader, name)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Finds ``mamba_ssm.ops.triton.*`` modules through the other finders and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(PERSIST_PREFIXES):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WrappingLoader(spec.loader)
                return spec
        return None


def _install_autotune_record() -> None:
    if _state.hook is None:
        _state.hook = _ImportHook()
    if _state.hook not in sys.meta_path:
        sys.meta_path.insert(0, _state.hook)
    for name, mod in list(sys.modules.items()):
        if name.startswith(PERSIST_PREFIXES) and mod is not None:
            _wrap_module(mod)


_classes: dict[type, type] = {}


def _wrap_module(module) -> int:
    """Give every Triton ``Autotuner`` reachable from ``module``'s globals (through ``.fn`` chains: heuristics,
    autotune, jit) the recording ``run``; returns how many were wrapped now."""
    at = sys.modules.get("triton.runtime.autotuner")
    if at is None:
        return 0
    n = 0
    for obj in list(vars(module).values()):
        for _ in range(8):
            if obj is None:
                break
            if isinstance(obj, at.Autotuner) and not getattr(type(obj), "_canonlm_recorded", False):
                obj.__class__ = _recording_class(type(obj))
                n += 1
            try:
                obj = getattr(obj, "fn", None) if not inspect.isfunction(obj) else None
            except Exception:  # noqa: BLE001 -- an unrelated global with a failing attribute
                obj = None
    return n


def _recording_class(base: type) -> type:
    cls = _classes.get(base)
    if cls is None:

        def run(self, *args, **kwargs):
            return _recorded_run(base, self, args, kwargs)

        cls = type(
            base.__name__,
            (base,),
            {"run": run, "_canonlm_recorded": True, "__module__": base.__module__, "__doc__": base.__doc__},
        )
        _classes[base] = cls
    return cls


def _tuning_key(self, args, kwargs) -> tuple:
    """The key ``Autotuner.run`` (triton 3.6.0 / 3.9.0) caches a choice under: the ``key`` arguments' values, then
    the dtype of every kernel argument that has one, in argument order."""
    all_args = {**dict(zip(self.arg_names, args)), **kwargs}
    _args = {k: v for k, v in all_args.items() if k in self.arg_names}
    key = [_args[k] for k in self.keys if k in _args]
    for _, arg in _args.items():
        if hasattr(arg, "dtype"):
            key.append(str(arg.dtype))
    return tuple(key)


def _recorded_run(base: type, self, args, kwargs):
    root = _state.root
    if root is None or _state.hook is None or len(self.configs) <= 1:
        return base.run(self, *args, **kwargs)
    try:
        key = _tuning_key(self, args, kwargs)
        fresh = key not in self.cache
        path = _record_path(self, key, args, root) if fresh else None
    except Exception as e:  # noqa: BLE001 -- the record is an optimisation, never a failure
        log.debug("kernel cache: autotune record unavailable for %s: %s", getattr(self.base_fn, "__name__", "?"), e)
        return base.run(self, *args, **kwargs)
    if fresh:
        config = _load_choice(self, path, args, kwargs)
        if config is not None:
            self.cache[key] = config
            _stats["restored"] += 1
            return base.run(self, *args, **kwargs)
    ret = base.run(self, *args, **kwargs)
    if fresh and key in self.cache:
        _stats["benchmarked"] += 1
        _stats["bench_s"] += float(getattr(self, "bench_time", 0.0) or 0.0)
        _save_choice(self, path, key, self.cache[key])
    return ret


def _hook_desc(hook) -> str:
    """A pre-hook's identity across processes: its qualified name and the simple values it closes over (mamba-ssm's
    ``init_to_zero(names)`` closes over the buffer names)."""
    if hook is None:
        return "None"
    cells = []
    for c in getattr(hook, "__closure__", None) or ():
        try:
            v = c.cell_contents
        except ValueError:
            continue
        if isinstance(v, (str, int, float, bool, list, tuple)):
            cells.append(repr(v))
    return f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', type(hook).__name__)}({','.join(cells)})"


def _describe(config) -> str:
    return f"{config} | pre_hook: {_hook_desc(config.pre_hook)}"


_device_ids: dict[tuple, str] = {}


def _device_id(args) -> str:
    """Name and compute capability of the device of the first tensor argument (``cpu`` under the interpreter)."""
    dev = next((a.device for a in args if hasattr(a, "device") and hasattr(a, "data_ptr")), None)
    if dev is None:
        return "unknown"
    k = (dev.type, dev.index)
    if k not in _device_ids:
        ident = dev.type
        torch = sys.modules.get("torch")
        if dev.type == "cuda" and torch is not None:
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            major, minor = torch.cuda.get_device_capability(idx)
            ident = f"{torch.cuda.get_device_name(idx)} sm_{major}{minor}"
        if os.environ.get("TRITON_INTERPRET") == "1":
            ident += " (triton interpreter)"
        _device_ids[k] = ident
    return _device_ids[k]


def _kernel_identity(self) -> dict[str, Any]:
    ident = getattr(self, "_canonlm_identity", None)
    if ident is None:
        fn = self.base_fn
        top = fn.__module__.split(".")[0]
        lib = sys.modules.get(top)
        triton = sys.modules.get("triton")
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            src = fn.__code__.co_code.hex()
        ident = {
            "kernel": f"{fn.__module__}.{fn.__qualname__}",
            "library": f"{top} {getattr(lib, '__version__', '?')}",
            "triton": getattr(triton, "__version__", "?"),
            "source_sha256": hashlib.sha256(src.encode()).hexdigest(),
            "configs": [_describe(c) for c in self.configs],
        }
        self._canonlm_identity = ident
    return ident


def _record_path(self, key: tuple, args, root: Path) -> tuple[Path, dict[str, Any]]:
    """(file of the record for this kernel, key and device, the record's expected header)."""
    header = dict(_kernel_identity(self), device=_device_id(args), key=[repr(k) for k in key])
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()[:32]
    return root / AUTOTUNE / self.base_fn.__name__[:100] / f"{digest}.json", header


def _load_choice(self, record, args, kwargs):
    """The Config object the record names, or None (no record, unreadable, or not matching this kernel now)."""
    path, header = record
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.debug("kernel cache: ignoring unreadable autotune record %s (%s)", path, e)
        _stats["ignored"] += 1
        return None
    if not isinstance(data, dict) or any(data.get(k) != v for k, v in header.items()):
        _stats["ignored"] += 1
        return None
    i = data.get("index")
    if not isinstance(i, int) or not 0 <= i < len(self.configs) or data.get("config") != _describe(self.configs[i]):
        _stats["ignored"] += 1
        return None
    config = self.configs[i]
    if self.early_config_prune or self.perf_model:  # the choice must be one Autotuner.run could make now
        self.nargs = dict(zip(self.arg_names, args))
        try:
            pruned = self.prune_configs(kwargs)
        finally:
            self.nargs = None
        if not any(c is config for c in pruned):
            _stats["ignored"] += 1
            return None
    return config


def _save_choice(self, record, key: tuple, chosen) -> None:
    path, header = record
    i = next((j for j, c in enumerate(self.configs) if c is chosen), None)
    if i is None:  # e.g. a Config rebuilt from Triton's own disk cache: equal parameters, same pre_hook
        i = next((j for j, c in enumerate(self.configs) if c == chosen), None)
    if i is None:
        return
    data = dict(header, index=i, config=_describe(self.configs[i]), bench_s=getattr(self, "bench_time", None))
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)  # atomic: concurrent ranks write the same choice or one of equal worth
        _stats["saved"] += 1
    except OSError as e:
        log.debug("kernel cache: could not write autotune record %s (%s)", path, e)
