"""The self-check's lines: PASS / FAIL / SKIP results, running one check so that it never raises, the split of a
line's time into compile and check, and the rules that judge a line (which backends ran, how large the errors are)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Iterator, Optional

from canonlm.selfcheck import triton_hooks

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclasses.dataclass
class Verdict:
    """What a check returns besides ``(status, detail)``: ``op`` / ``backend`` under test, ``ran`` = the calls
    :func:`canonlm.ops.backend_calls` observed (``{op: {backend: calls}}``), ``errors`` = ``{tensor: max |fast - ref|
    / max |ref|}`` and the tolerance ``tol`` they were judged against."""

    status: str
    detail: str
    op: Optional[str] = None
    backend: Optional[str] = None
    ran: dict = dataclasses.field(default_factory=dict)
    errors: dict = dataclasses.field(default_factory=dict)
    tol: Optional[float] = None


@dataclasses.dataclass
class Result(Verdict):
    """One report line: the :class:`Verdict` of the check called ``name`` (keyword-only), which took ``seconds``
    (wall time; keyword-only), ``compile_s`` of them compiling (:func:`compiling`; None when not measured: a line
    that did not run, or one stopped by the time budget) and the rest checking (:attr:`check_s`). ``kernels``:
    ``{"built": n, "loaded": m}``, the Triton kernels compiled and loaded from the kernel cache during the line
    (empty when none). ``status`` is PASS / FAIL / SKIP; the facts after ``detail`` are empty when the check ended
    before judging (e.g. SKIP)."""

    name: str = dataclasses.field(kw_only=True)
    seconds: float = dataclasses.field(kw_only=True)
    compile_s: Optional[float] = dataclasses.field(default=None, kw_only=True)
    kernels: dict = dataclasses.field(default_factory=dict, kw_only=True)

    @property
    def check_s(self) -> Optional[float]:
        """``seconds - compile_s`` (None when compile_s is None)."""
        return None if self.compile_s is None else max(0.0, self.seconds - self.compile_s)


class Skip(Exception):
    """Raised inside a check: the line is SKIP with this message as its reason."""


class Fail(Exception):
    """Raised inside a check: the line is FAIL with this message."""


def short(s: str, n: int) -> str:
    """``s`` on one line, cut to ``n`` characters (``...`` marks the cut)."""
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


# ----------------------------------------------------------------------------------------------------------------
# compile time vs check time
# ----------------------------------------------------------------------------------------------------------------

_clock = {"compile": 0.0, "depth": 0, "built": 0, "loaded": 0}


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Count the block's wall time as compile time of the running line (:func:`run_check`).

    A line wraps the *first* call of each fast-path variant in it (the forward + backward of a kernel line, the
    first decode step, a model's first forward, a compiled function's first call): that call compiles and autotunes
    whatever kernels it needs that this process has not compiled yet, and runs them once (on a GPU the run is
    milliseconds at the self-check's shapes); everything else of the line (the float64 reference, the comparisons,
    the later fast calls) is check time. Nested blocks count once."""
    if _clock["depth"]:
        yield
        return
    _clock["depth"] = 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _clock["compile"] += time.perf_counter() - t0
        _clock["depth"] = 0


# ----------------------------------------------------------------------------------------------------------------
# the time budget
# ----------------------------------------------------------------------------------------------------------------

_budget = {"deadline": None, "budget_s": None, "quick": False}


def set_budget(deadline: Optional[float], budget_s: Optional[float], quick: bool = False) -> None:
    """Record the run's time budget in this process: ``deadline`` (``time.time()`` seconds; None: no budget),
    ``budget_s`` (``--budget-s``) and whether it is a ``--quick`` run (for the messages)."""
    _budget.update(deadline=deadline, budget_s=budget_s, quick=bool(quick))


def remaining_s() -> Optional[float]:
    """Seconds left until the deadline (negative once it has passed), or None without a budget."""
    d = _budget["deadline"]
    return None if d is None else d - time.time()


def budget_reason(stopped_after: Optional[float] = None) -> str:
    """The SKIP reason of a line the budget left out: ``not run: the 300 s budget was spent; ...`` or, for a line
    that was running when the budget ran out, ``stopped after 41 s: the 300 s budget was spent while it ran; ...``;
    both say how to give the run more time."""
    b = _budget["budget_s"] or 0.0
    hint = (
        f"rerun with --budget-s {int(2 * b)}"
        + (" or without --quick" if _budget["quick"] else "")
        + " (the kernel cache makes a second run faster)"
    )
    if stopped_after is None:
        return f"not run: the {b:.0f} s budget was spent; {hint}"
    return f"stopped after {stopped_after:.0f} s: the {b:.0f} s budget was spent while it ran; {hint}"


def add_compile_time(seconds: float, built: int = 0, loaded: int = 0) -> None:
    """Add ``seconds`` of compile time (and kernel counts) to the running line, measured elsewhere: a training
    subprocess's start-up up to its first optimizer step, and the kernels it compiled."""
    _clock["compile"] += max(0.0, float(seconds))
    _clock["built"] += int(built)
    _clock["loaded"] += int(loaded)


