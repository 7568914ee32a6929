#!/usr/bin/env python3
"""A one-node SLURM cluster on this machine, for tests and for trying slurm/launch.py and the submitit launcher.

    python3 scripts/local_slurm.py start     # install SLURM if missing (root, apt), start munged/slurmctld/slurmd
    python3 scripts/local_slurm.py status    # exit 0 when sinfo answers and the node is up, 1 otherwise
    python3 scripts/local_slurm.py stop      # cancel its jobs, stop exactly the daemons `start` started

Folder: ``--dir`` or ``$CANONLM_SLURM_DIR`` (default ``/run/canonlm-slurm``, in a folder only root can write to)
holds everything the cluster writes: ``etc/slurm.conf``, ``state/`` (slurmctld), ``spool/`` (slurmd),
``log/slurmctld.log``, ``log/slurmd.log``, the daemons' output (``log/*.out``) and the pid files of every daemon
it started (``slurmctld.pid``, ``slurmd.pid``, ``munged.pid``: this script's records, apart from the daemons' own
pid files in ``run/``, which a daemon truncates and rewrites while it starts). Needs only the Python standard library (run it with the system ``python3``).

The folder is private (root runs daemons that read its config; whoever could write there could run code as root).
Every action (``start``, ``stop``, ``status``) first checks it and refuses it, with exit code 2 and one message
naming the path and what is wrong, before it writes anything or starts any daemon, when: the folder or one of the
folders on its path is a symbolic link (none is followed); the folder is not owned by the user running the script,
or its mode lets group or others in (anything but ``0700``); a folder on its path is owned by another user than
root or that user, or is writable by others without the sticky bit (they could swap the folder); or anything
inside it is a symbolic link. ``start`` creates what is missing with mode ``0700`` (and checks it again).

What ``start`` does, in order:

1. SLURM and munge: when ``slurmctld``, ``slurmd``, ``sbatch`` or ``munged`` is missing, ``apt-get update`` then
   ``apt-get install -y slurm-wlm munge`` (Debian/Ubuntu packages; Slurm 22.05 on Debian 12). Not root, no
   apt-get, or a failed install: exit code 3 with the reason (the tests skip on it).
2. munge: creates ``/etc/munge/munge.key`` with ``mungekey --create`` when missing (the munge package's install
   normally made it); starts ``munged --foreground`` as the ``munge`` user, detached, unless a munged already
   answers (``munge -n | unmunge``), and records its pid in ``munged.pid`` at once (output in ``log/munged.out``);
   when it does not answer within 5 s it is stopped again. A munged it did not start is left alone.
3. ``slurm.conf`` (in the folder): one node named as ``slurmd -C`` names this machine, with its CPUs, sockets,
   cores and threads -- but at least ``--cpus`` CPUs (default 4: a 2-core machine is declared as one socket of 4
   cores with ``SlurmdParameters=config_overrides``, so a 3- or 4-rank CPU job can be tested on it; the ranks then
   share the real cores) --, and its memory less 10 % (at least 1 GiB) of headroom; controller and node on 127.0.0.1
   (``SlurmctldHost=localhost(127.0.0.1)``, ``NodeAddr=127.0.0.1``), ports 26817/26818 (``--ports``) so a real
   installation on 6817/6818 is not disturbed; ``SlurmUser=root``; no cgroups (``ProctrackType=proctrack/linuxproc``,
   ``TaskPlugin=task/none``, and no ``cgroup.conf``); ``select/cons_tres`` with ``CR_Core_Memory`` and
   ``DefMemPerCPU=1024`` (a job without ``--mem`` takes 1 GiB per CPU, not the whole node); accounting, job
   accounting and job completion logging off; one partition ``debug``, the default. Daemons listen on every
   interface (Slurm 22.05 has no bind-address setting) but every address the cluster uses is 127.0.0.1; a port
   already in use (another cluster, e.g. one kept in another folder) is refused (exit code 2) before anything is
   written. The same text goes to ``/etc/slurm/slurm.conf`` (where ``sinfo``, ``sbatch`` and submitit look by
   default, mode 0644) when that file does not exist, or was written by this script (its first line says so) for
   this folder or for a cluster whose port no daemon listens on; a foreign one, or the copy of another running
   cluster, is never touched, and then clients need ``SLURM_CONF=<dir>/etc/slurm.conf`` (``start`` and
   ``status`` print the line to export; the daemons and this script always use it; only the folder's owner can
   read it).
4. ``slurmctld -D -c`` (an empty queue) and ``slurmd -D -N <node>``, in the foreground and detached (their pids
   recorded as they start; their stdout and stderr in ``log/slurmctld.out`` and ``log/slurmd.out``), then polls ``sinfo`` every 0.2 s until the node
   is idle (``--timeout`` seconds, default 60); when a daemon exits or the time is up it prints both daemons' logs,
   stops every daemon it started (munged included) and exits with code 4. Already up: says so and exits 0
   (``start`` is idempotent).

Requeue timing. A requeued job (``scontrol requeue``, or a job requeueing itself on the warning signal) is held
until ``BeginTime = now + cred_expire + 1`` seconds: Slurm 22.05's ``batch_requeue_fini()`` (job_mgr.c) sets that
so the new launch credential is newer than the revocation of the old one, and ``cred_expire`` is 120 s unless
``AuthInfo=cred_expire=N`` (slurm_cred.c; at least 5) says otherwise. This cluster sets ``cred_expire=10``, so a
requeued job restarts about 11 s later (``--cred-expire``); on any cluster ``scontrol update JobId=<id>
StartTime=now`` releases a waiting job earlier. ``SchedulerParameters=sched_interval=2`` makes the scheduler look at the queue every 2 s
(default 60), so a job whose BeginTime has passed starts within seconds. ``KillWait=30`` (Slurm's default): a job
that is cancelled or requeued gets SIGTERM and 30 s to save before SIGKILL.

``stop`` cancels the cluster's jobs, stops the daemons recorded in the folder's pid files (slurmd, slurmctld and
munged when this script started it; each checked by its process name, so a reused pid is never signalled) and
removes its ``/etc/slurm/slurm.conf`` copy. The folder, the installed packages and the munge key stay.

Exit codes: 0 ok (status: up); 1 status: not up; 2 bad arguments (an unsafe folder, a port in use); 3 SLURM cannot
be installed or started here (not root, no apt-get, install failed); 4 the daemons did not come up (logs printed).
"""

