"""Model lines: per architecture, a small model on its fast paths against the same weights on the references, and
cached decoding against one full forward -- with the fast kernels observed running (:func:`canonlm.ops.backend_calls`),
Mamba2 on its fused split kernel wherever it can run."""

from __future__ import annotations

from typing import Optional

from canonlm.ops import backend_calls
from canonlm.selfcheck import environment as env
from canonlm.selfcheck.numerics import BF16_TOL, TL_DOT_BACKENDS, fp32_tol, gen, rel_err, triton_fp32_precision
from canonlm.selfcheck.verdict import (
    FAIL,
    Fail,
    Skip,
    Verdict,
    compiling,
    fmt_backends,
    fmt_ran,
    judge_errors,
    judge_ran,
)

#: Model presets of the small model-level checks (the ``conf/arch`` values that differ from the defaults).
PRESETS = {
    "llama": dict(arch="llama"),
    "gla": dict(arch="gla"),
    "gdn": dict(arch="gdn", expand_k=0.75, expand_v=1.5, ffn_ratio=2.0),
    "mamba2": dict(arch="mamba2", ffn_ratio=2.0, init="mamba2_default", norm_eps=1e-5),
}
#: Per architecture: Canon set without / with Canon layers (the training lines run both; model lines the second).
CANON_SETS = {"llama": ("none", "ABCD"), "gla": ("b", "AbCD"), "gdn": ("b", "AbCD"), "mamba2": ("b", "AbCD")}
#: The sequence op of each architecture's token mixer.
MIXER_OP = {"llama": "attention", "gla": "gla", "gdn": "gdn", "mamba2": "ssd"}


def _build(arch: str, canon: str, size: str, ops: str = "auto", vocab: int = 64, max_len: int = 512):
    import warnings

    from canonlm.arch import CanonLM, build_model_config

    kw = dict(PRESETS[arch], size=size)
    if ops != "auto":
        kw["ops"] = ops
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CanonLM(
            build_model_config(
                kw, canon={"set": "" if canon == "none" else canon}, vocab_size=vocab, max_seq_len=max_len
            )
        )


def _place(model, device, dtype) -> dict:
    """``CanonLM.place(device, dtype)``: the concrete ``{op: backend}`` the model was placed with (for the report)."""
    import torch

    return dict(model.place(torch.device(device), dtype))


def expected_fast(arch: str, dtype, device: str = "cuda") -> dict:
    """``{op: fast backend(s)}`` a model of ``arch`` on ``device`` must run; raises Skip / Fail when a library is
    missing or broken (the mixer op). Canon: the installed Canon kernels among ``dao`` / ``fla`` (the model resolves
    each Canon layer by its shape, Dao's kernel first), left out when neither is installed (plain torch is then
    right). Mamba2's fused path is added per model by :func:`with_split`."""
    op = MIXER_OP[arch]
    want = {}
    if op == "attention":
        want[op] = "sdpa"
    else:
        fast = "mamba_ssm" if op == "ssd" else "fla"
        bad = env.fast_unavailable(op, fast, device, dtype)
        if bad is not None:
            if bad[0] == FAIL:
                raise Fail(bad[1])
            raise Skip(f"{op}: {bad[1]}")
        want[op] = fast
    canon = []
    for c in ("dao", "fla"):
        bad = env.fast_unavailable("canon", c, device, dtype)
        if bad is None:
            canon.append(c)
        elif bad[0] == FAIL:
            raise Fail(f"canon {c}: {bad[1]}")
    if canon:
        want["canon"] = tuple(canon)
    return want


def fused_split_reason(model, device, dtype) -> Optional[str]:
    """:func:`canonlm.ops.ssd.fused_split_reason` for the Mamba2 mixer of ``model`` (a CanonLM) on (device, compute
    dtype), with the shape arguments the mixer passes to ``use_fused_split``: None when the fused
    ``mamba_split_conv1d_scan_combined`` path can run there. ``"not a Mamba2 model"`` for the other architectures."""
    from canonlm.arch.mixers.mamba2 import Mamba2Mixer
    from canonlm.ops import ssd

    mixer = model.blocks[0].attn
    if not isinstance(mixer, Mamba2Mixer):
        return "not a Mamba2 model"
    return ssd.fused_split_reason(
        device, dtype, mixer.conv_kernel, d_inner=mixer.d_inner, conv_dim=mixer.conv_dim, nheads=mixer.n_heads
    )


def with_split(want: dict, split_reason: Optional[str]) -> dict:
    """``want`` with SSD's ``mamba_ssm`` replaced by the fused ``split`` when ``split_reason`` is None (the fused path
    can run for the model's shape and dtype, so a forward without a decode cache must take it)."""
    if want.get("ssd") == "mamba_ssm" and split_reason is None:
        return {**want, "ssd": "split"}
    return want


