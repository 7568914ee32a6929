"""Two hooks into Triton for the self-check: autotuning that takes the first config that runs instead of benchmarking
every config, and a count of the kernels compiled (or loaded from the kernel cache) while a line runs.

**First-config autotuning** (:func:`first_config_autotune`, the self-check's default, ``--autotune first``). fla-core
0.6.0 and mamba-ssm 2.3.1 decorate their kernels with ``triton.autotune`` over 2-48 configs (fla's ``causal_conv1d``
kernels: 16, ``BD`` x ``num_warps``; ``chunk_fwd_kernel_h``: 48), keyed by a few sizes and every argument's dtype, and
Triton compiles and benchmarks every config the first time a key is seen. Counted under Triton's interpreter
(docs/selfcheck.md), the self-check's kernel lines reach 1,428 compiles that way and 127 with one config per kernel
variant. A config changes the tiling, not what a kernel computes, so a check of the numbers needs one of them: inside
this context, ``Autotuner.run`` tries the configs in their listed order, runs the first one that compiles and launches
(``OutOfResources``, ``CompileTimeAssertionFailure`` and ``PTXASError`` move on to the next, as a full autotune does),
once, without timing it, and uses it for that key. The choice is never stored where a later autotune would take it
for a tuned one: Triton's on-disk autotune cache (``cache_results``, which fla turns on) is neither read nor written
during the call, and the choice is taken out of the autotuner's in-memory ``cache`` again after each call (so
:mod:`canonlm.utils.kernel_cache`, which records mamba-ssm's tuned choices after ``Autotuner.run``, sees nothing to
record). A choice that is already in the in-memory cache when the call starts (a full autotune earlier in the
process, or a tuned choice restored from the kernel cache) is used as it is.

Written against ``triton/runtime/autotuner.py`` of triton 3.6.0 (the GPU machine's) and 3.9.0 (the interpreter
tier's), which agree on what is used here: ``Autotuner.run(*args, **kwargs)`` looks the key (the ``key`` arguments'
values, then the dtype of every argument that has one) up in ``self.cache``, benchmarks the configs of
``prune_configs(kwargs)`` with ``self._bench(*args, config=config, **kwargs)`` (which returns ``[inf, inf, inf]`` for a
config that does not compile) and keeps ``min(timings)`` in ``self.cache[key]``; ``_bench`` times ``kernel_call`` with
``self.do_bench`` (a ``functools.cached_property``, so an instance attribute replaces it); ``cache_results`` switches
the on-disk cache (``check_disk_cache``). Under the interpreter (``TRITON_INTERPRET=1``) nothing is benchmarked
anyway.

**Kernel counts** (:func:`count_compiles`): ``triton.knobs.compilation.listener`` (triton 3.6.0 and 3.9.0,
``triton/compiler/compiler.py`` ``compile``) is called once per kernel binary ``compile`` returns, with ``cache_hit``
True when it came from Triton's on-disk cache. The counts tell how much of a line's compile time was compiling and
how much the kernel cache saved.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from typing import Callable, Iterator, Optional

#: Autotune modes of the self-check (``--autotune``).
AUTOTUNE_MODES = ("first", "full")

_lock = threading.Lock()
_active = [0]  # nesting depth of first_config_autotune contexts
_saved: dict = {}  # the original Autotuner methods while patched
_INF = [math.inf, math.inf, math.inf]


def _tuning_key(self, args, kwargs) -> tuple:
    """The key ``Autotuner.run`` (triton 3.6.0 / 3.9.0) caches a choice under: the ``key`` arguments' values, then the
    dtype of every kernel argument that has one, in argument order."""
    all_args = {**dict(zip(self.arg_names, args)), **kwargs}
    named = {k: v for k, v in all_args.items() if k in self.arg_names}
    key = [named[k] for k in self.keys if k in named]
    key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    return tuple(key)


def _run_once(kernel_call: Callable, quantiles=None) -> list:
    """Stands in for ``Autotuner.do_bench``: launch once (compiling first), wait for the device, report time 0."""
    kernel_call()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return [0.0, 0.0, 0.0]


def _patched_run(self, *args, **kwargs):
    run = _saved["run"]
    if not _active[0] or len(getattr(self, "configs", ())) <= 1:
        return run(self, *args, **kwargs)
    key = _tuning_key(self, args, kwargs)
    mine = self.__dict__.setdefault("_canonlm_first_config", {})
    if key in self.cache and key not in mine:
        return run(self, *args, **kwargs)  # tuned before (full autotune, or restored from the kernel cache)
    saved_cache_results = getattr(self, "cache_results", False)
    self.cache_results = False
    self._canonlm_round = [False]
    if key in mine:
        self.cache[key] = mine[key]
    try:
        ret = run(self, *args, **kwargs)
        if key in self.cache:
            mine[key] = self.cache[key]
        return ret
    finally:
        self.cache.pop(key, None)
        self.cache_results = saved_cache_results
        self._canonlm_round = None


def _patched_bench(self, *args, config, **meta):
    bench = _saved["_bench"]
    rnd = getattr(self, "_canonlm_round", None)
    if not _active[0] or rnd is None:
        return bench(self, *args, config=config, **meta)
    if rnd[0]:
        return list(_INF)  # a config already ran for this key: the rest are neither compiled nor run
    had = "do_bench" in self.__dict__
    old = self.__dict__.get("do_bench")
    self.__dict__["do_bench"] = _run_once
    try:
        timing = bench(self, *args, config=config, **meta)
    finally:
        if had:
            self.__dict__["do_bench"] = old
        else:
            self.__dict__.pop("do_bench", None)
    if all(math.isfinite(t) for t in timing):
        rnd[0] = True
    return timing


def _autotuner_class():
    """``triton.runtime.autotuner.Autotuner``, or None when triton does not import."""
    try:
        from triton.runtime import autotuner
    except Exception:  # noqa: BLE001 -- not installed, or a broken install: nothing to patch
        return None
    return getattr(autotuner, "Autotuner", None)


def patch_problem(cls) -> Optional[str]:
    """None when ``cls`` (Triton's Autotuner) has the methods :func:`first_config_autotune` wraps; else what is
    missing (another Triton version): the self-check then autotunes fully and says why."""
    if cls is None:
        return "triton does not import"
    missing = [n for n in ("run", "_bench", "prune_configs") if not callable(getattr(cls, n, None))]
    if missing:
        return f"triton.runtime.autotuner.Autotuner has no {', '.join(missing)}"
    return None


def _enter() -> Optional[str]:
    cls = _autotuner_class()
    why = patch_problem(cls)
    if why is not None:
        return why
    with _lock:
        if _active[0] == 0:
            _saved.update(cls=cls, run=cls.run, _bench=cls._bench)
            cls.run, cls._bench = _patched_run, _patched_bench
        _active[0] += 1
    return None


def _exit() -> None:
    with _lock:
        _active[0] -= 1
        if _active[0] == 0:
            cls = _saved.pop("cls")
            cls.run, cls._bench = _saved.pop("run"), _saved.pop("_bench")


@contextlib.contextmanager
def first_config_autotune() -> Iterator[Optional[str]]:
    """Inside the block, Triton autotuners use the first config that compiles and runs (module docstring).

    Yields None when the patch is in force, else the reason it is not (triton missing, or an Autotuner without the
    methods it wraps): the kernels then autotune as usual. Nested and repeated use is fine; the methods are restored
    when the outermost block exits. Imports triton (only call it where a Triton kernel may run)."""
    why = _enter()
    try:
        yield why
    finally:
        if why is None:
            _exit()


def install_first_config_autotune() -> Optional[str]:
    """:func:`first_config_autotune` for the rest of the process (a worker, a training run); returns the reason when
    it could not be installed, else None."""
    return _enter()


# ------------------------------------------------------------------------------------------------------------------
# kernel counts
# ------------------------------------------------------------------------------------------------------------------

#: Kernels Triton compiled (``built``) or loaded from its on-disk cache (``loaded``) since :func:`count_compiles`.
counts = {"built": 0, "loaded": 0}
_listening = [False]


def count_compiles() -> bool:
    """Count every kernel binary Triton's ``compile`` returns into :data:`counts` (chained to a listener already set).
    Returns False when this Triton has no ``knobs.compilation.listener`` or does not import. Idempotent."""
    if _listening[0]:
        return True
    try:
        import triton

        comp = triton.knobs.compilation
    except Exception:  # noqa: BLE001 -- no triton, or one without knobs
        return False
    if not hasattr(comp, "listener"):
        return False
    previous = comp.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        counts["loaded" if cache_hit else "built"] += 1
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    comp.listener = listener
    _listening[0] = True
    return True


def kernel_counts() -> dict:
    """A copy of :data:`counts`."""
    return dict(counts)
