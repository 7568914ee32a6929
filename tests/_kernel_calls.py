"""Helpers for the ``gpu``-marked op tests: prove the fast kernel really ran, and fp32 tolerances that know Triton's
TF32 default.

* :func:`count_calls` replaces ``module.name`` (a canonlm wrapper such as ``canonlm.ops.ssd._mamba.chunk_scan``) by a
  pass-through that counts its calls, so a test can assert the fast path was taken (the library itself is not
  mocked: the wrapper calls the original).
* :func:`fp32_tol`: Triton's ``tl.dot`` rounds fp32 operands to TF32 (10-bit mantissa) unless the process was started
  with ``TRITON_F32_DEFAULT=ieee`` (Triton's ``language.fp32_default`` knob). fla 0.6 has no switch of its own for
  chunk_gla / chunk_gated_delta_rule (it forces ``ieee`` only on pre-Ampere GPUs, ``fla/utils/hardware.py``), and
  mamba-ssm has none either; a kernel compiled before the variable is set keeps its precision for the process, so the
  variable must be set before pytest starts. With it the fp32 tolerance is tight; without it it allows TF32 rounding
  (about 1e-3 relative per product, accumulated over a chunk). The rule is
  :func:`canonlm.selfcheck.numerics.fp32_tol`, the one ``python -m canonlm.selfcheck`` uses too.
"""

from __future__ import annotations

import torch

from canonlm.selfcheck.numerics import fp32_tol  # noqa: F401 -- re-exported: fp32_tol(tight=2e-4, tf32=5e-3)


def no_torch_tf32(monkeypatch) -> None:
    """Force IEEE fp32 in torch's own matmuls / convs for the test (cuBLAS / cuDNN TF32 off)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def count_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` for the test; returns the list that grows by one per call."""
    orig = getattr(module, name)
    calls: list = []

    def wrapper(*args, **kwargs):
        calls.append(name)
        return orig(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls
