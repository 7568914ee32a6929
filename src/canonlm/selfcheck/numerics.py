"""Tolerances and error measures of the self-check: the fp32 precision of Triton's ``tl.dot`` (and the tolerance it
gives the fla / mamba-ssm lines), ``max |fast - ref| / max |ref|``, and forward + backward of a function under a
fixed random projection of its outputs."""

from __future__ import annotations

import math
import os

#: Tolerance on ``max |fast - ref| / max |ref|`` against a float64 reference of the same rounded inputs, bf16.
BF16_TOL = 6e-2
#: fp32 tolerances: IEEE fp32 arithmetic (the CUDA C kernels, SDPA, fla's conv; Triton ``tl.dot`` under
#: ``TRITON_F32_DEFAULT=ieee``), and ``tl.dot`` rounding fp32 operands to TF32 (10-bit mantissa, ~1e-3 relative per
#: product, accumulated over a chunk).
FP32_TOL_IEEE, FP32_TOL_TF32 = 2e-4, 5e-3
#: Fast backends whose fp32 matmuls are Triton ``tl.dot`` calls (fla's chunked GLA / GDN, mamba-ssm's SSD kernels).
TL_DOT_BACKENDS = frozenset({("gla", "fla"), ("gdn", "fla"), ("ssd", "mamba_ssm"), ("ssd", "split")})


def triton_fp32_precision() -> str:
    """The precision Triton's ``tl.dot`` gives fp32 operands in this process: ``TRITON_F32_DEFAULT`` lower-cased
    (``ieee``, ``tf32``, ``tf32x3``, ...), or ``tf32`` when it is unset -- Triton's default on GPUs with TF32 tensor
    cores (``triton/language/core.py`` ``dot``: ``input_precision = knobs.language.fp32_default or "tf32"``).
    fla-core 0.6 sets ``TRITON_F32_DEFAULT=ieee`` itself on pre-Ampere NVIDIA GPUs when imported
    (``fla/utils/hardware.py``); mamba-ssm has no switch. Read at call time; a kernel compiled earlier keeps the
    precision it was compiled with, so set the variable before the process starts."""
    return os.environ.get("TRITON_F32_DEFAULT", "").strip().lower() or "tf32"


def fp32_tol(tight: float = FP32_TOL_IEEE, tf32: float = FP32_TOL_TF32) -> float:
    """Tolerance of an fp32 comparison involving Triton ``tl.dot`` kernels (fla, mamba-ssm): ``tight`` when
    :func:`triton_fp32_precision` is ``ieee``, else ``tf32`` (TF32 or another reduced-precision mode). The one rule
    for the self-check and the GPU tests (tests/_kernel_calls.py)."""
    return tight if triton_fp32_precision() == "ieee" else tf32


def kernel_tol(op: str, fast: str, dt: str) -> float:
    """Tolerance of a kernel line: :data:`BF16_TOL` for bf16; for fp32 :func:`fp32_tol` when ``(op, fast)`` runs
    ``tl.dot`` (:data:`TL_DOT_BACKENDS`), else :data:`FP32_TOL_IEEE`."""
    if dt == "bf16":
        return BF16_TOL
    return fp32_tol() if (op, fast) in TL_DOT_BACKENDS else FP32_TOL_IEEE


def tol_note(op: str, fast: str, dt: str) -> str:
    """``; fp32 tl.dot: <precision>`` for an fp32 line of a ``tl.dot`` backend (its tolerance depends on it)."""
    return f"; fp32 tl.dot: {triton_fp32_precision()}" if dt == "fp32" and (op, fast) in TL_DOT_BACKENDS else ""


def precision_note() -> str:
    """The report's statement of the fp32 precision in force and the fp32 tolerance it gives the Triton lines."""
    mode = triton_fp32_precision()
    src = (
        "TRITON_F32_DEFAULT=" + os.environ["TRITON_F32_DEFAULT"]
        if os.environ.get("TRITON_F32_DEFAULT")
        else "TRITON_F32_DEFAULT unset: Triton's default on TF32 GPUs"
    )
    return (
        f"{mode} ({src}); fp32 tolerance of the fla / mamba-ssm lines {fp32_tol():.0e} "
        f"({FP32_TOL_IEEE:.0e} with TRITON_F32_DEFAULT=ieee, {FP32_TOL_TF32:.0e} otherwise)"
    )


def rel_err(a, b) -> float:
    """``max |a - b| / max |b|`` in float64 (inf when shapes differ or one of them is missing; NaN propagates)."""
    if a is None or b is None:
        return math.inf if (a is None) != (b is None) else 0.0
    a, b = a.detach().double(), b.detach().double().to(a.device)
    if a.shape != b.shape:
        return math.inf
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / max(scale, 1e-30)


def fwd_bwd(fn, inputs: list, cot_seed: int = 1234):
    """``fn(*leaves) -> tuple of outputs (None allowed)`` on fresh leaves; backprop ``sum_i <out_i, r_i>`` for fixed
    random ``r_i`` (float64, seeded; the same for both paths of a comparison). Returns (outputs, input grads)."""
    import torch

    leaves = [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    g = torch.Generator().manual_seed(cot_seed)
    loss = 0.0
    for o in outs:
        if o is None:
            continue
        r = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)
        loss = loss + (o.double() * r).sum()
    req = [t for t in leaves if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(loss, req, allow_unused=True))
    gr = [None if (t is None or not t.requires_grad) else next(grads) for t in leaves]
    return [None if o is None else o.detach() for o in outs], gr


def compare(names_out, names_in, fast, ref, errors: dict, prefix: str = "") -> None:
    """Fill ``errors`` from ``fast`` / ``ref`` = (outputs, grads) of :func:`fwd_bwd` (None pairs are skipped)."""
    for n, a, b in zip(names_out, fast[0], ref[0]):
        if b is not None or a is not None:
            errors[prefix + n] = rel_err(a, b)
    for n, a, b in zip(names_in, fast[1], ref[1]):
        if b is not None or a is not None:
            errors[prefix + "d" + n] = rel_err(a, b)


def gen(seed: int):
    """A CPU ``torch.Generator`` seeded with ``seed`` (the inputs of a line are drawn on the CPU, then moved)."""
    import torch

    return torch.Generator().manual_seed(seed)


def dtype_of(name: str):
    """``"fp32"`` / ``"bf16"`` / ``"fp64"`` -> the torch dtype."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[name]


def dtype_name(dtype) -> str:
    """A torch dtype -> ``fp32`` / ``bf16`` / ``fp64`` / ``fp16`` (else ``str(dtype)``)."""
    import torch

    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64", torch.float16: "fp16"}.get(
        dtype, str(dtype)
    )
