"""Helpers of tests/test_slurm.py: the one-node cluster of scripts/local_slurm.py, and jobs on it.

Everything talks to the real daemons: ``sbatch`` / ``scontrol`` / ``scancel`` run as subprocesses with
``SLURM_CONF`` pointing at the cluster's ``slurm.conf``. Every wait polls with short sleeps and has a bound; a
failure message carries the job's output files and ``scontrol show job`` (:func:`job_report`).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "local_slurm.py"
EXIT_UNAVAILABLE = 3  # local_slurm.py: SLURM cannot be installed or started here
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "SPECIAL_EXIT",
}


@dataclass
class ClusterHandle:
    """The running cluster: its folder, its ``slurm.conf`` and whether this test session started it."""

    dir: Path
    conf: Path
    started: bool


def script_module():
    """scripts/local_slurm.py as a module (stdlib only), for its constants (``DEFAULT_DIR``)."""
    spec = importlib.util.spec_from_file_location("local_slurm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cluster_dir() -> Path:
    """The session cluster's folder: ``$CANONLM_SLURM_DIR``, else the script's default."""
    return Path(os.environ.get("CANONLM_SLURM_DIR", script_module().DEFAULT_DIR))


def local_slurm(
    action: str, *args: str, timeout: float = 900, folder: Path | None = None
) -> subprocess.CompletedProcess:
    """``python scripts/local_slurm.py <action> --dir <folder or cluster_dir()> <args>`` (stdlib only; any
    interpreter runs it)."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), action, "--dir", str(folder or cluster_dir()), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def scontrol_show(job: str) -> str:
    r = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30)
    return (r.stdout + r.stderr).strip()


def job_info(job: str) -> dict[str, str]:
    """``scontrol -o show job <id>`` as ``{key: value}`` (values up to the next space); ``{}`` when Slurm no longer
    knows the job."""
    r = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout))


def job_report(job: str | None, *files: Path) -> str:
    """``scontrol show job`` and the last 80 lines of each file (job output, train.log ...), for failure messages."""
    parts = [f"--- scontrol show job {job} ---\n{scontrol_show(job)}"] if job else []
    for f in files:
        for p in sorted(f.parent.glob(f.name)) if any(c in f.name for c in "*?[") else [f]:
            try:
                text = "\n".join(p.read_text(errors="replace").splitlines()[-80:])
            except OSError as e:
                text = f"(unreadable: {e.strerror})"
            parts.append(f"--- {p} ---\n{text}")
    return "\n".join(parts)


def wait_until(
    pred, timeout: float, what: str, job: str | None = None, files: tuple[Path, ...] = (), interval: float = 0.2
):
    """Poll ``pred()`` every ``interval`` seconds until it returns a truthy value (returned) or ``timeout`` seconds
    pass (AssertionError naming ``what``, with :func:`job_report`)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{job_report(job, *files)}")
        time.sleep(interval)


def wait_job_end(job: str, timeout: float, files: tuple[Path, ...] = ()) -> dict[str, str]:
    """Wait until ``job`` is in a final state (a requeued job passes through PENDING again: not final); return its
    ``scontrol`` fields. The job record stays for ``MinJobAge`` (600 s on the test cluster) after it ends."""

    def done():
        info = job_info(job)
        return info if info.get("JobState") in FINAL_STATES else None

    return wait_until(done, timeout, f"job {job} to end", job, files, interval=0.5)
