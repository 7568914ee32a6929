"""Build cache of the native Canon CPU kernel (canonlm.ops.canon._native): the trust rule and self-repair.

Loading a shared library runs its code, so a cached ``.so`` is loaded only from a directory owned by this user that
nobody else can write, and only if the file is ours and not writable by others; a cached build that does not load
(truncated, stale ABI) is deleted and rebuilt. These tests use the real C compiler and put files exactly where the
loader looks (``_native._target_path``, every flag set). A planted library has a constructor that writes a marker
file, so loading it at all is visible. The end-to-end test runs in a fresh interpreter (the module keeps the loaded
library in module state); the others call ``_build_and_load(dir)`` / ``safe_cache_dir()`` with explicit directories.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from canonlm.ops.canon import _native
from canonlm.ops.canon.naive import canon_loop

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")

# Looks like a valid build (right ABI, every symbol the loader binds) but does nothing; its constructor writes MARKER.
STUB_C = r"""
#include <stdio.h>
#ifdef MARKER
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("planted library was loaded\n", f); fclose(f); }
}
#endif
int canon_abi(void) { return ABI; }
int canon_kmax(void) { return 64; }
int canon_has_openmp(void) { return 0; }
void canon_set_subblock(long long r) { (void)r; }
int canon_fwd(void) { return 0; }
int canon_bwd(void) { return 0; }
"""


def _compile_stub(out: Path, abi: int, marker: Path | None = None) -> Path:
    src = out.with_suffix(".c")
    src.write_text(STUB_C)
    defs = [f"-DABI={abi}"] + ([f'-DMARKER="{marker}"'] if marker is not None else [])
    subprocess.run([CC, "-shared", "-fPIC", *defs, "-o", str(out), str(src)], check=True, capture_output=True)
    return out


def _targets(d: Path) -> list[Path]:
    """Every file name the loader looks for in ``d`` (one per flag set, best first)."""
    ver = _native._toolchain()[1]
    return [_native._target_path(d, flags, ver) for flags in _native._FLAG_SETS]


def _private_dir(p: Path) -> Path:
    p.mkdir(mode=0o700)
    os.chmod(p, 0o700)
    return p


@pytest.fixture
def planted(tmp_path):
    """A library that writes ``marker`` when loaded; checked once here so a missing marker later means "not loaded"."""
    marker = tmp_path / "PLANTED_WAS_LOADED"
    lib = _compile_stub(tmp_path / "planted.so", _native._ABI, marker)
    probe = tmp_path / "probe.so"
    shutil.copy(lib, probe)
    ctypes.CDLL(str(probe))
    assert marker.exists(), "test setup: the planted library's constructor does not run"
    marker.unlink()
    return lib, marker


def _plant(lib: Path, d: Path) -> list[Path]:
    targets = _targets(d)
    for t in targets:
        shutil.copy(lib, t)
        os.chmod(t, 0o755)
    return targets


def _check_kernel(lib, monkeypatch) -> None:
    """Run the module's forward on ``lib`` and compare with the plain-loop oracle (40 channels: vector + remainder)."""
    monkeypatch.setattr(_native, "_lib", lib)
    monkeypatch.setattr(_native, "_tried", True)
    monkeypatch.setattr(_native, "_error", None)
    lib.canon_set_subblock(_native.SUBBLOCK)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 37, 40, generator=g), torch.randn(40, 4, generator=g), torch.randn(40, generator=g)
    y = _native.canon_fwd_impl(x, w, b, None, True, False)
    torch.testing.assert_close(y, canon_loop(x, w, b), rtol=1e-5, atol=1e-5)


def _no_temp_files(d: Path) -> bool:
    return not list(d.glob(".canon_cpu_*"))


# ---------------------------------------------------------------------------------------------------------------
# the trust rule
# ---------------------------------------------------------------------------------------------------------------


def test_safe_to_load_reasons(tmp_path, planted):
    lib, _ = planted
    good = _private_dir(tmp_path / "good")
    f = good / "x.so"
    shutil.copy(lib, f)
    os.chmod(f, 0o755)
    assert _native._unsafe_dir_reason(good) is None
    assert _native._safe_to_load(f) is None
    os.chmod(f, 0o775)
    assert "writable by group or others" in _native._safe_to_load(f)
    os.chmod(f, 0o755)
    (good / "link.so").symlink_to(f)
    assert "symlink" in _native._safe_to_load(good / "link.so")
    assert "cannot be inspected" in _native._safe_to_load(good / "missing.so")
    os.chmod(good, 0o777)
    assert "writable by group or others (mode 0o777)" in _native._safe_to_load(f)
    os.chmod(good, 0o770)
    assert "writable by group or others" in _native._unsafe_dir_reason(good)
    os.chmod(good, 0o755)
    assert _native._unsafe_dir_reason(good) is None
    (tmp_path / "dirlink").symlink_to(good)
    assert "symlink" in _native._unsafe_dir_reason(tmp_path / "dirlink")
    assert "symlink" in _native._safe_to_load(tmp_path / "dirlink" / "x.so")
    assert "not a directory" in _native._unsafe_dir_reason(f)