from __future__ import annotations

import argparse
import errno
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

MARKER = "# written by canonlm scripts/local_slurm.py"
ETC_CONF = Path("/etc/slurm/slurm.conf")
MUNGE_KEY = Path("/etc/munge/munge.key")
DEFAULT_DIR = "/run/canonlm-slurm"
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")
EXIT_OK, EXIT_DOWN, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_FAILED = 0, 1, 2, 3, 4


class Unavailable(Exception):
    """SLURM cannot be installed or started on this machine (exit code 3)."""


class StartFailed(Exception):
    """The daemons were started but the cluster did not come up (exit code 4)."""


class Refused(Exception):
    """An argument this script will not use: an unsafe folder, a port in use (exit code 2, nothing written). The
    message names the flag, its value, what is wrong and what is allowed."""

    def __init__(self, flag: str, value: str, what: str, allowed: str):
        super().__init__(f"{flag}={value!r}: {what}; allowed: {allowed}")


def say(msg: str) -> None:
    print(f"[local_slurm] {msg}", flush=True)


def which(name: str) -> str | None:
    """``shutil.which`` that also looks in the sbin folders (daemons live there; a non-root PATH may lack them)."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


ALLOWED_DIR = (
    "a folder this script creates, or one owned by you with mode 0700, reached through no "
    "symbolic link and no folder that users other than root and you can write to (unless it is sticky, "
    "like /tmp), with no symbolic link inside"
)


def private_dir(path: Path, create: bool, folder: Path | None = None) -> bool:
    """Check (and with ``create``, make) the cluster folder ``path`` (absolute, not resolved) and every folder on
    its way from ``/``, without following a symbolic link (``os.lstat`` on each component; ``os.mkdir`` never
    follows one either). Returns False when the folder does not exist and ``create`` is false. Missing folders
    are created with mode 0700. Raises :class:`Refused` naming the first offending path and what is wrong:
    a symbolic link or a non-folder anywhere on the path; a folder on the way owned by another user than root
    or you, or writable by group/others without the sticky bit (``S_ISVTX``); the folder itself not owned by
    you (``os.geteuid()``) or with any group/other permission bit; a symbolic link anywhere inside it. With
    ``folder`` (the cluster folder that holds ``path``; the message names it as ``--dir``), ``path`` may also
    be readable by others (slurmd makes its spool folder 0755), not writable."""
    uid = os.geteuid()

    def refuse(what: str):
        raise Refused("--dir", str(folder or path), what, ALLOWED_DIR)

    parts = path.parts
    for i in range(1, len(parts) + 1):
        p, last = Path(*parts[:i]), i == len(parts)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            if not create:
                return False
            try:
                os.mkdir(p, 0o700)
            except FileExistsError:  # made meanwhile by someone else: checked below like any existing folder
                pass
            st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            refuse(f"{p} is a symbolic link (no link is followed; give the real path)")
        if not stat.S_ISDIR(st.st_mode):
            refuse(f"{p} is not a folder")
        mode = stat.S_IMODE(st.st_mode)
        if last:
            if st.st_uid != uid:
                refuse(f"{p} is owned by {_user(st.st_uid)}, not by {_user(uid)} who runs this script")
            if mode & (0o022 if folder else 0o077):
                refuse(f"{p} has mode {mode:04o}, open to other users (chmod 700 {p} if it is yours)")
        elif st.st_uid not in (0, uid):
            refuse(f"{p} (on the way to the folder) is owned by {_user(st.st_uid)}, who could replace what it holds")
        elif mode & 0o022 and not mode & stat.S_ISVTX:
            refuse(
                f"{p} (on the way to the folder) has mode {mode:04o}: other users can write to it and "
                f"replace what it holds"
            )
    for top, dirs, files in os.walk(path):  # os.walk lists links to folders in `dirs` and never enters them
        for name in dirs + files:
            if os.path.islink(os.path.join(top, name)):
                refuse(f"{os.path.join(top, name)} (inside the folder) is a symbolic link")
    return True


def port_in_use(port: int) -> bool:
    """True when a process listens on TCP ``port`` (a bind with ``SO_REUSEADDR``, as the daemons do, fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _write(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path``; never through a symbolic link (``O_NOFOLLOW``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _read(path: Path) -> str:
    """The text of ``path``; never through a symbolic link (``O_NOFOLLOW``); raises OSError."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:
        return f.read()


class Cluster:
    """Paths and commands of the cluster kept in ``root`` (see the module docstring)."""

    def __init__(
        self, root: Path, ctld_port: int = 26817, slurmd_port: int = 26818, cred_expire: int = 10, min_cpus: int = 4
    ):
        self.root = Path(os.path.abspath(root))  # not resolved: private_dir refuses a link on the way
        self.conf = self.root / "etc" / "slurm.conf"
        self.state = self.root / "state"
        self.spool = self.root / "spool"
        self.logs = self.root / "log"
        self.ctld_pid = self.root / "slurmctld.pid"  # this script's records of the daemons it started
        self.slurmd_pid = self.root / "slurmd.pid"
        # the daemons' own pid files (slurm.conf's SlurmctldPidFile / SlurmdPidFile), apart from the records: a
        # daemon truncates and rewrites its file while starting, and a record read then would be empty
        self.daemon_run = self.root / "run"
        self.munged_pid = self.root / "munged.pid"  # a munged this script started
        self.etc_owned = self.root / "etc-slurm-conf.written"  # /etc/slurm/slurm.conf is this cluster's copy
        self.header = f"{MARKER} for the one-node test cluster in {self.root}"
        self.ctld_port, self.slurmd_port, self.cred_expire = ctld_port, slurmd_port, cred_expire
        self.min_cpus = min_cpus
        self.cpus_raised = False  # node_line declared more CPUs than slurmd -C found

    def exists(self) -> bool:
        """The folder exists and is safe to use (:func:`private_dir`; raises :class:`Refused`)."""
        return private_dir(self.root, create=False)

    # ---- environment -----------------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """The environment for Slurm commands and daemons: ``SLURM_CONF`` pointing at this cluster's file."""
        path = os.environ.get("PATH", "")
        extra = [d for d in SBIN if d not in path.split(os.pathsep)]
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": os.pathsep.join([path, *extra])}

    def run(self, *cmd: str, timeout: float = 15) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; never raises for a non-zero exit or a timeout."""
        try:
            return subprocess.run(
                list(cmd), env=self.env(), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(list(cmd), 124, "", f"timed out after {timeout} s")
        except FileNotFoundError as e:
            return subprocess.CompletedProcess(list(cmd), 127, "", str(e))

    # ---- state -----------------------------------------------------------------------------------------------
    @staticmethod
    def _alive(pid_file: Path, comm: str) -> int | None:
        """The pid in ``pid_file`` when that process runs and is ``comm`` (guards against a reused pid)."""
        try:
            pid = int(_read(pid_file).split()[0])
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm and _running(pid):
                return pid
        except (OSError, ValueError, IndexError):
            pass
        return None

    def node_state(self) -> str | None:
        """``sinfo``'s state of the node (``idle``, ``mix``, ``alloc``, ``down*`` ...), or None when it does not
        answer."""
        if not self.conf.exists():
            return None
        r = self.run("sinfo", "-h", "-N", "-o", "%t", timeout=10)
        lines = r.stdout.split()
        return lines[0] if r.returncode == 0 and lines else None

    def is_up(self) -> bool:
        """Both daemons of this folder run and the node is usable (idle, mixed or allocated, and responding)."""
        if not (self._alive(self.ctld_pid, "slurmctld") and self._alive(self.slurmd_pid, "slurmd")):
            return False
        st = self.node_state()
        return st is not None and st.rstrip("~#%") in ("idle", "mix", "alloc")

    def client_hint(self) -> str:
        if self._etc_header() == self.header:
            return f"clients find the config at {ETC_CONF} (SLURM_CONF={self.conf} works too)"
        return f"clients need: export SLURM_CONF={self.conf}"

    # ---- installation ----------------------------------------------------------------------------------------
    @staticmethod
    def ensure_installed() -> None:
        """Install ``slurm-wlm`` and ``munge`` with apt-get when a command is missing; raises Unavailable."""
        missing = [c for c in ("slurmctld", "slurmd", "sbatch", "sinfo", "munged", "munge") if not which(c)]
        if not missing:
            return
        if os.geteuid() != 0:
            raise Unavailable(
                f"SLURM is not installed (missing: {', '.join(missing)}) and installing it needs "
                f"root: run `apt-get install -y slurm-wlm munge` as root, or this script as root"
            )
        if not shutil.which("apt-get"):
            raise Unavailable(
                f"SLURM is not installed (missing: {', '.join(missing)}) and there is no apt-get "
                f"to install it; install Slurm and munge with this system's package manager"
            )
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "slurm-wlm", "munge"]):
            say("running " + " ".join(cmd))
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if r.returncode != 0:
                raise Unavailable(f"`{' '.join(cmd)}` failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
        still = [c for c in missing if not which(c)]
        if still:
            raise Unavailable(
                f"apt-get installed slurm-wlm and munge but these commands are still missing: {', '.join(still)}"
            )

    # ---- munge -----------------------------------------------------------------------------------------------
    def munge_works(self) -> bool:
        try:
            cred = subprocess.run(
                [which("munge") or "munge", "-n"], capture_output=True, timeout=10, stdin=subprocess.DEVNULL
            )
            if cred.returncode != 0:
                return False
            r = subprocess.run([which("unmunge") or "unmunge"], input=cred.stdout, capture_output=True, timeout=10)
            return r.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def start_munge(self) -> None:
        """Start ``munged --foreground`` as user ``munge`` (detached: its own session, no pipes) unless one answers
        already, recording its pid in ``munged.pid`` before the health check; create the key first when it is
        missing. A munged that does not answer within 5 s is stopped (raises StartFailed)."""
        if self.munge_works():
            say("munged already answers; using it")
            return
        try:
            pw = pwd.getpwnam("munge")
        except KeyError:
            raise Unavailable("there is no `munge` user (the munge package creates it): reinstall munge") from None
        if not MUNGE_KEY.exists():
            say(f"creating {MUNGE_KEY}")
            tool = which("mungekey")
            cmd = (
                [tool, "--create", "--keyfile", str(MUNGE_KEY)]
                if tool
                else [which("create-munge-key") or "create-munge-key"]
            )
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise StartFailed(f"could not create {MUNGE_KEY}: {r.stderr.strip()}")
            os.chown(MUNGE_KEY, pw.pw_uid, pw.pw_gid)
            MUNGE_KEY.chmod(0o600)
        for d, mode in ((Path("/run/munge"), 0o755), (Path("/var/log/munge"), 0o700), (Path("/var/lib/munge"), 0o711)):
            if not d.exists():
                d.mkdir(parents=True, mode=mode)
                os.chown(d, pw.pw_uid, pw.pw_gid)
        stale = Path("/run/munge/munged.pid")
        if stale.exists() and not self._alive(stale, "munged"):
            stale.unlink()
        proc = self._spawn(
            [which("munged"), "--foreground"], self.munged_pid, user=pw.pw_uid, group=pw.pw_gid, extra_groups=[]
        )
        for _ in range(50):
            if self.munge_works():
                say(f"munged started (pid {proc.pid})")
                return
            if proc.poll() is not None:
                raise StartFailed(f"munged exited with {proc.returncode}\n" + _tail(Path("/var/log/munge/munged.log")))
            time.sleep(0.1)
        raise StartFailed("munged started but `munge -n | unmunge` fails\n" + _tail(Path("/var/log/munge/munged.log")))

    # ---- configuration ---------------------------------------------------------------------------------------
    def node_line(self) -> str:
        """``slurmd -C``'s node line with the memory less headroom and the loopback address; a machine with fewer
        than ``min_cpus`` CPUs is declared with ``min_cpus`` (one socket of that many cores; :meth:`render` then adds
        ``SlurmdParameters=config_overrides`` so slurmd takes the declared count)."""
        r = subprocess.run(
            [which("slurmd") or "slurmd", "-C"],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "SLURM_CONF": "/dev/null"},
        )
        first = next((ln for ln in r.stdout.splitlines() if ln.startswith("NodeName=")), None)
        if r.returncode != 0 or first is None:
            raise StartFailed(f"`slurmd -C` did not print a node line (exit {r.returncode}): {r.stdout}{r.stderr}")
        fields = dict(tok.split("=", 1) for tok in first.split())
        mem = int(fields.get("RealMemory", "2048"))
        fields["RealMemory"] = str(max(mem - max(1024, mem // 10), 512))
        self.cpus_raised = int(fields.get("CPUs", "1")) < self.min_cpus
        if self.cpus_raised:
            fields.update(
                CPUs=str(self.min_cpus),
                Boards="1",
                SocketsPerBoard="1",
                CoresPerSocket=str(self.min_cpus),
                ThreadsPerCore="1",
            )
        keep = ("NodeName", "CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
        return " ".join(f"{k}={fields[k]}" for k in keep if k in fields) + " NodeAddr=127.0.0.1 State=UNKNOWN"

    def render(self, node_line: str) -> str:
        node = node_line.split()[0].split("=", 1)[1]
        overrides = (
            (
                "# more CPUs declared than this machine has (--cpus): slurmd takes the declared count\n"
                "SlurmdParameters=config_overrides\n"
            )
            if self.cpus_raised
            else ""
        )
        return f"""{self.header}
# (`python3 scripts/local_slurm.py stop` removes this copy; a file without the first line is never overwritten)
ClusterName=canonlm
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire={self.cred_expire}
StateSaveLocation={self.state}
SlurmdSpoolDir={self.spool}
SlurmctldPidFile={self.daemon_run}/slurmctld.pid
SlurmdPidFile={self.daemon_run}/slurmd.pid
SlurmctldLogFile={self.logs}/slurmctld.log
SlurmdLogFile={self.logs}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
InactiveLimit=0
{overrides}{node_line}
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""

    @staticmethod
    def _etc_header() -> str | None:
        """The first line of ``/etc/slurm/slurm.conf`` when this script wrote it (any folder's cluster), else None."""
        try:
            first = _read(ETC_CONF).split("\n", 1)[0]
        except OSError:
            return None
        return first if first.startswith(MARKER) else None

    def _etc_free(self) -> bool:
        """``/etc/slurm/slurm.conf`` may be (over)written for this cluster: absent, this folder's copy, or the
        copy of another folder's cluster whose slurmctld port nothing listens on (that cluster is down)."""
        header = self._etc_header()
        if not ETC_CONF.exists() or header == self.header:
            return True
        if header is None:
            return False
        port = next((ln.split("=", 1)[1] for ln in _read(ETC_CONF).splitlines() if ln.startswith("SlurmctldPort=")), "")
        return port.isdigit() and not port_in_use(int(port))

    def write_config(self) -> str:
        """Write ``etc/slurm.conf`` (and ``/etc/slurm/slurm.conf`` when :meth:`_etc_free`); return the node name."""
        line = self.node_line()
        text = self.render(line)
        _write(self.conf, text)
        if self._etc_free():
            try:
                ETC_CONF.parent.mkdir(parents=True, exist_ok=True)
                _write(ETC_CONF, text, 0o644)
                _write(self.etc_owned, f"{ETC_CONF}\n")
            except OSError as e:
                say(f"could not write {ETC_CONF} ({e}); clients need SLURM_CONF={self.conf}")
        else:
            say(f"{ETC_CONF} was not written by this script, or is the copy of another running cluster: left as it is")
        return line.split()[0].split("=", 1)[1]

    # ---- start / stop ----------------------------------------------------------------------------------------
    def start(self, timeout: float) -> None:
        """Check the folder, install when needed, start munged/slurmctld/slurmd and wait for the node. Raises
        :class:`Refused` (nothing written), :class:`Unavailable` or :class:`StartFailed` (then every daemon it
        started has been stopped again)."""
        exists = self.exists()
        if exists and self.is_up():
            say(f"already up ({self.root}); node {self.node_state()}; {self.client_hint()}")
            return
        if os.geteuid() != 0:
            self.ensure_installed()  # names what is missing, if anything
            raise Unavailable(
                "starting slurmd/slurmctld needs root (SlurmUser=root; slurmd runs jobs as their "
                "users): run `python3 scripts/local_slurm.py start` as root"
            )
        if exists:
            self.stop(quiet=True)  # leftovers of a half-started cluster in this folder
        busy = [p for p in (self.ctld_port, self.slurmd_port) if port_in_use(p)]
        if busy:
            raise Refused(
                "--ports",
                f"{self.ctld_port},{self.slurmd_port}",
                f"port {busy[0]} is in use (another cluster, e.g. one kept in another folder, or another service)",
                "two free ports; stop the other cluster or choose --ports",
            )
        self.ensure_installed()
        private_dir(self.root, create=True)
        for d in (self.conf.parent, self.state, self.spool, self.logs, self.daemon_run):
            private_dir(d, create=True, folder=self.root)
        try:
            self._start_daemons(timeout)
        except BaseException:
            self.stop(quiet=True)
            raise

    def _spawn(self, cmd: list[str], pid_file: Path, **kw) -> subprocess.Popen:
        """Start the daemon ``cmd`` in the foreground, detached (its own session; stdout and stderr to
        ``log/<name>.out``, no pipe to this script), and record its pid in ``pid_file`` at once, before anything
        can fail: a daemon that forks itself would write its pid file only later, leaving a gap in which a
        failed start could not find it."""
        out = os.open(
            self.logs / f"{Path(cmd[0]).name}.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600
        )
        try:
            proc = subprocess.Popen(
                cmd,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **kw,
            )
        finally:
            os.close(out)
        _write(pid_file, f"{proc.pid}\n")
        return proc

    def _start_daemons(self, timeout: float) -> None:
        self.start_munge()
        node = self.write_config()
        t0 = time.monotonic()
        procs = {
            "slurmctld": self._spawn([which("slurmctld"), "-D", "-c"], self.ctld_pid),
            "slurmd": self._spawn([which("slurmd"), "-D", "-N", node], self.slurmd_pid),
        }
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            if self.is_up():
                say(
                    f"up in {time.monotonic() - t0:.1f} s: node {node} {self.node_state()} "
                    f"({self.root}); {self.client_hint()}"
                )
                return
            for comm, proc in procs.items():
                if proc.poll() is not None:
                    raise StartFailed(
                        f"{comm} exited during start (exit {proc.returncode}):\n" + _tail(self.logs / f"{comm}.out")
                    )
            st = self.node_state()
            time.sleep(0.2)
        raise StartFailed(f"the node did not become idle within {timeout:.0f} s (sinfo state: {st})")

    def _cancel_jobs(self) -> None:
        r = self.run("squeue", "-h", "-o", "%i", timeout=10)
        ids = r.stdout.split() if r.returncode == 0 else []
        if not ids:
            return
        say(f"cancelling the cluster's jobs: {' '.join(ids)}")
        self.run("scancel", *ids, timeout=15)
        for _ in range(100):  # up to ~20 s for the steps to end (SIGTERM; KillWait later SIGKILL)
            r = self.run("squeue", "-h", "-o", "%i", timeout=10)
            if r.returncode != 0 or not r.stdout.split():
                return
            time.sleep(0.2)

    def stop(self, quiet: bool = False) -> None:
        """Cancel the cluster's jobs, then stop slurmd, slurmctld and munged (when this script started it): every
        daemon recorded in the folder's pid files; remove this folder's ``/etc/slurm/slurm.conf`` copy."""
        if self._alive(self.ctld_pid, "slurmctld") and self._alive(self.slurmd_pid, "slurmd"):
            self._cancel_jobs()
        stopped, stuck = [], []
        procs = [
            (self._alive(pid_file, comm), comm, pid_file)
            for pid_file, comm in (
                (self.slurmd_pid, "slurmd"),
                (self.ctld_pid, "slurmctld"),
                (self.munged_pid, "munged"),
            )
        ]
        for pid, comm, pid_file in procs:
            try:
                if _terminate(pid):
                    stopped.append(comm)
                pid_file.unlink(missing_ok=True)
            except StartFailed as e:  # go on with the others; the record stays for the next stop
                stuck.append(f"{comm}: {e}")
        for pid, comm in self._strays():  # e.g. a child a daemon forked while it was being stopped mid-start
            try:
                if _terminate(pid):
                    stopped.append(f"{comm} (pid {pid}, unrecorded)")
            except StartFailed as e:
                stuck.append(f"{comm}: {e}")
        if self.etc_owned.exists():
            if self._etc_header() == self.header:
                ETC_CONF.unlink()
            self.etc_owned.unlink()
        if not quiet:
            say(f"stopped {', '.join(stopped)}" if stopped else f"nothing of {self.root} was running")
        if stuck:
            raise StartFailed("could not stop " + "; ".join(stuck))

    def _strays(self) -> list[tuple[int, str]]:
        """(pid, name) of the Slurm processes still running with this cluster's ``SLURM_CONF`` in their environment
        (every daemon this script starts gets it, and their children inherit it): a child a daemon forked while it
        started, which no pid file records. Processes whose environment cannot be read are skipped."""
        want = f"SLURM_CONF={self.conf}".encode()
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                comm = (d / "comm").read_text().strip()
                if (
                    comm in ("slurmctld", "slurmd", "slurmscriptd", "slurmstepd")
                    and want in (d / "environ").read_bytes().split(b"\0")
                    and _running(int(d.name))
                ):
                    out.append((int(d.name), comm))
            except OSError:
                continue
        return out

    def logs_text(self) -> str:
        return "\n".join(f"--- {p} ---\n{_tail(p)}" for p in (self.logs / "slurmctld.log", self.logs / "slurmd.log"))


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(_read(path).splitlines()[-n:])
    except (OSError, UnicodeDecodeError) as e:
        return f"(cannot read {path}: {getattr(e, 'strerror', e)})"


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie. A daemon detaches from this script, so when it exits its parent is the
    machine's init, which in some containers never reaps it: a zombie that ``kill(pid, 0)`` still finds."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_line.rsplit(")", 1)[-1].split()[0] != "Z"


def _terminate(pid: int | None, wait: float = 10.0) -> bool:
    """SIGTERM ``pid``, SIGKILL after ``wait`` seconds, and return only once the process is gone (or a zombie; up
    to ``wait`` seconds more after SIGKILL, which ends any process but one stuck in the kernel); True when there
    was a process. Raises :class:`StartFailed` when it still runs then."""
    if not pid:
        return False
    try:
        os.kill(pid, signal.SIGTERM)
        for sig in (signal.SIGKILL, None):
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if not _running(pid):
                    return True
                time.sleep(0.05)
            if sig is not None:
                os.kill(pid, sig)
    except ProcessLookupError:
        return True
    raise StartFailed(f"process {pid} still runs {wait:.0f} s after SIGKILL")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("start", "stop", "status"))
    ap.add_argument(
        "--dir",
        default=os.environ.get("CANONLM_SLURM_DIR", DEFAULT_DIR),
        help=f"the cluster's folder (default: $CANONLM_SLURM_DIR or {DEFAULT_DIR})",
    )
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the node to become idle")
    ap.add_argument(
        "--ports",
        default=os.environ.get("CANONLM_SLURM_PORTS", "26817,26818"),
        help="slurmctld,slurmd ports (default: $CANONLM_SLURM_PORTS or 26817,26818)",
    )
    ap.add_argument(
        "--cpus",
        type=int,
        default=4,
        help="CPUs the node declares at least (default 4): a machine with fewer is declared with this "
        "many (SlurmdParameters=config_overrides; TaskPlugin=task/none binds nothing), so jobs of "
        "up to that many 1-CPU ranks run on a 2-core machine",
    )
    ap.add_argument(
        "--cred-expire",
        type=int,
        default=10,
        help="AuthInfo=cred_expire (seconds, >= 5); a requeued job waits this + 1 s (default 10)",
    )
    args = ap.parse_args(argv)
    try:
        ctld_port, slurmd_port = (int(p) for p in args.ports.split(","))
        if not (1 <= ctld_port <= 65535 and 1 <= slurmd_port <= 65535 and ctld_port != slurmd_port):
            raise ValueError
    except ValueError:
        print(
            f"local_slurm: error: --ports={args.ports!r}; allowed: two different port numbers, e.g. 26817,26818",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.cred_expire < 5:
        print(
            f"local_slurm: error: --cred-expire={args.cred_expire}; allowed: an integer >= 5 (seconds; Slurm "
            f"ignores smaller values)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not 1 <= args.cpus <= 4096:
        print(f"local_slurm: error: --cpus={args.cpus}; allowed: an integer from 1 to 4096", file=sys.stderr)
        return EXIT_USAGE
    cl = Cluster(Path(args.dir), ctld_port, slurmd_port, args.cred_expire, args.cpus)
    try:
        if args.action == "status":
            if cl.exists() and cl.is_up():
                say(f"up: node {cl.node_state()} ({cl.root}); {cl.client_hint()}")
                return EXIT_OK
            ctld, slurmd = cl._alive(cl.ctld_pid, "slurmctld"), cl._alive(cl.slurmd_pid, "slurmd")
            state = f", sinfo node state {cl.node_state()}" if ctld else ""  # sinfo retries for seconds without one
            say(
                f"down ({cl.root}: slurmctld {'runs' if ctld else 'not running'}, "
                f"slurmd {'runs' if slurmd else 'not running'}{state})"
            )
            return EXIT_DOWN
        if args.action == "stop":
            if cl.exists():
                cl.stop()
            else:
                say(f"nothing of {cl.root} was running (no such folder)")
            return EXIT_OK
        cl.start(args.timeout)
        return EXIT_OK
    except Refused as e:
        print(f"local_slurm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Unavailable as e:
        print(f"local_slurm: unavailable: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (StartFailed, subprocess.TimeoutExpired) as e:
        print(f"local_slurm: error: {e}\n{cl.logs_text()}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
