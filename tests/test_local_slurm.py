"""scripts/local_slurm.py's cluster folder and its daemons, checked against the file system and /proc.

The folder rules (the script's docstring): the folder is refused, before anything is written and before any
daemon starts, when it or a folder on its path is a symbolic link, when it is not owned by the user or its mode
lets others in, when a folder on its path can be changed by another user, or when it holds a symbolic link. These
tests need no daemons and no SLURM (the check comes first in every action). The start/stop tests (marked
``slurm``) start a second cluster in their own folder on their own ports, next to the session's cluster of
tests/test_slurm.py, and look in /proc for every process that carries the folder's ``SLURM_CONF``.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from pathlib import Path

import pytest

from _slurm_cluster import EXIT_UNAVAILABLE, local_slurm

EXIT_USAGE, EXIT_FAILED = 2, 4
NOBODY = 65534
ETC_CONF = Path("/etc/slurm/slurm.conf")
PORTS = "26847,26848"  # not the session cluster's 26817,26818
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user's needs root")


def snapshot(top: Path) -> dict[str, tuple]:
    """Every entry under ``top`` (links not followed): type, mode, owner and the content of files and links."""
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for name in ["", *dirs, *files]:
            p = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(p)
            body = (
                os.readlink(p)
                if stat.S_ISLNK(st.st_mode)
                else Path(p).read_bytes()
                if stat.S_ISREG(st.st_mode)
                else None
            )
            out[p] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, body)
    return out


def etc_conf() -> str | None:
    return ETC_CONF.read_text() if ETC_CONF.exists() else None


def etc_after_stop(before: str | None) -> str | None:
    """What ``/etc/slurm/slurm.conf`` must hold once a second cluster has started and stopped, given what it held
    before: the copy of a running cluster (something accepts connections on its ``SlurmctldPort``) is left as it is;
    no file, or a stale copy of a cluster that is down (say, left by an earlier session), is taken over by the new
    cluster, and its ``stop`` removes it (the script's docstring: "removes its /etc/slurm/slurm.conf copy")."""
    if before is None:
        return None
    port = re.search(r"^SlurmctldPort=(\d+)", before, re.M)
    if not before.startswith("# written by canonlm scripts/local_slurm.py") or port is None:
        return before  # not the script's copy: never touched
    with socket.socket() as s:
        s.settimeout(5)
        running = s.connect_ex(("127.0.0.1", int(port.group(1)))) == 0
    return before if running else None


def assert_refused(folder: Path, names: Path, what: str, top: Path) -> None:
    """Every action refuses ``folder`` with exit code 2 and one line naming ``--dir``, the offending path
    ``names`` and ``what`` is wrong, and prints nothing else; nothing under ``top`` changes. (/etc/slurm/slurm.conf
    is not compared here: the session cluster of tests/test_slurm.py may start or stop meanwhile in another
    worker; the start/stop tests below, in the ``slurm`` group, compare it.)"""
    before = snapshot(top)
    for action in ("start", "status", "stop"):
        r = local_slurm(action, "--ports", PORTS, folder=folder, timeout=60)
        err = r.stderr.strip()
        assert r.returncode == EXIT_USAGE, f"{action}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        assert len(err.splitlines()) == 1 and err.startswith(f"local_slurm: error: --dir={str(folder)!r}: "), err
        assert f"{names} {what}" in err and "allowed:" in err, err
        assert r.stdout == "", r.stdout
    assert snapshot(top) == before


@as_root
def test_folder_owned_by_another_user_is_refused(tmp_path):
    folder = tmp_path / "cluster"
    folder.mkdir(mode=0o700)
    os.chown(folder, NOBODY, NOBODY)
    assert_refused(folder, folder, f"is owned by uid {NOBODY}", tmp_path)


@as_root
def test_folder_under_another_users_folder_is_refused(tmp_path):
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, NOBODY, NOBODY)
    assert_refused(parent / "cluster", parent, f"(on the way to the folder) is owned by uid {NOBODY}", tmp_path)