def test_planted_library_in_world_writable_cache_is_not_loaded(tmp_path, planted):
    """(a) end to end in a fresh interpreter: CANONLM_CACHE is world-writable (0o777) and holds a planted library at
    every target name. It is not loaded, the warning names the directory, and the kernel is built in ~/.cache."""
    lib, marker = planted
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    targets = _plant(lib, shared)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "CANONLM_DISABLE_NATIVE")}
    env.update(CANONLM_CACHE=str(shared), HOME=str(home))
    script = textwrap.dedent("""
        import json, torch
        from canonlm.ops.canon.naive import canon_loop
        from canonlm.ops.canon import _native
        ok = _native.available()
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(2, 37, 40, generator=g), torch.randn(40, 4, generator=g), torch.randn(40, generator=g)
        y = _native.canon_fwd_impl(x, w, b, None, True, False) if ok else None
        err = float((y - canon_loop(x, w, b)).abs().max()) if ok else None
        print(json.dumps(dict(available=ok, reason=_native.unavailable_reason(), path=str(_native._path), err=err)))
    """)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not marker.exists(), "the planted library was loaded"
    assert out["available"], out["reason"]
    assert out["err"] < 1e-5
    assert Path(out["path"]).parent == home / ".cache" / "canonlm"
    assert f"not using the native kernel cache {shared}" in r.stderr
    assert "writable by group or others (mode 0o777)" in r.stderr
    assert all(t.read_bytes() == lib.read_bytes() for t in targets)  # an unsafe directory is not touched


def test_unsafe_dir_is_refused_by_build_and_load(tmp_path, planted):
    lib, marker = planted
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    _plant(lib, shared)
    with pytest.raises(RuntimeError, match="refusing kernel cache directory"):
        _native._build_and_load(shared)
    assert not marker.exists()


def test_fallback_directories(tmp_path, monkeypatch):
    """An unsafe configured directory falls back to ~/.cache/canonlm, else to a private temp dir; warns once."""
    monkeypatch.setattr(_native, "_warned_dirs", set())
    monkeypatch.setattr(_native, "_private_dir", None)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("CANONLM_CACHE", str(shared))
    with pytest.warns(RuntimeWarning, match="not using the native kernel cache"):
        d = _native.safe_cache_dir()
    assert d == home / ".cache" / "canonlm"
    assert (os.stat(d).st_mode & 0o777) == 0o700  # created private
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.safe_cache_dir() == d  # once per directory
    os.chmod(d, 0o777)  # the default is unsafe too: a fresh private temp dir
    monkeypatch.setattr(_native, "_warned_dirs", set())
    with pytest.warns(RuntimeWarning, match="not using the native kernel cache"):
        p = _native.safe_cache_dir()
    assert p.parent != home / ".cache" and _native._unsafe_dir_reason(p) is None
    assert (os.stat(p).st_mode & 0o777) == 0o700
    assert _native.safe_cache_dir() == p  # reused within the process
    monkeypatch.setenv("CANONLM_CACHE", str(tmp_path / "mine"))  # a safe configured dir is used as is
    assert _native.safe_cache_dir() == tmp_path / "mine"
    assert (os.stat(tmp_path / "mine").st_mode & 0o777) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_library_owned_by_another_user_is_not_loaded(tmp_path, planted, monkeypatch):
    """(b) a planted file owned by nobody in our private cache is never loaded: deleted and rebuilt."""
    lib, marker = planted
    d = _private_dir(tmp_path / "cache")
    targets = _plant(lib, d)
    for t in targets:
        os.chown(t, 65534, 65534)
    built, path = _native._build_and_load(d)
    assert not marker.exists(), "a library owned by another user was loaded"
    assert path in targets and os.stat(path).st_uid == os.geteuid()
    assert path.read_bytes() != lib.read_bytes()
    _check_kernel(built, monkeypatch)


def test_group_writable_library_is_not_loaded(tmp_path, planted, monkeypatch):
    lib, marker = planted
    d = _private_dir(tmp_path / "cache")
    targets = _plant(lib, d)
    for t in targets:
        os.chmod(t, 0o777)
    built, path = _native._build_and_load(d)
    assert not marker.exists(), "a group/world-writable library was loaded"
    assert path in targets and (os.stat(path).st_mode & 0o777) == 0o755
    _check_kernel(built, monkeypatch)


