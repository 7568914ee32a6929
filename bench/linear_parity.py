"""Parity report of the linear-model ops and models (prints max errors measured in this run).

For each op (GLA, gated delta rule, SSD) at B=2, T=130 (not a multiple of the chunk), H=4, with an initial state:

* fp64 chunked reference vs the step-by-step loop oracle (``canonlm.ops.<op>.naive``, the one the tests use): output,
  final state and the gradients of every input (max abs error, and relative to the largest entry);
* fp32 reference vs the same fp64 oracle;
* fla's naive recurrent reference (fp32, loaded by path from fla-core) vs the fp32 reference, where installed.

Then, for every architecture preset (``conf/arch/<preset>.yaml``) with Canon-AbCD (Llama: ABCD; Mamba2 without MLP:
Ab) at 2L64D on the references: cached decoding (prefill 7, then single tokens and one 5-token chunk) vs one full
forward, in fp64 and fp32 (max abs logit error).

Usage: python bench/linear_parity.py
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from canonlm.arch import CanonLM, build_model_config
from canonlm.ops._fla_naive import load_fla_naive
from canonlm.ops.gdn import chunk_gated_delta_rule_reference
from canonlm.ops.gdn.naive import gdn_loop
from canonlm.ops.gla import chunk_gla_reference
from canonlm.ops.gla.naive import gla_loop
from canonlm.ops.ssd import ssd_scan_reference
from canonlm.ops.ssd.naive import ssd_loop

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("llama", "gla", "gla5", "gdn", "gdn2", "mamba2", "mamba2_nomlp")
B, T, H, CHUNK = 2, 130, 4, 64


def arch_preset(name: str) -> dict:
    """The ``model`` keys of ``conf/arch/<name>.yaml``, after those of the preset it extends (a plain ``- <preset>``
    entry of its ``defaults``), as ``python train.py arch=<name>`` composes them."""
    node = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "arch" / f"{name}.yaml"))
    out: dict = {}
    for parent in node.pop("defaults", []):
        if isinstance(parent, str) and parent != "_self_":
            out.update(arch_preset(parent))
    return {**out, **node}


def build(preset: str, canon: str, dtype: torch.dtype) -> CanonLM:
    """A 2L64D model of ``preset`` with Canon set ``canon`` on the references (``ops=reference``, chunk 16), vocab 32,
    seeded, in ``dtype``, in eval mode."""
    cfg = build_model_config(
        dict(arch_preset(preset), size="2L64D", chunk_size=16),
        canon={"set": canon},
        pos={"type": "rope"},
        vocab_size=32,
        max_seq_len=256,
        ops="reference",
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CanonLM(cfg).to(dtype).eval()


def decode_in_pieces(model: CanonLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of one full forward, logits of prefill 7 -> 3 single tokens -> a 5-token chunk -> single tokens) for
    ids (B, 23)."""
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        parts, t = [model(ids[:, :7], cache)], 7
        for n in (1, 1, 1, 5) + (1,) * 8:
            parts.append(model(ids[:, t : t + n], cache))
            t += n
    return full, torch.cat(parts, 1)


def _grads(fn, inputs, seed=7):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    o, s = fn(*inputs)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)
    ds = torch.randn(s.shape, generator=g, dtype=torch.float64).to(s.dtype)
    ((o * do).sum() + (s * ds).sum()).backward()
    return [o.detach(), s.detach()] + [t.grad for t in inputs]


