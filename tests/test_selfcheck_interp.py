"""``python -m canonlm.selfcheck``'s kernel lines against the real fla / mamba-ssm Triton kernels, on CPU under Triton's
interpreter (the harness of tests/_triton_interp.py).

tests/test_selfcheck.py checks the self-check's logic with the fast kernels replaced by their references; here its
own GPU harness (backend resolution, the kernel-call counters that prove a fast path ran, the float64 comparisons and
tolerances, the verdicts) runs the real libraries: every Triton kernel line (Canon ``fla``, GLA, GDN, SSD, the fused
Mamba2 split) must PASS with the fast backend seen running, and report its compile time (the first call of each
kernel variant, interpreted here) apart from its check time. The lines of the CUDA C++ kernels (Canon ``dao``,
attention ``flash``/``sdpa`` on CUDA) cannot run here and are left out, and so is the compiled Canon line (inductor,
not a library's Triton kernel: tests/test_selfcheck.py runs it with inductor's CPU backend). The self-check's GPU
shapes are shrunk (B=1, short T, two heads, head dim 16) so the interpreter finishes in minutes; the code paths are
the same. The lines run under the self-check's first-config autotuning, as in a worker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MISSING = [m for m in ("triton", "fla", "mamba_ssm", "causal_conv1d") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(MISSING) and not os.environ.get("CI"),
        reason=f"needs {', '.join(MISSING)} (bash scripts/setup.sh dev,interp)",
    ),
]

SCRIPT = r"""
import dataclasses, functools, json, sys
sys.path.insert(0, sys.argv[1])
import _triton_interp
launches = _triton_interp.enable()
from canonlm.selfcheck import kernels
from canonlm.selfcheck.verdict import run_check

# the self-check's GPU shapes, shrunk for the interpreter (same code paths)
small = {"canon_case": dict(B=1, T=40, C=16), "gla_case": dict(B=1, T=40, H=2, K=16, V=16),
         "gdn_case": dict(B=1, T=40, H=2, K=16, V=16), "ssd_case": dict(B=1, T=40, H=2, P=16, G=1, N=16)}
for name, kw in small.items():
    setattr(kernels, name, functools.partial(getattr(kernels, name), **kw))
kernels.SPLIT_SHAPE = dict(B=1, T=40, H=2, P=8, G=1, N=16, W=4, out=16)   # widths still multiples of 8
# Canon's `auto` on a CPU device picks the native C kernel; resolve it as on CUDA (fla: Dao's C++ op is not Triton)
from canonlm.ops import canon
resolve = canon.resolve_backend
canon.resolve_backend = lambda name, device, *a, **k: resolve("fla" if name == "auto" else name, device, *a, **k)
from canonlm.selfcheck.triton_hooks import install_first_config_autotune
assert install_first_config_autotune() is None
rows = []
for name, op, fast, fn in kernels.kernel_checks("cpu", ("fp32", "bf16")):
    if op == "attention" or fast in ("dao", "torch"):
        continue                         # CUDA C++ kernels, and inductor's: not a library's Triton kernel
    launches.clear()
    r = run_check(name, fn)
    rows.append({"name": name, "op": op, "fast": fast, "status": r.status, "detail": r.detail,
                 "seconds": r.seconds, "compile_s": r.compile_s, "launches": sum(launches.values())})
    print(name, r.status, round(r.seconds, 1), file=sys.stderr, flush=True)
print("RESULT " + json.dumps(rows))
"""


def planted_line(compile_s: float = 0.0, check_s: float = 0.0):
    """A planted line for tests/test_selfcheck.py's budget test, run in a self-check worker: ``compile_s`` inside
    ``compiling()``, then ``check_s``. It lives here because this module imports no torch, so a worker that imports
    it starts in a fraction of a second."""
    import time

    from canonlm.selfcheck.verdict import PASS, compiling

    with compiling():
        time.sleep(compile_s)
    time.sleep(check_s)
    return PASS, "planted"


def lingering_line():
    """A planted line that passes but leaves a non-daemon thread sleeping, so its worker closes its output and then
    does not exit (a stuck teardown): tests/test_selfcheck.py checks that the command does not wait for it."""
    import threading
    import time

    from canonlm.selfcheck.verdict import PASS

    threading.Thread(target=time.sleep, args=(600,), daemon=False).start()
    return PASS, "passed, then lingers"


@pytest.fixture(scope="module")
def lines():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(HERE)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
        cwd=HERE.parent,
    )
    out = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and out, f"self-check subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out[-1][len("RESULT ") :])


def test_selfcheck_kernel_lines_pass_on_the_real_triton_kernels(lines):
    ops = {r["op"] for r in lines}
    assert {"canon", "gla", "gdn", "ssd"} <= ops, ops
    assert len(lines) >= 16, [r["name"] for r in lines]  # 2 dtypes x (canon fla 2 + gla 2 + gdn 2 + ssd 2 + split)
    bad = [(r["name"], r["status"], r["detail"]) for r in lines if r["status"] != "PASS"]
    assert not bad, bad
    idle = [r["name"] for r in lines if r["launches"] == 0]
    assert not idle, f"lines that launched no Triton kernel: {idle}"
    # the first calls (interpreted kernels) are compile time, the float64 reference and the comparison check time
    untimed = [r["name"] for r in lines if not (0 < r["compile_s"] <= r["seconds"])]
    assert not untimed, f"lines without a compile time: {untimed}"