# ---------------------------------------------------------------------------------------------------------------
# self-repair and reuse
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_build(tmp_path_factory):
    """(bytes, file name, path) of one real build of the kernel, made by the loader in an empty private directory."""
    d = tmp_path_factory.mktemp("good")
    os.chmod(d, 0o700)
    _, path = _native._build_and_load(d)
    return path.read_bytes(), path.name, path


def test_elf_check_catches_every_truncation(tmp_path, good_build):
    """dlopen of a cut ELF file can die with SIGBUS (measured: cut at 1/3 or 1/2), so truncation is caught before."""
    data, _, _ = good_build
    f = tmp_path / "x.so"
    f.write_bytes(data)
    assert _native._elf_problem(f) is None
    for n in [0, 3, 40, 100, 1000, len(data) // 3, len(data) // 2, len(data) - 2000, len(data) - 1]:
        f.write_bytes(data[:n])
        assert _native._elf_problem(f) is not None, n
    f.write_bytes(bytes(len(data)))
    assert "not an ELF file" in _native._elf_problem(f)


def _corrupt(data: bytes, how: str) -> bytes:
    if how == "truncated":
        return data[: len(data) // 3]
    if how == "zeroed":  # right size, no content (e.g. after a crash)
        return bytes(len(data))
    if how == "wrong_machine":  # whole file, but for another CPU: ctypes.CDLL raises OSError
        return data[:18] + (0x1234).to_bytes(2, "little") + data[20:]
    raise ValueError(how)


@pytest.mark.parametrize("how", ["truncated", "wrong_machine"])
def test_broken_build_is_rebuilt(tmp_path, good_build, monkeypatch, how):
    """(c) a truncated or corrupt .so at the target name is replaced by a rebuild, and the kernel works."""
    data, name, _ = good_build
    d = _private_dir(tmp_path / "cache")
    target = d / name
    assert target in _targets(d)
    target.write_bytes(_corrupt(data, how))
    os.chmod(target, 0o755)
    if how == "wrong_machine":
        assert _native._elf_problem(target) is None
        with pytest.raises(OSError):
            ctypes.CDLL(str(target))
    lib, path = _native._build_and_load(d)
    assert path == target and path.stat().st_size == len(data)
    assert _native._elf_problem(path) is None
    assert _no_temp_files(d)
    _check_kernel(lib, monkeypatch)


def test_wrong_abi_build_is_rebuilt(tmp_path, monkeypatch):
    """(d) a cached library with another ABI number (all symbols present) is deleted and rebuilt."""
    d = _private_dir(tmp_path / "cache")
    stale = _compile_stub(tmp_path / "stale.so", _native._ABI + 1)
    targets = _plant(stale, d)
    lib, path = _native._build_and_load(d)
    assert lib.canon_abi() == _native._ABI
    assert path in targets and path.read_bytes() != stale.read_bytes()
    assert _no_temp_files(d)
    _check_kernel(lib, monkeypatch)


def test_broken_cache_and_failing_compiler_reports_both(tmp_path, monkeypatch):
    """Only if the fresh build fails too is the kernel unavailable, with the loader's and compiler's messages."""
    d = _private_dir(tmp_path / "cache")
    monkeypatch.setenv("CC", "false")  # runs, compiles nothing
    targets = _targets(d)
    for t in targets:
        t.write_bytes(b"\x7fELF truncated")
        os.chmod(t, 0o755)
    with pytest.raises(RuntimeError) as e:
        _native._build_and_load(d)
    msg = str(e.value)
    assert "could not compile" in msg and "does not load (OSError" in msg
    assert not any(t.exists() for t in targets) and _no_temp_files(d)


def test_safe_cache_is_reused(tmp_path, good_build, monkeypatch):
    """(e) a cached build in a safe directory is reused: no compiler run, same inode and mtime, twice."""
    data, name, _ = good_build
    d = tmp_path / "cache"
    assert _native._usable_dir(d) is None  # created with mode 0o700
    assert (os.stat(d).st_mode & 0o777) == 0o700
    (d / name).write_bytes(data)
    os.chmod(d / name, 0o755)
    st = os.stat(d / name)
    compiles = []
    run = subprocess.run

    def counting_run(args, *a, **k):
        if "-shared" in args:
            compiles.append(args)
        return run(args, *a, **k)

    monkeypatch.setattr(_native.subprocess, "run", counting_run)
    for _ in range(2):
        lib, path = _native._build_and_load(d)
        st2 = os.stat(path)
        assert path == d / name and not compiles
        assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert sorted(p.name for p in d.iterdir()) == [name]
    _check_kernel(lib, monkeypatch)


def test_fresh_build_is_private_and_complete(good_build):
    """What a build leaves in the cache: one file, ours, mode 0o755, no temp files."""
    _, _, path = good_build
    st = os.stat(path)
    assert (st.st_mode & 0o777) == 0o755 and st.st_uid == os.geteuid()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
