"""How the self-check runs its lines: groups of lines in parallel worker processes, within one time budget.

**Plan.** Every line is a :class:`LineSpec`: its name, its *group*, and the function that checks it
(``"module:function"`` plus JSON arguments), or a verdict known without running it (``static``: SKIP "no CUDA", SKIP
"needs >= 2 GPUs"). Lines of one group run one after the other in one worker process, in plan order, so that they
share what that process compiled (a dtype's forward + backward kernels serve its decode prefill); different groups
share no compiled kernel in memory (other ops, other dtypes, other shapes), only Triton's on-disk cache.

**Workers.** ``python -m canonlm.selfcheck.runner PLAN GROUP`` imports what the lines of ``GROUP`` of the plan file
need, says it is ready, runs them and writes one event per line start and per result to its stdout (other output goes
to its log file in the run directory); its start-up (interpreter, imports) is reported apart, in no line's time.
:func:`run_plan` starts up to ``jobs`` workers at a time, the groups with the largest estimated cold cost first
(``LineSpec.est_s``), and at most ``heavy_slots`` groups marked ``heavy`` (GPU training runs) at once. Triton
compiles in the calling thread, one kernel at a time, on one CPU core; several workers compile on several cores
(docs/selfcheck.md counts the compiles). A worker that dies (a crashed kernel) fails the line it was running; the rest
of its group goes to a new worker.

**Budget.** All processes share one deadline (``time.time()`` seconds). A worker does not start a line after it; at
the deadline :func:`run_plan` stops every worker still running (SIGTERM to its session, which stops its training
subprocess too, then SIGKILL): the line that was running is SKIP "stopped after N s: the B s budget was spent while it
ran", the lines not started are SKIP "not run: the B s budget was spent", both with how to rerun
(:func:`~canonlm.selfcheck.verdict.budget_reason`). Nothing waits for an external timeout.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from canonlm.selfcheck import verdict
from canonlm.selfcheck.verdict import FAIL, SKIP, Result, run_check, short

#: Prefix of an event line on a worker's event stream.
EVENT = "@@canonlm-selfcheck "
#: Seconds a stopped worker gets between SIGTERM and SIGKILL.
GRACE_S = 2.0


@dataclasses.dataclass
class LineSpec:
    """One line of the plan.

    ``target`` (``"module:function"``) is called as ``function(*args, **kwargs)`` in a worker and returns ``(status,
    detail)`` or a :class:`~canonlm.selfcheck.verdict.Verdict` (see :func:`~canonlm.selfcheck.verdict.run_check`);
    ``static`` = ``[status, detail]`` is a verdict known without running anything. ``op`` / ``backend``: what a
    kernel line tests (copied into its result). ``heavy``: a GPU training run (bounded by ``heavy_slots``).
    ``est_compiles``: the Triton kernels a cold run of the line compiles with first-config autotuning (counted under
    Triton's interpreter, docs/selfcheck.md); ``est_s``: a cold-run estimate in seconds that orders the groups.
    ``device``: ``cuda`` for a GPU line (its worker creates the CUDA context, counts Triton compiles and sets the
    autotune mode before its first line), else ``cpu``."""

    name: str
    group: str
    target: str = ""
    args: list = dataclasses.field(default_factory=list)
    kwargs: dict = dataclasses.field(default_factory=dict)
    static: Optional[list] = None
    op: Optional[str] = None
    backend: Optional[str] = None
    heavy: bool = False
    est_compiles: int = 0
    est_s: float = 1.0
    device: str = "cpu"


def result_to_json(r: Result) -> dict:
    """A :class:`Result` as a JSON-able dict (:func:`result_from_json` reads it back)."""
    return dataclasses.asdict(r)


def result_from_json(d: dict) -> Result:
    """The :class:`Result` :func:`result_to_json` wrote."""
    d = dict(d)
    fields = {f.name for f in dataclasses.fields(Result)}
    return Result(**{k: v for k, v in d.items() if k in fields})


def _static_result(spec: LineSpec) -> Result:
    status, detail = spec.static
    return Result(status, detail, op=spec.op, backend=spec.backend, name=spec.name, seconds=0.0, compile_s=0.0)


def _call(spec: LineSpec) -> Callable:
    module, _, fn = spec.target.partition(":")
    f = getattr(importlib.import_module(module), fn)
    return lambda: f(*spec.args, **spec.kwargs)


# ----------------------------------------------------------------------------------------------------------------
# worker
# ----------------------------------------------------------------------------------------------------------------


def worker_main(argv: list) -> int:
    """``python -m canonlm.selfcheck.runner PLAN GROUP``: run the lines of ``GROUP`` (those not yet reported, from
    ``--from NAME`` on when given) and write their events to stdout. Returns 0 (a failing line is a FAIL event, not
    an exit code); 2 on bad arguments."""
    if len(argv) not in (2, 4) or (len(argv) == 4 and argv[2] != "--from"):
        print("usage: python -m canonlm.selfcheck.runner PLAN GROUP [--from LINE]", file=sys.stderr)
        return 2
    plan = json.loads(Path(argv[0]).read_text())
    group, start = argv[1], (argv[3] if len(argv) == 4 else None)
    specs = [LineSpec(**d) for d in plan["lines"] if d["group"] == group and d.get("static") is None]
    if start is not None:
        names = [s.name for s in specs]
        specs = specs[names.index(start) :] if start in names else []
    # events on the original stdout; everything else the lines print goes to stderr (the worker's log)
    events = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1, encoding="utf-8", closefd=False)

    def send(event: dict) -> None:
        events.write(EVENT + json.dumps(event) + "\n")
        events.flush()

    def stop(signum, frame):  # the deadline: stop a running training subprocess with us
        training = sys.modules.get("canonlm.selfcheck.training")
        if training is not None:
            training.kill_children()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    verdict.set_budget(plan.get("deadline"), plan.get("budget_s"), plan.get("quick", False))
    _setup_process()
    if plan.get("cuda") and any(spec.device == "cuda" for spec in specs):
        import torch

        if torch.cuda.is_available():
            from canonlm.selfcheck import triton_hooks

            torch.zeros(1, device="cuda")  # the CUDA context: start-up, not the first line's compile time
            from canonlm.selfcheck.environment import preload

            if not any(spec.heavy for spec in specs):  # (a training line's subprocess imports its own)
                preload()  # the kernel libraries' imports: start-up too
            triton_hooks.count_compiles()
            if plan.get("autotune", "first") == "first":
                why = triton_hooks.install_first_config_autotune()
                if why is not None:
                    send({"event": "note", "text": f"first-config autotuning unavailable: {why}"})
    for module in dict.fromkeys(spec.target.partition(":")[0] for spec in specs):
        importlib.import_module(module)  # imports are start-up, not a line's time
    send({"event": "ready"})
    for spec in specs:
        left = verdict.remaining_s()
        if left is not None and left <= 0:
            r = Result(SKIP, verdict.budget_reason(), op=spec.op, backend=spec.backend, name=spec.name, seconds=0.0)
        else:
            send({"event": "start", "name": spec.name})
            r = run_check(spec.name, lambda spec=spec: _call(spec)())
            if spec.op is not None:
                r = dataclasses.replace(r, op=spec.op, backend=spec.backend)
        send({"event": "result", "result": result_to_json(r)})
    events.close()
    return 0


def _orphan_watch(parent: int) -> None:
    """End this worker (and its training subprocess) when the command that started it is gone (killed by an outer
    timeout, say): every half second, compare the parent process id."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            training = sys.modules.get("canonlm.selfcheck.training")
            if training is not None:
                training.kill_children()
            os._exit(1)


def _setup_process() -> None:
    """What every self-check process does first (the command and each worker): configure the kernel cache
    (``canonlm.utils.kernel_cache.configure()``: ``$CANONLM_KERNEL_CACHE``, else ``<canonlm cache>/kernels``; it
    exports ``CANONLM_KERNEL_CACHE``), so that workers and their training runs share one cache."""
    from canonlm.utils.kernel_cache import configure

    configure()


# ----------------------------------------------------------------------------------------------------------------
# orchestrator
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Worker:
    group: str
    proc: subprocess.Popen
    log: Path
    heavy: bool
    started: float
    pending: list  # names not reported yet, in order
    current: Optional[str] = None  # the line it is running
    current_since: float = 0.0
    first_event: Optional[float] = None
    ran: int = 0  # lines it started


def run_plan(
    specs: list[LineSpec],
    *,
    workdir: Path,
    budget_s: float,
    jobs: int,
    heavy_slots: int = 1,
    quick: bool = False,
    autotune: str = "first",
    cuda: bool = False,
    emit: Optional[Callable[[Result], None]] = None,
    note: Optional[Callable[[str], None]] = None,
    t0: Optional[float] = None,
) -> tuple[list[Result], dict]:
    """Run the plan's lines in worker processes within ``budget_s`` seconds from ``t0`` (``time.time()``; default
    now); see the module docstring.

    Args:
        specs: the plan, in report order. workdir: where the plan file, the workers' logs and the training runs go.
        jobs: workers at a time (>= 1). heavy_slots: ``heavy`` groups at a time (>= 1).
        quick, autotune, cuda: passed to the workers (budget messages; ``first`` / ``full`` autotuning; whether the
            GPU lines run).
        emit: called with each result as it arrives (static lines first). note: called with worker notes.
    Returns:
        (results in plan order, stats): stats has ``workers`` (processes started), ``startup_s`` (median seconds from
        a worker's start to its first event), ``not_run`` and ``stopped`` (lines the budget left out / stopped).
    Raises:
        ValueError: duplicate line names, a line without a target or static verdict, or jobs / heavy_slots < 1.
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted(n for n, c in collections.Counter(names).items() if c > 1)
        raise ValueError(f"run_plan: duplicate line names {dup}")
    bad = [s.name for s in specs if s.static is None and ":" not in s.target]
    if bad:
        raise ValueError(f"run_plan: lines without a target or a static verdict: {bad}")
    if jobs < 1 or heavy_slots < 1:
        raise ValueError(f"run_plan: jobs={jobs}, heavy_slots={heavy_slots}; allowed: >= 1")
    t0 = time.time() if t0 is None else t0
    deadline = t0 + budget_s
    verdict.set_budget(deadline, budget_s, quick)
    emit = emit or (lambda r: None)
    note = note or (lambda s: None)
    results: dict[str, Result] = {}
    for s in specs:
        if s.static is not None:
            results[s.name] = _static_result(s)
            emit(results[s.name])
    groups: dict[str, list[LineSpec]] = collections.OrderedDict()
    for s in specs:
        if s.static is None:
            groups.setdefault(s.group, []).append(s)
    if not groups:
        return [results[n] for n in names], {"workers": 0, "startup_s": None, "not_run": 0, "stopped": 0}
    workdir.mkdir(parents=True, exist_ok=True)
    plan_file = workdir / "selfcheck-plan.json"
    plan_file.write_text(
        json.dumps(
            {
                "lines": [dataclasses.asdict(s) for s in specs],
                "deadline": deadline,
                "budget_s": budget_s,
                "quick": quick,
                "autotune": autotune,
                "cuda": cuda,
            }
        )
    )
    # the costliest groups first (longest-processing-time first), keeping plan order among equals
    todo = collections.deque(sorted(groups, key=lambda g: -sum(s.est_s for s in groups[g])))
    start_from: dict[str, Optional[str]] = {g: None for g in groups}
    events: queue.Queue = queue.Queue()
    running: dict[int, _Worker] = {}
    startups: list[float] = []
    stats = {"workers": 0, "not_run": 0, "stopped": 0}
    heavy = {g: any(s.heavy for s in ss) for g, ss in groups.items()}
    serial = [0]

    def start(group: str) -> None:
        serial[0] += 1
        log = workdir / f"worker-{serial[0]:02d}-{group.replace(' ', '_').replace('/', '-')}.log"
        cmd = [sys.executable, "-m", "canonlm.selfcheck.runner", str(plan_file), group]
        if start_from[group] is not None:
            cmd += ["--from", start_from[group]]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as logf:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, start_new_session=True, env=env)
        pending = [s.name for s in groups[group] if s.name not in results]
        w = _Worker(group, proc, log, heavy[group], time.time(), pending)
        running[proc.pid] = w
        stats["workers"] += 1
        threading.Thread(target=_reader, args=(proc, events), daemon=True).start()

    by_name = {s.name: s for s in specs}

    def record(r: Result) -> None:
        spec = by_name[r.name]
        if r.op is None and spec.op is not None:
            r = dataclasses.replace(r, op=spec.op, backend=spec.backend)
        results[r.name] = r
        emit(r)

    lingering: list[subprocess.Popen] = []  # workers that closed their output but have not exited (yet)

    def finish_dead(w: _Worker) -> None:
        if not w.pending:  # nothing left to report: do not wait for its exit (a stuck teardown must not hold us)
            if w.proc.poll() is None:
                lingering.append(w.proc)
            return
        try:
            rc = w.proc.wait(timeout=max(0.1, min(10.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            lingering.append(w.proc)
            rc = "still running"
        tail = short(" / ".join(_log_tail(w.log, 3)), 300) or "no output"
        if w.current is not None:
            record(
                Result(
                    FAIL,
                    f"the worker process died (exit {rc}) while this line ran: {tail} (log {w.log})",
                    name=w.current,
                    seconds=time.time() - w.current_since,
                )
            )
            w.pending.remove(w.current)
        if not w.pending:
            return
        if w.ran == 0:  # it never got to a line: no second try (it would fail the same way)
            for n in w.pending:
                record(
                    Result(
                        FAIL,
                        f"the worker process exited (exit {rc}) before running its lines: {tail} (log {w.log})",
                        name=n,
                        seconds=0.0,
                    )
                )
            return
        start_from[w.group] = w.pending[0]  # the rest of the group gets a fresh process
        todo.appendleft(w.group)

    try:
        while todo or running:
            now = time.time()
            if now >= deadline:
                break
            while todo and len(running) < jobs:
                g = next(
                    (g for g in todo if not heavy[g] or sum(w.heavy for w in running.values()) < heavy_slots), None
                )
                if g is None:
                    break
                todo.remove(g)
                start(g)
            try:
                pid, ev = events.get(timeout=max(0.05, min(1.0, deadline - time.time())))
            except queue.Empty:
                continue
            w = running.get(pid)
            if w is None:
                continue
            if w.first_event is None and ev is not None:
                w.first_event = time.time()
                startups.append(w.first_event - w.started)
            if ev is None:  # end of its output: it exited (or is about to)
                del running[pid]
                finish_dead(w)
            elif ev.get("event") == "start":
                w.current, w.current_since = ev["name"], time.time()
                w.ran += 1
            elif ev.get("event") == "result":
                r = result_from_json(ev["result"])
                if r.name in w.pending:
                    w.pending.remove(r.name)
                w.current = None
                record(r)
            elif ev.get("event") == "ready":
                pass
            elif ev.get("event") == "note":
                note(f"{w.group}: {ev.get('text')}")
    finally:
        # the deadline (or an interrupt): stop what still runs, and the workers that closed their output but linger
        _stop_all([w.proc for w in running.values()] + [p for p in lingering if p.poll() is None])
        for w in running.values():
            if w.current is not None and w.current not in results:
                stats["stopped"] += 1
                record(
                    Result(
                        SKIP,
                        verdict.budget_reason(time.time() - w.current_since),
                        name=w.current,
                        seconds=time.time() - w.current_since,
                    )
                )
    for s in specs:
        if s.name not in results:
            stats["not_run"] += 1
            record(Result(SKIP, verdict.budget_reason(), op=s.op, backend=s.backend, name=s.name, seconds=0.0))
    startups.sort()
    stats["startup_s"] = startups[len(startups) // 2] if startups else None
    return [results[n] for n in names], stats


def _reader(proc: subprocess.Popen, events: queue.Queue) -> None:
    """Parse a worker's event lines into ``events`` as ``(pid, event)``; ``(pid, None)`` at the end."""
    try:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            if line.startswith(EVENT):
                try:
                    events.put((proc.pid, json.loads(line[len(EVENT) :])))
                except ValueError:
                    continue
    finally:
        events.put((proc.pid, None))


def _stop_all(procs: list) -> None:
    """SIGTERM to each worker's session (a worker stops its training subprocess), then SIGKILL to the sessions still
    alive after :data:`GRACE_S` seconds."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.time() + wait
        for p in alive:
            try:
                p.wait(timeout=max(0.0, end - time.time()))
            except subprocess.TimeoutExpired:
                pass


def _log_tail(path: Path, n: int) -> list[str]:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return []
    return lines[-n:]


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