def test_symlinked_folder_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    assert_refused(tmp_path / "link", tmp_path / "link", "is a symbolic link", tmp_path)
    assert_refused(tmp_path / "link" / "cluster", tmp_path / "link", "is a symbolic link", tmp_path)


def test_symlinked_file_inside_is_refused(tmp_path):
    folder = tmp_path / "cluster"
    (folder / "etc").mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("must stay as it is")
    (folder / "etc" / "slurm.conf").symlink_to(victim)
    assert_refused(folder, folder / "etc" / "slurm.conf", "(inside the folder) is a symbolic link", tmp_path)
    assert victim.read_text() == "must stay as it is"


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701, 0o777])
def test_folder_open_to_others_is_refused(mode, tmp_path):
    folder = tmp_path / "cluster"
    folder.mkdir()
    folder.chmod(mode)
    assert_refused(folder, folder, f"has mode {mode:04o}", tmp_path)


def test_folder_in_a_world_writable_non_sticky_folder_is_refused(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    assert_refused(parent / "cluster", parent, "(on the way to the folder) has mode 0777", tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Real daemons: a second cluster in its own folder
# ---------------------------------------------------------------------------------------------------------------


def processes_of(folder: Path) -> dict[int, str]:
    """Live (not zombie) processes whose environment holds this folder's ``SLURM_CONF``: everything
    local_slurm.py started for it (munged, slurmctld and its slurmscriptd, slurmd) carries it: {pid: comm}."""
    want = f"SLURM_CONF={folder / 'etc' / 'slurm.conf'}".encode()
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (
                want in (d / "environ").read_bytes().split(b"\0")
                and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            ):
                found[int(d.name)] = (d / "comm").read_text().strip()
        except OSError:  # ended meanwhile
            continue
    return found


def start_or_skip(folder: Path, *args: str):
    r = local_slurm("start", "--ports", PORTS, *args, folder=folder, timeout=900)
    if r.returncode == EXIT_UNAVAILABLE:
        pytest.skip(f"SLURM unavailable: {(r.stderr or r.stdout).strip()}")
    return r


@pytest.mark.slurm
def test_stop_ends_every_process_start_started(tmp_path):
    folder, etc = tmp_path / "a" / "cluster", etc_after_stop(etc_conf())
    r = start_or_skip(folder)
    try:
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
        for p in (folder.parent, folder):
            st = os.lstat(p)
            assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700, p
        running = processes_of(folder)
        recorded = {f.name: int(f.read_text()) for f in folder.glob("*.pid")}
        assert {"slurmctld.pid", "slurmd.pid"} <= set(recorded), recorded
        for name, pid in recorded.items():
            assert running.get(pid) == name.removesuffix(".pid"), (name, pid, running)
        assert ("munged started" in r.stdout) == ("munged.pid" in recorded), r.stdout
        assert set(running.values()) <= {"munged", "slurmctld", "slurmscriptd", "slurmd"}, running
    finally:
        s = local_slurm("stop", folder=folder, timeout=120)
    assert s.returncode == 0, s.stderr
    assert processes_of(folder) == {}, processes_of(folder)
    assert not list(folder.glob("*.pid")) and etc_conf() == etc


@pytest.mark.slurm
def test_failed_start_stops_what_it_started(tmp_path):
    """``--timeout 0``: the daemons start, the node cannot be idle yet, the start fails (exit code 4, the logs
    printed) and every process it started is stopped again."""
    folder, etc = tmp_path / "cluster", etc_after_stop(etc_conf())
    r = start_or_skip(folder, "--timeout", "0")
    try:
        assert r.returncode == EXIT_FAILED and "did not become idle within 0 s" in r.stderr, r.stderr
        assert "slurmctld.log ---" in r.stderr, r.stderr
    finally:
        left = processes_of(folder)
        local_slurm("stop", folder=folder, timeout=120)
    assert left == {} and etc_conf() == etc, left