def required_ops(arch: str, canon: str) -> tuple[str, ...]:
    """Ops a forward of a model of ``arch`` with Canon set ``canon`` must call: its mixer op, and Canon when the set
    has a Canon layer (A/B/C/D). A mixer's own conv (``b``) may be fused into Mamba2's split kernel."""
    return (MIXER_OP[arch],) + (("canon",) if any(c in canon for c in "ABCD") else ())


def _judge_model(phases: dict, required, errors: dict, tol: float, placed: dict) -> Verdict:
    """Verdict of a model line: ``phases`` = ``{label: (want, ran)}`` (FAIL when a phase ran anything but its
    wanted fast backends, :func:`~canonlm.selfcheck.verdict.judge_ran`), then the errors against ``tol``."""
    runs = "; ".join(f"{label} ran {fmt_ran(ran)}" for label, (_, ran) in phases.items())
    bad = [f"{label}: {b}" for label, (w, ran) in phases.items() if (b := judge_ran(w, ran, required))]
    facts = dict(ran={label: ran for label, (_, ran) in phases.items()}, errors=errors, tol=tol)
    if bad:
        return Verdict(
            FAIL, f"{'; '.join(bad)}: the fast path did not run ({runs}; placed {fmt_backends(placed)})", **facts
        )
    status, detail = judge_errors(errors, tol)
    return Verdict(status, f"{runs}; {detail}", **facts)


def check_model_fast_vs_reference(arch: str, device: str = "cuda", size: str = "2L256D") -> Verdict:
    """A ``size`` (2L256D) model of ``arch`` (Canon-ABCD / AbCD) on its fast paths vs the same weights with
    ``ops=reference``, under bf16 autocast: logits (max rel err) and all parameter gradients (relative L2 norm) of a
    logsumexp loss, T = 300. The fast model's forward and backward must call only the fast kernels
    (:func:`canonlm.ops.backend_calls`; Mamba2: the fused split kernel wherever it can run). Its one forward +
    backward is the line's compile time, the reference model's the check time."""
    import torch

    env.need_cuda(device)
    dtype = torch.bfloat16
    want = expected_fast(arch, dtype, device)
    canon = CANON_SETS[arch][1]
    torch.manual_seed(0)
    fast = _build(arch, canon, size).to(device)
    ref = _build(arch, canon, size, ops="reference").to(device)
    ref.load_state_dict(fast.state_dict())
    placed = _place(fast, device, dtype)
    _place(ref, device, dtype)
    want = with_split(want, fused_split_reason(fast, device, dtype))
    ids = torch.randint(0, 64, (2, 300), generator=gen(1)).to(device)

    def fwd_bwd(m):
        with torch.autocast(torch.device(device).type, dtype=dtype):
            logits = m(ids)
        logits.float().logsumexp(-1).mean().backward()
        return logits.float(), torch.cat([p.grad.flatten().float() for p in m.parameters() if p.grad is not None])

    with backend_calls(["canon", MIXER_OP[arch]]) as ran, compiling():
        lf, gf = fwd_bwd(fast)
    lr, gr = fwd_bwd(ref)
    gerr = ((gf - gr).norm() / gr.norm().clamp_min(1e-30)).item()
    return _judge_model(
        {"fwd+bwd": (want, ran)},
        required_ops(arch, canon),
        {"logits": rel_err(lf, lr), "grads(L2)": gerr},
        BF16_TOL,
        placed,
    )


def _fp32_model(arch: str, device: str, size: str, fast: bool):
    """(model of ``arch`` with its Canon set built on ``device`` with seed 0, that Canon set, the fast kernels the
    line requires: :func:`expected_fast` when ``fast`` -- which first skips the line without CUDA -- else none)."""
    import torch

    want: dict = {}
    if fast:
        env.need_cuda(device)
        want = expected_fast(arch, torch.float32, device)
    canon = CANON_SETS[arch][1]
    torch.manual_seed(0)
    return _build(arch, canon, size).to(device), canon, want


