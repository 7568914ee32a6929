"""Mutation check of the interpreter tier (tests/test_triton_interpret.py): plausible call-site bugs, each applied to a
copy of ``src/`` and run through the tier's cases; every one must make a case fail.

    python scripts/interp_mutations.py            # all mutations (about 2 minutes on 2 cores)
    python scripts/interp_mutations.py gdn_g_beta  # some

Each mutation replaces one exact line of canonlm's fast-path wrappers (the script stops if the line is not found, so a
refactor cannot turn a mutation into a no-op). The copy is imported through PYTHONPATH ahead of the editable install;
the working tree is never modified. Prints one row per mutation: the cases run, whether the tier caught it, and the
first failure (largest relative error, or the exception) it reported. Needs the same packages as the tier
(``bash scripts/setup.sh dev,interp``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# name: (file under src/canonlm, exact old text, new text, cases to run, what the bug is)
MUTATIONS = {
    "gdn_g_beta": (
        "ops/gdn/_fla.py",
        "o, s = chunk(\n            qc,\n            kc,\n            vc,\n            g,\n            beta,\n",
        "o, s = chunk(\n            qc,\n            kc,\n            vc,\n            beta,\n            g,\n",
        ["gdn_chunk-fp32"],
        "GDN: g and beta swapped in the chunk_gated_delta_rule call",
    ),
    "gdn_no_l2norm": (
        "ops/gdn/_fla.py",
        "output_final_state=output_final_state,\n            use_qk_l2norm_in_kernel=use_qk_l2norm,\n        )\n    else:",
        "output_final_state=output_final_state,\n        )\n    else:",
        ["gdn_decode-fp32"],
        "GDN decode: use_qk_l2norm_in_kernel dropped (fla's default is False)",
    ),
    "canon_state_pad": (
        "ops/canon/_cuda.py",
        "state = F.pad(initial_state.to(x.dtype), (1, 0))",
        "state = F.pad(initial_state.to(x.dtype), (0, 1))",
        ["canon_residual_state-fp32"],
        "Canon (fla): initial state padded on the wrong side",
    ),
    "ssd_b_c": (
        "ops/ssd/_mamba.py",
        "A.float(),\n        B.to(x.dtype).contiguous(),\n        C.to(x.dtype).contiguous(),\n        int(chunk_size),",
        "A.float(),\n        C.to(x.dtype).contiguous(),\n        B.to(x.dtype).contiguous(),\n        int(chunk_size),",
        ["ssd_chunk-fp32"],
        "SSD: B and C swapped in mamba_chunk_scan_combined",
    ),
    "ssd_softplus": (
        "ops/ssd/_mamba.py",
        "dt_softplus=bool(dt_softplus),\n        dt_limit=(float(dt_limit[0]), float(dt_limit[1])),",
        "dt_limit=(float(dt_limit[0]), float(dt_limit[1])),",
        ["ssd_chunk-fp32"],
        "SSD: dt_softplus dropped (mamba-ssm's default is False)",
    ),
    "ssd_groups": (
        "ops/ssd/_mamba.py",
        "B[:, 0].to(x.dtype).contiguous(),\n        C[:, 0].to(x.dtype).contiguous(),\n        D=D_e,",
        "B[:, 0].to(x.dtype).repeat(1, H // B.shape[2], 1),\n        C[:, 0].to(x.dtype).repeat(1, H // B.shape[2], 1),\n"
        "        D=D_e,",
        ["ssd_decode-fp32"],
        "SSD decode: groups expanded to heads by tiling (head h gets group h % G, not h // (H / G))",
    ),
    "gla_decode_state": (
        "ops/gla/_fla.py",
        "o, ht = fused(q, k, v, gk=g, scale=scale, initial_state=h0,",
        "o, ht = fused(q, k, v, gk=g, scale=scale, initial_state=None,",
        ["gla_decode-fp32"],
        "GLA decode: the recurrent state not passed to fused_recurrent_gla",
    ),
    "canon_fold_twice": (
        "ops/canon/_cuda.py",
        "residual=xin if residual and not fold else None,\n        initial_state=state,",
        "residual=xin if residual else None,\n        initial_state=state,",
        ["canon_residual_state-fp32"],
        "Canon (fla): residual folded into the weight and also passed as fla's residual (added twice)",
    ),
    "canon_fold_tap": (
        "ops/canon/_fold.py",
        "return torch.cat([weight[:, :-1], weight[:, -1:] + 1], dim=1)",
        "return torch.cat([weight[:, :1] + 1, weight[:, 1:]], dim=1)",
        ["canon_residual_state-fp32"],
        "Canon: residual folded into the oldest tap instead of the current token's",
    ),
    "canon_step_residual": (
        "ops/canon/_cuda.py",
        "y, new_state = upd(x_t, new_state, x_t if residual else None, weight, bias,",
        "y, new_state = upd(x_t, new_state, None, weight, bias,",
        ["canon_step-fp32"],
        "Canon decode (fla): residual dropped in causal_conv1d_update",
    ),
}


def run(names: list[str]) -> list[dict]:
    import test_triton_interpret as tier

    rows = []
    for name in names:
        path, old, new, cases, what = MUTATIONS[name]
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(ROOT / "src", Path(tmp) / "src")
            f = Path(tmp) / "src" / "canonlm" / path
            text = f.read_text()
            if text.count(old) != 1:
                raise SystemExit(f"mutation {name}: the line to mutate is not in {path} exactly once: {old!r}")
            f.write_text(text.replace(old, new))
            env = dict(os.environ, PYTHONPATH=str(Path(tmp) / "src"), TRITON_INTERPRET="1")
            proc = subprocess.run(
                [sys.executable, str(ROOT / "tests" / "test_triton_interpret.py"), *cases],
                capture_output=True,
                text=True,
                env=env,
                cwd=ROOT,
            )
        start = proc.stdout.find("{")
        res = json.loads(proc.stdout[start:])["cases"] if proc.returncode == 0 and start >= 0 else {}
        failures = {c: tier.problems(c, r) for c, r in res.items()}
        caught = (not res) or any(failures.values())
        first = next((f"{c}: {p[0]}" for c, p in failures.items() if p), proc.stderr[-300:] if not res else "-")
        rows.append({"mutation": name, "bug": what, "cases": cases, "caught": caught, "report": first})
    return rows


if __name__ == "__main__":
    picked = sys.argv[1:] or list(MUTATIONS)
    unknown = [n for n in picked if n not in MUTATIONS]
    if unknown:
        raise SystemExit(f"unknown mutation(s) {unknown}; allowed: {', '.join(MUTATIONS)}")
    rows = run(picked)
    print("| mutation | bug | case | caught | what the tier reported |\n|---|---|---|---|---|")
    for r in rows:
        rep = r["report"].replace("\n", " ").replace("|", "/")
        print(
            f"| {r['mutation']} | {r['bug']} | {', '.join(r['cases'])} | {'yes' if r['caught'] else 'NO'} | "
            f"{rep[:300]} |"
        )
    sys.exit(0 if all(r["caught"] for r in rows) else 1)