def _report(name, got, want, labels):
    errs = []
    for lab, a, b in zip(labels, got, want):
        e = (a.double() - b.double()).abs().max().item()
        errs.append(f"{lab} {e:.1e} ({e / max(b.double().abs().max().item(), 1e-30):.0e} rel)")
    print(f"  {name:<34} " + ", ".join(errs))


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    d = torch.float64
    print(f"# B={B}, T={T}, H={H}, chunk {CHUNK}, with initial state; max |error| (and relative to max |value|)")

    # GLA
    K, V = 16, 24
    q, k = torch.randn(B, T, H, K, generator=g, dtype=d), torch.randn(B, T, H, K, generator=g, dtype=d)
    v, gk = (
        torch.randn(B, T, H, V, generator=g, dtype=d),
        F.logsigmoid(torch.randn(B, T, H, K, generator=g, dtype=d)) / 4,
    )
    h0 = torch.randn(B, H, K, V, generator=g, dtype=d)
    labels = ["o", "S", "dq", "dk", "dv", "dg", "dh0"]
    want = _grads(lambda *a: gla_loop(*a[:4], initial_state=a[4]), [q, k, v, gk, h0])
    ref = lambda *a: chunk_gla_reference(*a[:4], initial_state=a[4], output_final_state=True, chunk_size=CHUNK)
    print("GLA (chunk_gla_reference)")
    _report("fp64 vs loop oracle", _grads(ref, [q, k, v, gk, h0]), want, labels)
    got32 = _grads(ref, [t.float() for t in (q, k, v, gk, h0)])
    _report("fp32 vs fp64 loop oracle", got32, want, labels)
    naive = load_fla_naive("gla")
    if naive is not None:  # fla's naive uses the scale K^-1/2 as canonlm's default
        fn = lambda *a: naive.naive_recurrent_gla(*a[:4], initial_state=a[4], output_final_state=True)
        _report(
            "fla naive_recurrent_gla fp32 vs ref", _grads(fn, [t.float() for t in (q, k, v, gk, h0)]), got32, labels
        )

    # GDN
    K, V = 16, 24
    q, k = torch.randn(B, T, H, K, generator=g, dtype=d), torch.randn(B, T, H, K, generator=g, dtype=d)
    v = torch.randn(B, T, H, V, generator=g, dtype=d)
    gg = -F.softplus(torch.randn(B, T, H, generator=g, dtype=d))
    beta = torch.rand(B, T, H, generator=g, dtype=d)
    h0 = torch.randn(B, H, K, V, generator=g, dtype=d) * 0.1
    labels = ["o", "S", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    want = _grads(lambda *a: gdn_loop(*a[:5], initial_state=a[5]), [q, k, v, gg, beta, h0])
    ref = lambda *a: chunk_gated_delta_rule_reference(
        *a[:5], initial_state=a[5], output_final_state=True, chunk_size=CHUNK
    )
    print("GDN (chunk_gated_delta_rule_reference, q/k L2-normalised)")
    _report("fp64 vs loop oracle", _grads(ref, [q, k, v, gg, beta, h0]), want, labels)
    got32 = _grads(ref, [t.float() for t in (q, k, v, gg, beta, h0)])
    _report("fp32 vs fp64 loop oracle", got32, want, labels)
    naive = load_fla_naive("gated_delta_rule")
    if naive is not None:  # fla's naive applies no L2 norm: feed it normalised q/k and compare with l2norm off
        qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        ins = [t.float() for t in (qn, kn, v, gg, beta, h0)]
        ref_nol2 = lambda *a: chunk_gated_delta_rule_reference(
            *a[:5], initial_state=a[5], output_final_state=True, chunk_size=CHUNK, use_qk_l2norm=False
        )
        fn = lambda *a: naive.naive_recurrent_gated_delta_rule(
            a[0], a[1], a[2], a[4], a[3], initial_state=a[5], output_final_state=True
        )
        _report("fla naive_recurrent fp32 vs ref", _grads(fn, ins), _grads(ref_nol2, ins), labels)

    # SSD
    P, G, N = 8, 2, 16
    x = torch.randn(B, T, H, P, generator=g, dtype=d)
    dt = torch.randn(B, T, H, generator=g, dtype=d)
    A = -torch.exp(torch.rand(H, generator=g, dtype=d) * 2)
    Bm, Cm = torch.randn(B, T, G, N, generator=g, dtype=d), torch.randn(B, T, G, N, generator=g, dtype=d)
    Dv, db = torch.randn(H, generator=g, dtype=d), torch.randn(H, generator=g, dtype=d)
    h0 = torch.randn(B, H, P, N, generator=g, dtype=d)
    labels = ["y", "S", "dx", "ddt", "dA", "dB", "dC", "dD", "ddt_bias", "dh0"]
    want = _grads(lambda *a: ssd_loop(*a[:7], initial_state=a[7]), [x, dt, A, Bm, Cm, Dv, db, h0])
    ref = lambda *a: ssd_scan_reference(
        *a[:5], D=a[5], dt_bias=a[6], initial_state=a[7], output_final_state=True, chunk_size=CHUNK
    )
    print("SSD (ssd_scan_reference)")
    _report("fp64 vs loop oracle", _grads(ref, [x, dt, A, Bm, Cm, Dv, db, h0]), want, labels)
    _report("fp32 vs fp64 loop oracle", _grads(ref, [t.float() for t in (x, dt, A, Bm, Cm, Dv, db, h0)]), want, labels)

    print("Decode (prefill 7, single tokens, one 5-token chunk) vs one full forward, 2L64D, max |logit error|")
    for preset in PRESETS:
        canon = "ABCD" if preset == "llama" else ("Ab" if preset == "mamba2_nomlp" else "AbCD")
        row = []
        for dtype in (torch.float64, torch.float32):
            full, pieces = decode_in_pieces(build(preset, canon, dtype), torch.randint(0, 32, (3, 23), generator=g))
            row.append(f"{str(dtype)[6:]} {(pieces - full).abs().max().item():.1e}")
        print(f"  {preset:<14} canon={canon:<5} " + ", ".join(row))


if __name__ == "__main__":
    main()