def check_model_decode(arch: str, device: str = "cuda", size: str = "2L256D", fast: bool = True) -> Verdict:
    """Cached decoding (17-token prefill, then 23 one-token steps) against one full forward, fp32, no autocast,
    for ``arch`` with Canon-ABCD / AbCD on ``device``.

    ``fast``: the fast kernels must be the ones called (:func:`expected_fast`; the full forward of Mamba2 must take
    the fused split kernel where it can run, the cached one runs the scan and state-update kernels); tolerance
    :func:`~canonlm.selfcheck.numerics.fp32_tol` (1e-3 / 1e-2 under TF32) for the ``tl.dot`` mixers, 1e-3 for
    llama. Without ``fast`` (the CPU line) the calls are only reported and the tolerance is 1e-4. Compile time: the
    full forward, the prefill and the first one-token step."""
    import torch

    dtype = torch.float32
    m, canon, want = _fp32_model(arch, device, size, fast)
    placed = _place(m, device, dtype)
    m.eval()
    ids = torch.randint(0, 64, (3, 40), generator=gen(2)).to(device)
    ops = ["canon", MIXER_OP[arch]]
    with torch.no_grad():
        with backend_calls(ops) as ran_full, compiling():
            full = m(ids)
        cache = m.new_cache()
        with backend_calls(ops) as ran_cached:
            with compiling():  # the prefill and the first one-token step: the decode kernels
                parts = [m(ids[:, :17], cache), m(ids[:, 17:18], cache)]
            parts += [m(ids[:, t : t + 1], cache) for t in range(18, 40)]
    tl_dot = (MIXER_OP[arch], want.get(MIXER_OP[arch])) in TL_DOT_BACKENDS
    tol = (fp32_tol(1e-3, 1e-2) if tl_dot else 1e-3) if want else 1e-4
    phases = {"full": (with_split(want, fused_split_reason(m, device, dtype)), ran_full), "cached": (want, ran_cached)}
    v = _judge_model(
        phases, required_ops(arch, canon) if want else (), {"logits": rel_err(torch.cat(parts, 1), full)}, tol, placed
    )
    if tl_dot:
        v.detail += f"; fp32 tl.dot: {triton_fp32_precision()}"
    return v


def check_model_doc_mask(
    arch: str, device: str = "cuda", size: str = "2L256D", fast: bool = True, T: int = 256
) -> Verdict:
    """Document masking at the model level: a ``size`` model of ``arch`` with its Canon set (llama Canon-ABCD; gla,
    gdn, mamba2 AbCD), two rows of ``T`` tokens packing the documents of
    :func:`canonlm.selfcheck.kernels.doc_lengths` (``CanonLM.forward(ids, doc_ids=...)``), fp32, no autocast, against
    the same weights on ``ops=reference`` in float64 running each document alone as its own sequence -- the oracle of
    tests/test_doc_mask.py. Compared: the logits (max rel err) and every parameter gradient of a fixed random
    projection of the logits (relative L2 norm of all gradients together).

    This is where the Canon op's document masking is checked on a GPU (its layers get the documents from the model:
    Dao's ``seq_idx`` or fla's ``cu_seqlens``), beside the mixer's (GLA / GDN ``cu_seqlens``, SSD ``seq_idx``,
    attention's block-causal mask).

    ``fast``: the packed forward + backward must call only the fast kernels (:func:`expected_fast`; Mamba2's fused
    split kernel is not used with documents, so its scan is ``mamba_ssm``), tolerance
    :func:`~canonlm.selfcheck.numerics.fp32_tol` (1e-3 / 1e-2 under TF32) for the ``tl.dot`` mixers, 1e-3 for
    llama. Without ``fast`` (the CPU line) the calls are only reported and the tolerance is 1e-4. Compile time: the
    packed forward + backward."""
    import torch

    from canonlm.selfcheck.kernels import doc_ids_of, doc_spans

    dtype = torch.float32
    m, canon, want = _fp32_model(arch, device, size, fast)
    ref = _build(arch, canon, size, ops="reference")
    ref.load_state_dict(m.state_dict())
    ref = ref.double().to(device)
    placed = _place(m, device, dtype)
    _place(ref, device, torch.float64)
    B, V = 2, 64
    ids = torch.randint(0, V, (B, T), generator=gen(4)).to(device)
    doc_ids = doc_ids_of(B, T, device)
    cot = torch.randn(B, T, V, generator=gen(5), dtype=torch.float64).to(device)
    with backend_calls(["canon", MIXER_OP[arch]]) as ran, compiling():
        packed = m(ids, doc_ids=doc_ids)
        (packed.double() * cot).sum().backward()
    alone = torch.zeros(B, T, V, dtype=torch.float64, device=device)
    for b, a, e in doc_spans(B, T):
        out = ref(ids[b : b + 1, a:e])
        (out * cot[b : b + 1, a:e]).sum().backward()
        alone[b, a:e] = out[0].detach()
    got = dict(m.named_parameters())
    names = [n for n, p in ref.named_parameters() if p.grad is not None and got[n].grad is not None]
    gf = torch.cat([got[n].grad.flatten().double() for n in names])
    gr = torch.cat([p.grad.flatten() for n, p in ref.named_parameters() if n in names])
    errors = {"logits": rel_err(packed, alone), "grads(L2)": ((gf - gr).norm() / gr.norm().clamp_min(1e-30)).item()}
    tl_dot = (MIXER_OP[arch], want.get(MIXER_OP[arch])) in TL_DOT_BACKENDS
    tol = (fp32_tol(1e-3, 1e-2) if tl_dot else 1e-3) if want else 1e-4
    v = _judge_model({"packed fwd+bwd": (want, ran)}, required_ops(arch, canon) if want else (), errors, tol, placed)
    v.detail += f"; {len(doc_spans(B, T))} documents in {B} rows of {T} tokens vs each alone (fp64 reference)"
    if tl_dot:
        v.detail += f"; fp32 tl.dot: {triton_fp32_precision()}"
    return v