def run_check(name: str, fn: Callable[[], Any]) -> Result:
    """Run one check ``fn() -> (status, detail) | Verdict``; :class:`Skip` / :class:`Fail` / any other exception
    become SKIP / FAIL lines (the exception type and message, shortened). Never raises (KeyboardInterrupt aside).
    The result carries the line's wall time and its compile part (:func:`compiling`, :func:`add_compile_time`), and
    the Triton kernels compiled and loaded meanwhile (:func:`canonlm.selfcheck.triton_hooks.count_compiles`)."""
    _clock.update(compile=0.0, depth=0, built=0, loaded=0)
    before = triton_hooks.kernel_counts()
    t0 = time.perf_counter()
    try:
        out = fn()
        v = out if isinstance(out, Verdict) else Verdict(*out)
    except Skip as e:
        v = Verdict(SKIP, str(e))
    except Fail as e:
        v = Verdict(FAIL, str(e))
    except Exception as e:  # noqa: BLE001 -- a crashing check is a FAIL line, the others still run
        v = Verdict(FAIL, f"{type(e).__name__}: {short(str(e), 300)}")
    if v.status not in (PASS, FAIL, SKIP):
        v = Verdict(FAIL, f"check returned status {v.status!r} ({v.detail})")
    seconds = time.perf_counter() - t0
    after = triton_hooks.kernel_counts()
    kernels = {k: after[k] - before[k] + _clock[k] for k in ("built", "loaded")}
    return Result(
        **dataclasses.asdict(v),
        name=name,
        seconds=seconds,
        compile_s=min(_clock["compile"], seconds),
        kernels={k: n for k, n in kernels.items() if n},
    )


def fmt_ran(ran: dict) -> str:
    """``canon=dao:12 gla=fla:2`` (``{op: {backend: calls}}`` of :func:`canonlm.ops.backend_calls`), or
    ``nothing``."""
    parts = [f"{op}=" + ",".join(f"{b}:{n}" for b, n in sorted(bs.items())) for op, bs in sorted(ran.items()) if bs]
    return " ".join(parts) or "nothing"


def fmt_backends(b: dict) -> str:
    """``canon=dao gla=fla`` (``{op: backend}``)."""
    return " ".join(f"{k}={v}" for k, v in sorted(b.items()))


def judge_ran(want: dict, ran: dict, required: Iterable[str] = ()) -> Optional[str]:
    """None when every op of ``want`` ran only its wanted fast backend(s), and every op of ``required`` ran at least
    once; else what went wrong (for a FAIL line).

    ``want`` maps an op to one backend or a tuple of acceptable ones (Canon: ``("dao", "fla")``, since the model
    resolves each Canon layer by its shape); ``ran`` is ``{op: {backend: calls}}`` of
    :func:`canonlm.ops.backend_calls`. An op of ``want`` that is not ``required`` may not have been called at all
    (e.g. Canon in a model whose only conv is fused into Mamba2's split kernel)."""
    bad = []
    for op, fast in want.items():
        allowed = (fast,) if isinstance(fast, str) else tuple(fast)
        got = {b: n for b, n in ran.get(op, {}).items() if n}
        other = sorted(b for b in got if b not in allowed)
        if other:
            bad.append(f"{op} ran {'/'.join(other)} (want {'/'.join(allowed)}: fallback)")
        elif op in required and not got:
            bad.append(f"{op}: {'/'.join(allowed)} did not run")
    return "; ".join(bad) or None


def judge_errors(errors: dict[str, float], tol: float) -> tuple[str, str]:
    """``(PASS | FAIL, detail)`` for ``errors`` = ``{tensor name: max |fast - ref| / max |ref|}``: FAIL when nothing
    was compared or an error is above ``tol`` or not finite. The detail names the worst tensor and the tolerance."""
    if not errors:
        return FAIL, "nothing was compared"
    bad = {k: v for k, v in errors.items() if not (v <= tol)}  # NaN is bad
    worst = max(errors, key=lambda k: (not math.isfinite(errors[k]), errors[k]))
    if bad:
        return FAIL, (
            f"max rel err {errors[worst]:.2e} ({worst}) > tol {tol:.0e}; over tol: "
            + ", ".join(f"{k} {v:.2e}" for k, v in bad.items())
        )
    return PASS, f"max rel err {errors[worst]:.2e} ({worst}) <= tol {tol:.0e} ({len(errors)} tensors)"


def judge_kernel(
    op: str, fast: str, resolved: Optional[str], ran: dict, errors: dict[str, float], tol: float, note: str = ""
) -> Verdict:
    """Verdict of a fast-path-vs-reference comparison.

    Args:
        op: the sequence op (``"gla"``...); fast: the backend under test (e.g. ``"fla"``).
        resolved: the backend the op's resolution selected (None: unknown).
        ran: ``{op: {backend: calls}}`` observed by :func:`canonlm.ops.backend_calls` around the fast path's calls.
        errors: ``{tensor name: max |fast - ref| / max |ref|}`` of every output and gradient compared.
        tol: the largest error that passes. note: appended to the detail (e.g. the fp32 precision in force).
    Returns:
        A :class:`Verdict`: FAIL when the selected backend is not ``fast``, when ``fast`` was not called or another
        backend of ``op`` was (a fallback to the reference is never a pass, whatever the errors), when nothing was
        compared, or when an error is above ``tol`` or not finite (:func:`judge_errors`).
    """
    facts = dict(op=op, backend=fast, ran=ran, errors=errors, tol=tol)
    if resolved != fast:
        return Verdict(
            FAIL, f"backend {resolved!r} was selected, not {fast!r} (fallback: the fast path did not run)", **facts
        )
    bad = judge_ran({op: fast}, ran, required=(op,))
    if bad:
        return Verdict(FAIL, f"{bad} (ran {fmt_ran(ran)})", **facts)
    status, detail = judge_errors(errors, tol)
    return Verdict(status, f"ran {fmt_ran(ran)}; {detail}{note}", **facts)
