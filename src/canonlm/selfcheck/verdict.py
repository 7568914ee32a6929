"""The self-check's lines: PASS / FAIL / SKIP results, running one check so that it never raises, and the rules that
judge a line (which backends ran, how large the errors are)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Optional

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
    (wall time; keyword-only). ``status`` is PASS / FAIL / SKIP; the facts after ``detail`` are empty when the check
    ended before judging (e.g. SKIP)."""

    name: str = dataclasses.field(kw_only=True)
    seconds: float = dataclasses.field(kw_only=True)


class Skip(Exception):
    """Raised inside a check: the line is SKIP with this message as its reason."""


class Fail(Exception):
    """Raised inside a check: the line is FAIL with this message."""


def short(s: str, n: int) -> str:
    """``s`` on one line, cut to ``n`` characters (``...`` marks the cut)."""
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def run_check(name: str, fn: Callable[[], Any]) -> Result:
    """Run one check ``fn() -> (status, detail) | Verdict``; :class:`Skip` / :class:`Fail` / any other exception
    become SKIP / FAIL lines (the exception type and message, shortened). Never raises (KeyboardInterrupt aside)."""
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
    return Result(**dataclasses.asdict(v), name=name, seconds=time.perf_counter() - t0)


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
        return FAIL, (f"max rel err {errors[worst]:.2e} ({worst}) > tol {tol:.0e}; over tol: "
                      + ", ".join(f"{k} {v:.2e}" for k, v in bad.items()))
    return PASS, f"max rel err {errors[worst]:.2e} ({worst}) <= tol {tol:.0e} ({len(errors)} tensors)"


def judge_kernel(op: str, fast: str, resolved: Optional[str], ran: dict, errors: dict[str, float],
                 tol: float, note: str = "") -> Verdict:
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
        return Verdict(FAIL, f"backend {resolved!r} was selected, not {fast!r} (fallback: the fast path did not run)",
                       **facts)
    bad = judge_ran({op: fast}, ran, required=(op,))
    if bad:
        return Verdict(FAIL, f"{bad} (ran {fmt_ran(ran)})", **facts)
    status, detail = judge_errors(errors, tol)
    return Verdict(status, f"ran {fmt_ran(ran)}; {detail}{note}", **facts)
