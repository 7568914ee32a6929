"""The logic of ``scripts/gpu_check.sh``: its options, the checks of its inputs, the plan of its phases, each phase's
body, the key result read from each phase's log, and the summary. The shell script is only the phase runner (each
phase under coreutils ``timeout``, its output teed to ``phases.log`` as it comes).

Standard library only, Python >= 3.8: it runs with the node's ``python3`` before anything is installed.

Subcommands (``WORK`` is the runner's private temporary directory; the state lives in ``WORK/state.json``):

    gpu_check.py start WORK ARG...   parse and check ARG (gpu_check.sh's options); exit 2 naming every bad input,
                                     nothing written but WORK/state.json; with --dry-run print the plan, exit 3
    gpu_check.py next WORK           the next phase: print its header (and log it), write "NAME LIMIT" to WORK/next,
                                     or "end" when none is left; a phase that does not run is recorded as SKIP here
    gpu_check.py phase NAME WORK     a phase's body (run by the runner under ``timeout``)
    gpu_check.py done WORK NAME RC   record how the phase ended and rewrite OUT/summary.md
    gpu_check.py finish WORK         cut the log to the file limit, write the summary, print the table; exit 1 when a
                                     phase failed or timed out, else 0

Help (``bash scripts/gpu_check.sh --help``) is HELP below.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HELP = """\
One prepared check of a GPU node held for a few minutes without network (a cluster's debug queue, an air-gapped
node): install from a carried wheelhouse, restore a carried kernel cache, then warm-up, the self-check, the GPU
tests and the GPU bench, each under its own time limit, and pack the warm kernel cache for the next allocation.

  bash scripts/gpu_check.sh --out DIR [--wheelhouse DIR] [--cache-in FILE] [options]    (docs/gpu_node.md)

