"""Per-user cache root and the trust rule for directories that hold code canonlm (or a library it drives) loads.

Loading a shared library (the native Canon kernel, a Triton launcher, an inductor-compiled graph) runs its code, so a
cache directory is used only if it could not have been written by someone else. One rule, used by the native Canon
kernel cache (:mod:`canonlm.ops.canon._native`) and the kernel cache (:mod:`canonlm.utils.kernel_cache`):

* a directory is trusted if it is a real directory (not a symlink) owned by this user (``os.geteuid()``) that nobody
  else can write (no group/other write bits);
* a file is trusted if it is a regular file (not a symlink) owned by this user with no group/other write bits, in a
  trusted directory.

Everything is checked with ``os.lstat`` (a symlink is never followed). Parent directories are not checked. Every check
returns a reason (``"is a symlink"``, ``"is writable by group or others (mode 0o777)"``, ...) or None when trusted, so
callers can name why they refused a directory. Standard library only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, Optional


def user_cache_root() -> Path:
    """canonlm's per-user cache root: ``$CANONLM_CACHE``, else ``$XDG_CACHE_HOME/canonlm``, else
    ``~/.cache/canonlm`` (``~`` expanded; not created, not checked)."""
    if os.environ.get("CANONLM_CACHE"):
        return Path(os.environ["CANONLM_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "canonlm"
    return Path.home() / ".cache" / "canonlm"


def stat_problem(st: os.stat_result, is_kind: Callable[[int], bool], kind: str) -> Optional[str]:
    """Why an ``os.lstat`` result may not be trusted: a symlink, not of ``kind`` (``is_kind(st.st_mode)`` false, e.g.
    ``stat.S_ISDIR`` / "a directory"), owned by another user, or writable by group or others (None: trusted)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not is_kind(st.st_mode):
        return f"is not {kind}"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o})"
    return None


def unsafe_dir_reason(d: os.PathLike | str) -> Optional[str]:
    """Why the directory ``d`` may not hold code we load (None: it is trusted); "cannot be inspected (...)" when it
    does not exist or cannot be read."""
    try:
        st = os.lstat(d)
    except OSError as e:
        return f"cannot be inspected ({e.strerror or e})"
    return stat_problem(st, stat.S_ISDIR, "a directory")


def unsafe_file_reason(path: os.PathLike | str) -> Optional[str]:
    """Why the file ``path`` must not be loaded (None: it may be): its directory must be trusted
    (:func:`unsafe_dir_reason`) and the file itself a regular file owned by this user, not writable by others."""
    path = Path(path)
    why = unsafe_dir_reason(path.parent)
    if why is not None:
        return f"its directory {path.parent} {why}"
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be inspected ({e.strerror or e})"
    return stat_problem(st, stat.S_ISREG, "a regular file")


def usable_dir(d: os.PathLike | str) -> Optional[str]:
    """Create ``d`` and its missing parents (the leaf with mode 0o700) if missing; return why it cannot hold our
    caches (cannot be created, or :func:`unsafe_dir_reason`), or None."""
    try:
        Path(d).mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        return f"cannot be created ({e.strerror or e})"
    return unsafe_dir_reason(d)
