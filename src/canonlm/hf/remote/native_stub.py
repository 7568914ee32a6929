"""Stand-in for canonlm's native CPU Canon kernel (:mod:`canonlm.ops.canon._native`) in an export's bundled code.

The native kernel is C source that canonlm compiles on first use into a per-user cache; an export carries Python
only, so :mod:`canonlm.hf.remote.bundle` writes this module in its place. It offers no dtype, so
``canonlm.ops.canon.resolve_backend("auto", cpu, ...)`` picks the pure-PyTorch ``torch`` path without a warning
(the export's Canon layers: shift-and-add on the CPU, Dao's / fla's kernels on CUDA when installed). It names every
attribute ``canonlm.ops.canon`` reads of the native module (``tests/test_hf_clients.py`` checks that against the
source).
"""

from __future__ import annotations

SUPPORTED_DTYPES: tuple = ()  # no dtype: `auto` never chooses the native kernel
KMAX = 0
REASON = "canonlm's native CPU kernel is not part of an exported model (it runs the pure-PyTorch Canon path)"


def available() -> bool:
    """False: the kernel is not in the export."""
    return False


def unavailable_reason() -> str:
    """Why the ``cpu`` Canon backend cannot run here."""
    return REASON


def canon_conv(*args, **kwargs):
    """Never called (``available()`` is False); raises RuntimeError."""
    raise RuntimeError(REASON)