Phases, in order (name: what, default limit in seconds; they add up to the default --budget of 480):
  facts      nvidia-smi, Python / torch / CUDA / triton / kernel-package versions, commit                   15
  install    bash scripts/setup.sh --wheelhouse DIR EXTRAS (offline; the image's CUDA torch is kept)         60
  restore    the carried kernel cache (--cache-in, a .tar.gz) into --cache-dir, mode 0700; CANONLM_KERNEL_CACHE  20
  warmup     python -m canonlm.warmup <overrides>, for each --warmup config (GPU only; none by default)       90
  selfcheck  python -m canonlm.selfcheck --quick --budget-s <limit - 25> --out OUT/selfcheck.md --force   130
  pytest     python -m pytest -o addopts= -m gpu -ra -q (pytest-timeout per test when installed; GPU only)  100
  bench      python bench/gpu_step.py BENCH_ARGS --out WORK/bench --max-minutes (the phase's limit) (GPU only) 120
  pack       the kernel cache as OUT/kernel-cache.tar.gz (split into .00, .01, ... when over --max-file-mib)  30
A phase whose limit, cut to the time left, falls below what it needs to finish usefully (selfcheck 55 s, bench
50 s, pytest 30 s, install 20 s, warmup 30 s, the others 5 s) is skipped with the reason.
Each phase runs under coreutils `timeout` (TERM, then KILL 10 s later) with cwd = the repository root; its output goes
to OUT/phases.log as it comes (and to this terminal); a phase that fails or times out is recorded and the next one
runs. The phases before pack together never start past --budget minus pack's limit: a phase's limit is cut to the
time left, and a phase with under 5 s left is skipped. OUT/summary.md holds the facts and the table, rewritten
after every phase; the table is printed last. Without a CUDA GPU (nvidia-smi -L lists none) warmup, pytest and
bench are skipped and say so.

Options:
  --out DIR               results (created; default ./gpu-check-<date>); at most --max-files files, flat, each at
                          most --max-file-mib: summary.md, phases.log, selfcheck.md, gpu_step.jsonl, gpu_step.md,
                          kernel-cache.tar.gz (or its parts). A summary.md already there is not overwritten without
                          --force
  --wheelhouse DIR        the carried wheelhouse (scripts/wheelhouse.sh); without it install is skipped
  --extras LIST           the extras setup.sh installs (default none: the node's own pytest runs the GPU tests;
                          dev adds pytest, transformers, wandb, faker, ...: a bigger wheelhouse)
  --cache-in FILE         the kernel cache packed by an earlier run (kernel-cache.tar.gz, or FILE.00, FILE.01, ...)
  --cache-dir ABS         where the cache lives (default /tmp/canonlm-kernel-cache). Triton's cache index stores
                          absolute paths: use the same path on every run and node
  --budget S              all phases together (default 480: a 10-minute allocation with 2 minutes to spare)
  --limit PHASE=S         a phase's limit (repeatable)
  --skip PHASE[,PHASE]    phases not to run (repeatable)
  --warmup "OVERRIDES"    a config to warm, as train.py's overrides (repeatable), e.g. "task=depo1 trainer=gpu
                          model.size=12L768D arch=gla canon=AbCD"; without one the warmup phase is skipped
  --bench-args "ARGS"     bench/gpu_step.py's options before --out / --max-minutes (default --quick)
  --max-files N           files allowed in --out (default 8; 0: no limit)
  --max-file-mib M        size allowed per file (default 16; 0: no limit)
  --force                 overwrite this script's own files in --out
  --dry-run               check the inputs (wheelhouse, cache archive, --out writable, cache directory), print
                          each phase's command and limit, and the lines of the self-check and the variants of the
                          bench (their --list, document masking included); runs nothing, writes nothing
Exit status: 0 when every phase that ran passed, 1 when one failed or timed out, 2 for bad input (nothing run)."""

PHASES = ["facts", "install", "restore", "warmup", "selfcheck", "pytest", "bench", "pack"]
#: default limits (s); without warmup they add up to 475, inside the default --budget of 480
LIMIT = {
    "facts": 15,
    "install": 60,
    "restore": 20,
    "warmup": 90,
    "selfcheck": 130,
    "pytest": 100,
    "bench": 120,
    "pack": 30,
}
#: the least time a phase needs to be worth starting (its tool's own budget inside the limit, then its report)
MIN_USEFUL = {
    "facts": 5,
    "install": 20,
    "restore": 5,
    "warmup": 30,
    "selfcheck": 55,
    "pytest": 30,
    "bench": 50,
    "pack": 5,
}
GPU_PHASES = ("warmup", "pytest", "bench")
#: this script's own files in --out (an earlier run's are not overwritten without --force)
OWN = ["summary.md", "phases.log", "selfcheck.md", "gpu_step.jsonl", "gpu_step.md", "kernel-cache.tar.gz"]
VALUED = [
    "--out", "--wheelhouse", "--extras", "--cache-in", "--cache-dir", "--budget", "--limit", "--skip", "--warmup",
    "--bench-args", "--max-files", "--max-file-mib",
]  # fmt: skip
NO_WARMUP = "skipped (no --warmup config: the bench and the self-check compile what they use)"
MiB = 1 << 20


class BadInput(Exception):
    """One or more inputs that are refused (exit 2, nothing run); ``args`` holds one message each."""


def say(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


# --- options ------------------------------------------------------------------------------------------------------
def _int(v: str) -> bool:
    return re.fullmatch(r"[0-9]+", v) is not None


def parse(argv: list[str], cwd: str) -> dict:
    """gpu_check.sh's options as a dict (paths absolute, taken from ``cwd``). Raises BadInput at the first bad one."""

    def absolute(p: str) -> str:
        return p if p.startswith("/") else f"{cwd}/{p}"

    o = {
        "out": "", "wheelhouse": "", "extras": "", "cache_in": "", "cache_dir": "/tmp/canonlm-kernel-cache",
        "budget": 480, "limit": dict(LIMIT), "skip": [], "warmups": [], "bench_args": "--quick", "max_files": 8,
        "max_file_mib": 16, "force": False, "dry": False, "help": False, "argv": list(argv),
    }  # fmt: skip
    i = 0
    while i < len(argv):
        opt = argv[i]
        if opt == "--force":
            o["force"] = True
        elif opt == "--dry-run":
            o["dry"] = True
        elif opt in ("-h", "--help"):
            o["help"] = True
            return o
        elif opt in VALUED:
            if i + 1 >= len(argv):
                raise BadInput(f"{opt} needs a value (see bash scripts/gpu_check.sh --help)")
            i += 1
            _option(o, opt, argv[i], absolute)
        else:
            raise BadInput(
                f"unknown argument '{opt}' (options: {', '.join(VALUED)}, --force, --dry-run; bash scripts/gpu_check.sh"
                " --help)"
            )
        i += 1
    if not o["out"]:
        o["out"] = absolute(time.strftime("gpu-check-%Y%m%d-%H%M%S"))
    return o


def _option(o: dict, opt: str, val: str, absolute) -> None:
    if opt == "--out":
        o["out"] = absolute(val)
    elif opt == "--wheelhouse":
        o["wheelhouse"] = absolute(val)
    elif opt == "--extras":
        o["extras"] = val
    elif opt == "--cache-in":
        o["cache_in"] = absolute(val)
    elif opt == "--cache-dir":
        if not val.startswith("/"):
            raise BadInput(
                f"--cache-dir '{val}': must be an absolute path (Triton's cache index stores absolute paths, so the "
                "cache must sit at the same absolute path on every run and node)"
            )
        o["cache_dir"] = val.rstrip("/")
        if not o["cache_dir"]:
            raise BadInput("--cache-dir '/': not the root directory")
    elif opt == "--budget":
        if not (_int(val) and int(val) > 0):
            raise BadInput(f"--budget '{val}': a whole number of seconds > 0")
        o["budget"] = int(val)
    elif opt == "--limit":
        phase, _, secs = val.partition("=")
        if not _ or phase not in PHASES:
            raise BadInput(f"--limit '{val}': PHASE=SECONDS with PHASE one of: {' '.join(PHASES)}")
        if not (_int(secs) and int(secs) > 0):
            raise BadInput(f"--limit '{val}': SECONDS must be a whole number > 0")
        o["limit"][phase] = int(secs)
    elif opt == "--skip":
        for phase in val.split(","):
            if phase not in PHASES:
                raise BadInput(f"--skip '{val}': unknown phase '{phase}' (phases: {' '.join(PHASES)})")
            o["skip"].append(phase)
    elif opt == "--warmup":
        if not val:
            raise BadInput('--warmup needs train.py overrides, e.g. "arch=gla canon=AbCD trainer=gpu"')
        o["warmups"].append(val)
    elif opt == "--bench-args":
        o["bench_args"] = val
    elif opt in ("--max-files", "--max-file-mib"):
        if not _int(val):
            raise BadInput(f"{opt} '{val}': a whole number (0: no limit)")
        o[opt[2:].replace("-", "_")] = int(val)


# --- inputs ---------------------------------------------------------------------------------------------------------
class _Chain:
    """The files ``paths`` read one after another as one stream (an archive split into parts), for tarfile."""

    def __init__(self, paths: list[str]):
        self._paths, self._f = list(paths), None

    def read(self, n: int = -1) -> bytes:
        out = b""
        while self._paths or self._f:
            if self._f is None:
                self._f = open(self._paths.pop(0), "rb")  # closed below, once read to its end
            chunk = self._f.read(n if n >= 0 else -1)
            if chunk:
                out += chunk
                if n >= 0:
                    n -= len(chunk)
                    if n == 0:
                        break
                continue
            self._f.close()
            self._f = None
        return out


def cache_parts(cache_in: str) -> list[str]:
    """The archive's files: ``cache_in`` itself, else its parts ``cache_in.00``, ``.01``, ... in order."""
    if os.path.isfile(cache_in):
        return [cache_in]
    d, base = os.path.split(cache_in)
    parts = (
        sorted(f for f in os.listdir(d or ".") if re.fullmatch(re.escape(base) + r"\.[0-9]{2}", f))
        if (os.path.isdir(d or "."))
        else []
    )
    return [os.path.join(d, f) for f in parts]


def archive_files(parts: list[str]) -> int:
    """How many non-directory members the .tar.gz made of ``parts`` holds. Raises tarfile.TarError / OSError when
    it is not a readable gzip-compressed tar."""
    with tarfile.open(fileobj=_Chain(parts), mode="r|gz") as t:
        return sum(1 for m in t if not m.isdir())


def cache_problem(d: str) -> str:
    """Why canonlm would refuse ``d`` as its kernel cache ('' when it would not): a symlink, not a directory, owned by
    another user, or writable by group or others (canonlm.kernel_cache's checks)."""
    if os.path.islink(d):
        return "is a symlink"
    if not os.path.isdir(d):
        return "is not a directory"
    st = os.stat(d)
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def foreign_entry(d: str) -> str:
    """The first entry of ``d`` that is not a kernel cache's own folder (triton/, inductor/, autotune/), or ''."""
    for n in sorted(os.listdir(d)):
        if n not in ("triton", "inductor", "autotune"):
            return n
    return ""


def check_inputs(o: dict) -> list[str]:
    """Every problem with the inputs, one message each (empty: all good). Reads only; records the archive's file
    count in ``o["cache_files"]``."""
    problems = []
    wh = o["wheelhouse"]
    if wh:
        if not os.path.isdir(wh):
            problems.append(f"--wheelhouse '{wh}': no such directory")
        elif not any(f.endswith(".whl") for f in os.listdir(wh)):
            problems.append(f"--wheelhouse '{wh}': holds no .whl file")
    if o["cache_in"]:
        parts = cache_parts(o["cache_in"])
        if not parts:
            problems.append(f"--cache-in '{o['cache_in']}': no such file (nor its parts {o['cache_in']}.00, .01, ...)")
        else:
            try:
                o["cache_files"] = archive_files(parts)  # read once: the dry run prints it
            except (tarfile.TarError, OSError, EOFError):
                problems.append(
                    f"--cache-in '{o['cache_in']}': not a readable .tar.gz (tarfile cannot list it; {len(parts)} file(s))"
                )
    out = o["out"]
    if os.path.exists(out):
        if not os.path.isdir(out):
            problems.append(f"--out '{out}': exists and is not a directory")
        elif not os.access(out, os.W_OK | os.X_OK):
            problems.append(f"--out '{out}': not writable")
        elif not o["force"]:
            for f in OWN:
                if os.path.exists(os.path.join(out, f)):
                    problems.append(
                        f"--out '{out}': already holds {f} from an earlier run (choose another --out, or --force)"
                    )
                    break
    else:
        parent = os.path.dirname(out)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
            problems.append(f"--out '{out}': cannot be created ({parent} is not a writable directory)")
    cd = o["cache_dir"]
    if "restore" not in o["skip"] and (os.path.exists(cd) or os.path.islink(cd)):
        why = cache_problem(cd)
        if not why and foreign_entry(cd):
            why = (
                f"holds '{foreign_entry(cd)}', which is not a kernel cache's (only triton/, inductor/ and autotune/ "
                "may be there: the script packs the directory and makes it private)"
            )
        if why:
            problems.append(
                f"--cache-dir '{cd}': {why}; canonlm would refuse it (use a directory of yours with chmod 700, or "
                "another path)"
            )
    return problems


# --- the plan -------------------------------------------------------------------------------------------------------
def has_gpu() -> bool:
    """A CUDA GPU is there when ``nvidia-smi -L`` lists one (a line starting 'GPU ')."""
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.startswith("GPU ") for line in r.stdout.splitlines())


def vpy() -> str:
    """The Python the phases use: .venv's once it exists (after install), else $PYTHON or python3."""
    return ".venv/bin/python" if os.access(".venv/bin/python", os.X_OK) else os.environ.get("PYTHON", "python3")


def parts_mib(o: dict) -> int:
    """The size of an archive part: 1 MiB under the per-file limit."""
    return o["max_file_mib"] - 1 if o["max_file_mib"] > 1 else 1


def command_of(o: dict, phase: str) -> str:
    """A phase's command line, as the dry run and the log show it."""
    py, out, cd = vpy(), o["out"], o["cache_dir"]
    if phase == "facts":
        return f"nvidia-smi --query-gpu=... ; {py} -c <versions>; git rev-parse HEAD"
    if phase == "install":
        return f"bash scripts/setup.sh --wheelhouse {o['wheelhouse']}" + (f" {o['extras']}" if o["extras"] else "")
    if phase == "restore":
        parts = cache_parts(o["cache_in"]) if o["cache_in"] else []
        if parts:
            return (
                f"(umask 077; cat {' '.join(parts)} | tar -xz -C {cd} --no-same-owner --no-same-permissions); "
                f"export CANONLM_KERNEL_CACHE={cd}"
            )
        return f"mkdir -m 700 {cd}; export CANONLM_KERNEL_CACHE={cd} (no --cache-in: starts empty)"
    if phase == "warmup":
        return "; ".join(f"{py} -m canonlm.warmup {w}" for w in o["warmups"])
    if phase == "selfcheck":
        return f"{py} -m canonlm.selfcheck --quick --budget-s <limit - 25 s> --out {out}/selfcheck.md --force"
    if phase == "pytest":
        return f"{py} -m pytest -o addopts= -m gpu -ra -q -p no:cacheprovider [--timeout 90, with pytest-timeout] tests"
    if phase == "bench":
        return f"{py} bench/gpu_step.py {o['bench_args']} --out <work>/bench --max-minutes <limit - 20 s>"
    return (
        f"tar -czf {out}/kernel-cache.tar.gz -C {cd} . (parts of {parts_mib(o)} MiB when over --max-file-mib "
        f"{o['max_file_mib']})"
    )


def why_skip(o: dict, phase: str, gpu: bool) -> str:
    """Why ``phase`` does not run ('' when it runs), before any time limit."""
    if phase == "warmup" and not o["warmups"]:
        return NO_WARMUP
    if phase in o["skip"]:
        return "skipped (--skip)"
    if phase == "install" and not o["wheelhouse"]:
        return "skipped (no --wheelhouse: the environment as it is)"
    if phase in GPU_PHASES and not gpu:
        return "skipped: no CUDA GPU (nvidia-smi -L lists none)"
    return ""


def limit_now(o: dict, phase: str, elapsed: float) -> tuple[int, str]:
    """The limit ``phase`` gets after ``elapsed`` seconds, and why it is skipped when too little is left ('' else).
    The phases before pack leave pack its limit plus 5 s (5 s when pack is skipped)."""
    lim = o["limit"][phase]
    left = o["budget"] - int(elapsed)
    reserve = o["limit"]["pack"] + 5 if "pack" not in o["skip"] else 5
    room = left if phase == "pack" else left - reserve
    if room < lim:
        lim = room
        if lim < MIN_USEFUL[phase]:
            return lim, (
                f"skipped: no time left ({lim} s of the --budget {o['budget']} s left for it; it needs at least "
                f"{MIN_USEFUL[phase]} s)"
            )
    return lim, ""


def dry_run(o: dict, gpu: bool) -> int:
    """Print the plan: the inputs, each phase's limit and command (or why it is skipped), the self-check's lines, the
    bench's variants and setup.sh's offline plan. Runs no phase and writes nothing. Returns the exit status."""
    say("dry run: inputs checked, no phase runs and nothing is written")
    files = "any number of" if o["max_files"] == 0 else o["max_files"]
    mib = "any" if o["max_file_mib"] == 0 else o["max_file_mib"]
    say(
        f"  --out {o['out']} ({'exists' if os.path.isdir(o['out']) else 'will be created'}, at most {files} files of {mib} MiB)"
    )
    wh = o["wheelhouse"]
    n_whl = f" ({sum(f.endswith('.whl') for f in os.listdir(wh))} wheels)" if wh else ""
    say(f"  --wheelhouse {wh or 'none'}{n_whl}")
    parts = cache_parts(o["cache_in"]) if o["cache_in"] else []
    say(f"  --cache-in {o['cache_in'] or 'none'}" + (f" ({o['cache_files']} files)" if parts else ""))
    g = "yes (nvidia-smi -L)" if gpu else "no (nvidia-smi -L lists none)"
    say(f"  --cache-dir {o['cache_dir']}; CUDA GPU: {g}; --budget {o['budget']} s")
    for i, p in enumerate(PHASES, 1):
        print(f"[gpu_check] {i} {p:<9} limit {o['limit'][p]:>4} s  {why_skip(o, p, gpu) or command_of(o, p)}")
    if "selfcheck" not in o["skip"]:
        _listing(
            "selfcheck plan: its lines, document masking (doc-mask) included",
            [vpy(), "-m", "canonlm.selfcheck", "--quick", "--list"],
        )
    if "bench" not in o["skip"]:
        if os.path.isfile("bench/gpu_step.py"):
            cmd = [vpy(), "bench/gpu_step.py", *shlex.split(o["bench_args"]), "--list"]
            _listing("bench plan (on a CUDA GPU): its variants, document-masked ones (/docs) included", cmd)
        else:
            say("bench plan: not listed (bench/gpu_step.py not found)")
    if wh and not why_skip(o, "install", gpu):
        say(
            "install plan (SETUP_DRY_RUN=1 bash scripts/setup.sh --wheelhouse ...): checks the wheelhouse against this machine"
        )
        r = subprocess.run(
            ["bash", "scripts/setup.sh", "--wheelhouse", wh, *o["extras"].split()],
            env={**os.environ, "SETUP_DRY_RUN": "1"},
        )
        if r.returncode != 0:
            return 2
    return 0


def _listing(label: str, cmd: list[str]) -> None:
    """Print a tool's own --list, each line indented under ``label``, or why there is none."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    shown = " ".join(cmd)
    if r.returncode == 0:
        say(f"{label} ({shown}):")
        for line in r.stdout.splitlines():
            print(f"[gpu_check]     {line}")
    else:
        err = [line for line in r.stderr.splitlines() if line.strip()]
        say(f"{label}: not listed ({shown} exits {r.returncode}: {(err[-1] if err else '')[:200]})")
    sys.stdout.flush()


# --- state ----------------------------------------------------------------------------------------------------------
def _load(work: str) -> dict:
    with open(os.path.join(work, "state.json")) as f:
        return json.load(f)


def _save(work: str, s: dict) -> None:
    tmp = os.path.join(work, "state.json.tmp")
    with open(tmp, "w") as f:
        json.dump(s, f)
    os.replace(tmp, os.path.join(work, "state.json"))


def _log(s: dict, text: str) -> None:
    """``text`` to the terminal and to OUT/phases.log."""
    print(text, flush=True)
    with open(os.path.join(s["o"]["out"], "phases.log"), "a") as f:
        f.write(text + "\n")


def table(s: dict) -> str:
    rows = ["| phase | status | seconds | limit | result |", "|---|---|---|---|---|"]
    for p in PHASES:
        r = s["rows"].get(p)
        if r:
            lim = r.get("limit", "-")
            rows.append(f"| {p} | {r['status']} | {r['secs']} | {lim} | {r['key']} |")
    return "\n".join(rows)


def write_summary(work: str, s: dict) -> None:
    """OUT/summary.md: the command, the budget, the facts and the table (written whole, then renamed)."""
    o = s["o"]
    lines = [
        f"# gpu_check {s['started']} on {socket.gethostname()}",
        "",
        f"- command: `bash scripts/gpu_check.sh{''.join(' ' + a for a in o['argv'])}`",
        f"- budget: {o['budget']} s; elapsed: {int(time.time() - s['t0'])} s; kernel cache: {o['cache_dir']}",
    ]
    facts = os.path.join(work, "facts.log")
    if os.path.isfile(facts) and os.path.getsize(facts):
        kept = [x for x in open(facts, errors="replace").read().splitlines() if not x.startswith("KEY:")][:60]
        lines += ["", "```", *kept, "```"]
    lines += ["", table(s)]
    tmp = os.path.join(o["out"], "summary.md.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, os.path.join(o["out"], "summary.md"))


# --- key results, read from each phase's own log (WORK/<phase>.log) ---------------------------------------------------
def _last_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1][:160] if lines else ""


def key_of(phase: str, rc: int, log: str, o: dict) -> str:
    """The one-line result of ``phase`` from its output ``log`` (and, for selfcheck, OUT/selfcheck.md)."""
    if phase == "facts":
        keys = re.findall(r"^KEY: (.*)$", log, re.M)
        return keys[-1] if keys else ""
    if phase == "install":
        lacks = re.search(r"the wheelhouse \S+ lacks: (.*?) \(locked for ", log)
        if lacks:
            return "missing: " + lacks[1]
        if rc == 0:
            kept = re.search(r"^\[setup\] (keeping torch [^;]*);", log, re.M)
            n = re.search(r" ([0-9]+) from /", log)
            return f"{kept[1] if kept else ''}; {n[1] if n else ''} packages from the wheelhouse"
        err = next((x for x in log.splitlines() if "ERROR" in x), "")
        return err[:160]
    if phase in ("restore", "pack"):
        res = re.findall(r"^RESULT: (.*)$", log, re.M)
        return res[-1] if res else ""
    if phase == "warmup":
        ok = len(re.findall(r"^WARMUP OK", log, re.M))
        failed = re.findall(r"^WARMUP FAIL [0-9]+ (.*)$", log, re.M)
        return f"{ok}/{len(o['warmups'])} configs warm" + (f"; failed: {';'.join(failed)};" if failed else "")
    if phase == "selfcheck":
        try:
            found = re.findall(
                r"\(([0-9]+ PASS, [0-9]+ FAIL, [0-9]+ SKIP)\)", open(os.path.join(o["out"], "selfcheck.md")).read()
            )
        except OSError:
            found = []
        if found:
            return found[-1]
        n = {k: len(re.findall(rf"^\[{k}\]", log, re.M)) for k in ("PASS", "FAIL", "SKIP")}
        return f"{n['PASS']} PASS, {n['FAIL']} FAIL, {n['SKIP']} SKIP (lines printed; no report)"
    if phase == "pytest":
        counts = re.findall(r"[0-9]+ (?:passed|failed|skipped|errors?|deselected|xfailed|xpassed)", log)
        return ", ".join(counts[-6:]) or _last_line(log)
    if phase == "bench":
        ratios = re.findall(r"^ratio [a-z_]* \S* (.*): ([0-9.]*x)", log, re.M)
        if ratios:
            return "; ".join(f"{a} {b}" for a, b in ratios[:6])
        return "no ratio (see gpu_step.md)" if rc == 0 else _last_line(log)
    return ""


# --- phase bodies (each run by the runner under `timeout`, cwd = the repository root) -------------------------------
FACTS_PY = r"""
import importlib.metadata as md, platform, sys
print(f"{sys.argv[1]}: Python {platform.python_version()} at {sys.executable}")
vs = []
for p in ("torch", "triton", "lightning", "transformers", "hydra-core", "fla-core", "mamba-ssm", "causal-conv1d",
          "flash-attn", "canonlm"):
    try:
        vs.append(f"{p} {md.version(p)}")
    except md.PackageNotFoundError:
        vs.append(f"{p} -")
print("  " + ", ".join(vs))
try:
    import torch
    cuda = torch.cuda.is_available()
    dev = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
    print(f"  torch {torch.__version__}, CUDA {torch.version.cuda}, available: {cuda}, {dev}")
    try:
        tri = md.version("triton")
    except md.PackageNotFoundError:
        tri = "-"
    print(f"KEY: {dev}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tri}")
except Exception as e:
    print(f"  torch: {type(e).__name__}: {e}")
    print(f"KEY: no torch in {sys.argv[1]}")
"""


def _sh(cmd: list[str], **kw) -> int:
    sys.stdout.flush()
    return subprocess.run(cmd, **kw).returncode


def phase_facts(o: dict, s: dict) -> int:
    print(
        f"date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}  host: {socket.gethostname()}  user: {os.environ.get('USER') or os.getuid()}"
    )
    if shutil.which("nvidia-smi"):
        _sh(
            ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,compute_cap", "--format=csv,noheader"],
            stderr=subprocess.STDOUT,
        )
    else:
        print("nvidia-smi: not found")
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    print(f"commit: {git.stdout.strip() if git.returncode == 0 else 'unknown (no git)'}")
    for py in (os.environ.get("PYTHON", "python3"), ".venv/bin/python"):
        if py == ".venv/bin/python" and not os.access(py, os.X_OK):
            continue
        _sh([py, "-c", FACTS_PY, py])
    return 0


def phase_install(o: dict, s: dict) -> int:
    return _sh(["bash", "scripts/setup.sh", "--wheelhouse", o["wheelhouse"], *o["extras"].split()])


def _mib(path: str) -> str:
    """A file's or a tree's apparent size in MiB, one decimal."""
    if os.path.isfile(path):
        return f"{os.path.getsize(path) / MiB:.1f}"
    total = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)
    return f"{total / MiB:.1f}"


def _nfiles(d: str) -> int:
    return sum(len(fs) for _, _, fs in os.walk(d))


def phase_restore(o: dict, s: dict) -> int:
    cd = o["cache_dir"]
    if not os.path.exists(cd):
        os.makedirs(cd, mode=0o700)
    why = cache_problem(cd)
    if why:
        print(f"ERROR: {cd} {why}")
        return 1
    os.chmod(cd, 0o700)
    parts = cache_parts(o["cache_in"]) if o["cache_in"] else []
    if parts:
        old = os.umask(0o077)
        try:
            tar = subprocess.Popen(
                ["tar", "-xz", "-C", cd, "--no-same-owner", "--no-same-permissions"], stdin=subprocess.PIPE
            )
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, tar.stdin)
            tar.stdin.close()
            if tar.wait() != 0:
                print(f"ERROR: tar could not extract {' '.join(parts)}")
                return 1
        finally:
            os.umask(old)
    print(f"RESULT: {_nfiles(cd)} files, {_mib(cd)} MiB in {cd}" + ("" if parts else " (no --cache-in: empty)"))
    return 0


def _env(s: dict) -> dict:
    env = dict(os.environ)
    if s.get("cache_ready"):
        env["CANONLM_KERNEL_CACHE"] = s["o"]["cache_dir"]
    return env


def phase_warmup(o: dict, s: dict) -> int:
    failed = 0
    for w in o["warmups"]:
        print(f"--- python -m canonlm.warmup {w}")
        rc = _sh([vpy(), "-m", "canonlm.warmup", *w.split()], env=_env(s))
        print(f"WARMUP OK {w}" if rc == 0 else f"WARMUP FAIL {rc} {w}")
        failed |= rc != 0
    return int(failed)


def phase_selfcheck(o: dict, s: dict) -> int:
    budget = max(20, int(s["phase_limit"]) - 25)  # its own budget inside the limit, so that it writes its report
    cmd = [vpy(), "-m", "canonlm.selfcheck", "--quick", "--budget-s", str(budget), "--out", f"{o['out']}/selfcheck.md"]
    return _sh([*cmd, "--force"], env=_env(s))


def phase_pytest(o: dict, s: dict) -> int:
    per = ["--timeout", "90"] if _sh([vpy(), "-c", "import pytest_timeout"], stderr=subprocess.DEVNULL) == 0 else []
    # -o addopts=: pyproject's addopts carry --dist loadgroup, which fails where pytest-xdist is not installed
    cmd = [vpy(), "-m", "pytest", "-o", "addopts=", "-m", "gpu", "-ra", "-q", "-p", "no:cacheprovider", *per, "tests"]
    return _sh(cmd, env=_env(s))


def phase_bench(o: dict, s: dict) -> int:
    mins = f"{(int(s['phase_limit']) - 20) / 60:.2f}"
    work = s["work"]
    rc = _sh(
        [vpy(), "bench/gpu_step.py", *shlex.split(o["bench_args"]), "--out", f"{work}/bench", "--max-minutes", mins],
        env=_env(s),
    )
    for f in ("gpu_step.jsonl", "gpu_step.md"):
        if os.path.isfile(f"{work}/bench/{f}"):
            shutil.copy(f"{work}/bench/{f}", f"{o['out']}/{f}")
    return rc


def phase_pack(o: dict, s: dict) -> int:
    cd, out = o["cache_dir"], o["out"]
    if not os.path.isdir(cd):
        print(f"RESULT: no cache directory {cd}: nothing to pack")
        return 0
    n, mib = _nfiles(cd), _mib(cd)
    tgz = os.path.join(s["work"], "kernel-cache.tar.gz")
    if shutil.which("pigz"):
        rc = _sh(["bash", "-c", 'tar -C "$1" -cf - . | pigz > "$2"', "pack", cd, tgz])
    else:
        rc = _sh(["tar", "-C", cd, "-czf", tgz, "."])
    if rc != 0:
        print(f"RESULT: tar could not pack {cd} (exit {rc})")
        return 1
    size, cap = os.path.getsize(tgz), o["max_file_mib"] * MiB
    have = sum(
        1 for f in os.listdir(out) if os.path.isfile(os.path.join(out, f)) and not f.startswith("kernel-cache.tar.gz")
    )
    room = 1000 if o["max_files"] == 0 else o["max_files"] - have
    for f in os.listdir(out):
        if re.fullmatch(r"kernel-cache\.tar\.gz(\.[0-9]{2})?", f):
            os.remove(os.path.join(out, f))
    if o["max_file_mib"] == 0 or size <= cap:
        if room < 1:
            print(f"RESULT: no room in --out for the archive (--max-files {o['max_files']})")
            return 1
        shutil.move(tgz, os.path.join(out, "kernel-cache.tar.gz"))
        print(
            f"RESULT: {n} files, {mib} MiB -> kernel-cache.tar.gz ({_mib(os.path.join(out, 'kernel-cache.tar.gz'))} MiB)"
        )
        return 0
    part = parts_mib(o) * MiB
    parts = -(-size // part)
    if parts > room or parts > 100:
        keep = cd + ".tar.gz"
        shutil.move(tgz, keep)
        print(
            f"RESULT: {n} files packed to {_mib(keep)} MiB: {parts} parts of {parts_mib(o)} MiB would not fit the "
            f"{room} files left in --out; kept at {keep}"
        )
        return 1
    with open(tgz, "rb") as f:
        for i in range(parts):
            with open(os.path.join(out, f"kernel-cache.tar.gz.{i:02d}"), "wb") as g:
                g.write(f.read(part))
    os.remove(tgz)
    print(
        f"RESULT: {n} files, {mib} MiB -> kernel-cache.tar.gz.00..{parts - 1:02d} ({parts} parts of <= {parts_mib(o)} "
        "MiB; restore with --cache-in kernel-cache.tar.gz)"
    )
    return 0


BODIES = {
    "facts": phase_facts, "install": phase_install, "restore": phase_restore, "warmup": phase_warmup,
    "selfcheck": phase_selfcheck, "pytest": phase_pytest, "bench": phase_bench, "pack": phase_pack,
}  # fmt: skip


# --- subcommands ----------------------------------------------------------------------------------------------------
def cmd_start(work: str, argv: list[str]) -> int:
    try:
        o = parse(argv, os.environ.get("GPU_CHECK_CALLER", os.getcwd()))
    except BadInput as e:
        print(f"[gpu_check] ERROR: {e.args[0]}", file=sys.stderr)
        return 2
    if o["help"]:
        print(HELP)
        return 3
    problems = check_inputs(o)
    if problems:
        for p in problems:
            print(f"[gpu_check] ERROR: {p}", file=sys.stderr)
        return 2
    gpu = has_gpu()
    if o["dry"]:
        rc = dry_run(o, gpu)
        return 3 if rc == 0 else rc
    try:
        os.makedirs(o["out"], exist_ok=True)
    except OSError as e:
        print(f"[gpu_check] ERROR: --out '{o['out']}': cannot be created ({e})", file=sys.stderr)
        return 2
    open(os.path.join(o["out"], "phases.log"), "w").close()
    s = {
        "o": o, "gpu": gpu, "work": work, "t0": time.time(), "rows": {}, "next": 0, "worst": 0,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    _save(work, s)
    with open(os.path.join(work, "out"), "w") as f:
        f.write(o["out"])
    return 0


def cmd_next(work: str) -> int:
    s = _load(work)
    o = s["o"]
    while s["next"] < len(PHASES):
        i = s["next"] + 1
        p = PHASES[s["next"]]
        s["next"] += 1
        why = why_skip(o, p, s["gpu"])
        lim = o["limit"][p]
        if not why:
            lim, why = limit_now(o, p, time.time() - s["t0"])
        if why:
            s["rows"][p] = {"status": "SKIP", "secs": 0, "key": why}
            _log(s, f"\n=== {i} {p}: {why}")
            _save(work, s)
            write_summary(work, s)
            continue
        s["rows"][p] = {"status": "RUN", "secs": 0, "key": "", "limit": lim, "t": time.time()}
        s["phase_limit"] = lim
        _log(s, f"\n=== {i} {p} (limit {lim} s): {command_of(o, p)}")
        _save(work, s)
        with open(os.path.join(work, "next"), "w") as f:
            f.write(f"{p} {lim}\n")
        return 0
    with open(os.path.join(work, "next"), "w") as f:
        f.write("end 0\n")
    return 0


def cmd_phase(name: str, work: str) -> int:
    s = _load(work)
    os.chdir(Path(__file__).resolve().parents[1])
    return BODIES[name](s["o"], s)


def cmd_done(work: str, name: str, rc: int) -> int:
    s = _load(work)
    r = s["rows"][name]
    r["secs"] = int(time.time() - r.pop("t"))
    r["status"] = {0: "OK", 124: "TIMEOUT", 137: "TIMEOUT"}.get(rc, f"FAIL (exit {rc})")
    try:
        log = open(os.path.join(work, f"{name}.log"), errors="replace").read()
    except OSError:
        log = ""
    r["key"] = key_of(name, rc, log, s["o"]).replace("|", "/")[:200]
    if rc != 0:
        s["worst"] = 1
    if name == "restore" and rc == 0:
        s["cache_ready"] = True
    _save(work, s)
    write_summary(work, s)
    return 0


def cmd_finish(work: str) -> int:
    s = _load(work)
    o = s["o"]
    log = os.path.join(o["out"], "phases.log")
    cap = o["max_file_mib"] * MiB
    if o["max_file_mib"] > 0 and os.path.getsize(log) > cap:  # the log must fit one file: keep its head and tail
        half = cap // 2 - 4096
        with open(log, "rb") as f:
            head = f.read(half)
            f.seek(-half, os.SEEK_END)
            tail = f.read()
        with open(log + ".tmp", "wb") as f:
            f.write(head + f"\n[... cut to fit --max-file-mib {o['max_file_mib']} ...]\n".encode() + tail)
        os.replace(log + ".tmp", log)
    write_summary(work, s)
    print()
    say(f"results in {o['out']}: {' '.join(sorted(os.listdir(o['out'])))}")
    print()
    print(table(s), flush=True)
    return s["worst"]


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "start":
        return cmd_start(argv[1], argv[2:])
    if len(argv) == 2 and argv[0] == "next":
        return cmd_next(argv[1])
    if len(argv) == 3 and argv[0] == "phase" and argv[1] in BODIES:
        return cmd_phase(argv[1], argv[2])
    if len(argv) == 4 and argv[0] == "done":
        return cmd_done(argv[1], argv[2], int(argv[3]))
    if len(argv) == 2 and argv[0] == "finish":
        return cmd_finish(argv[1])
    print(f"usage: see the docstring of {__file__} (it is run by scripts/gpu_check.sh)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
