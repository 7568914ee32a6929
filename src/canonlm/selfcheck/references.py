"""Reference lines (CPU, float64): each op's pure-PyTorch reference against its plain-loop oracle
(``canonlm.ops.<op>.naive``), outputs, final states and every input gradient -- the references the kernel lines
measure the fast kernels against are themselves checked here."""

from __future__ import annotations

from canonlm.selfcheck.kernels import canon_case
from canonlm.selfcheck.numerics import compare, fwd_bwd, gen, rel_err
from canonlm.selfcheck.verdict import judge_errors


def check_cpu_canon_reference_loop() -> tuple[str, str]:
    """``causal_conv1d_reference`` and the one-token ``causal_conv1d_step`` vs ``canon_loop`` (float64; B=2, T=30,
    C=16, K=4, bias, SiLU, initial state); tolerance 1e-12."""
    import torch

    from canonlm.ops.canon import causal_conv1d_reference, causal_conv1d_step
    from canonlm.ops.canon.naive import canon_loop

    x, w, b, h0 = canon_case(torch.float64, "cpu", B=2, T=30, C=16, K=4)
    errors: dict[str, float] = {}
    got = fwd_bwd(
        lambda x, w, b, h: (causal_conv1d_reference(x, w, b, activation=True, initial_state=h),), [x, w, b, h0]
    )
    ref = fwd_bwd(lambda x, w, b, h: (canon_loop(x, w, b, True, True, h),), [x, w, b, h0])
    compare(["y"], ["x", "w", "b", "init"], got, ref, errors)
    state = torch.cat([torch.zeros(2, 16, 1, dtype=torch.float64), h0], -1)
    ys = []
    for t in range(x.shape[1]):
        y, state = causal_conv1d_step(x[:, t], state, w, b, activation=True, backend="torch")
        ys.append(y)
    errors["y_steps"] = rel_err(torch.stack(ys, 1), ref[0][0])
    return judge_errors(errors, 1e-12)


def check_cpu_linear_reference(op: str) -> tuple[str, str]:
    """The chunked reference of ``op`` (gla / gdn / ssd; chunk 16, T = 37, initial state) vs its step-by-step loop
    (``gla_loop`` / ``gdn_loop`` / ``ssd_loop``) in float64: outputs, final state and every input gradient; tolerance
    1e-10."""
    import torch
    import torch.nn.functional as F

    g = gen({"gla": 11, "gdn": 12, "ssd": 13}[op])
    B, T, H = 2, 37, 2
    d = torch.float64
    errors: dict[str, float] = {}
    if op == "gla":
        from canonlm.ops.gla import chunk_gla_reference
        from canonlm.ops.gla.naive import gla_loop

        K, V = 8, 6
        ins = [
            torch.randn(B, T, H, K, generator=g, dtype=d),
            torch.randn(B, T, H, K, generator=g, dtype=d),
            torch.randn(B, T, H, V, generator=g, dtype=d),
            F.logsigmoid(torch.randn(B, T, H, K, generator=g, dtype=d)) / 4,
            torch.randn(B, H, K, V, generator=g, dtype=d),
        ]
        got = fwd_bwd(
            lambda q, k, v, gg, h: chunk_gla_reference(
                q, k, v, gg, initial_state=h, output_final_state=True, chunk_size=16
            ),
            ins,
        )
        ref = fwd_bwd(lambda q, k, v, gg, h: gla_loop(q, k, v, gg, initial_state=h), ins)
        names = ["q", "k", "v", "g", "h0"]
    elif op == "gdn":
        from canonlm.ops.gdn import chunk_gated_delta_rule_reference
        from canonlm.ops.gdn.naive import gdn_loop

        K, V = 8, 6
        ins = [
            torch.randn(B, T, H, K, generator=g, dtype=d),
            torch.randn(B, T, H, K, generator=g, dtype=d),
            torch.randn(B, T, H, V, generator=g, dtype=d),
            F.logsigmoid(torch.randn(B, T, H, generator=g, dtype=d) + 2.0),
            torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=d)),
            torch.randn(B, H, K, V, generator=g, dtype=d),
        ]
        got = fwd_bwd(
            lambda q, k, v, gg, b, h: chunk_gated_delta_rule_reference(
                q, k, v, gg, b, initial_state=h, output_final_state=True, chunk_size=16
            ),
            ins,
        )
        ref = fwd_bwd(lambda q, k, v, gg, b, h: gdn_loop(q, k, v, gg, b, initial_state=h), ins)
        names = ["q", "k", "v", "g", "beta", "h0"]
    else:
        from canonlm.ops.ssd import ssd_scan_reference
        from canonlm.ops.ssd.naive import ssd_loop

        P, G, N = 3, 1, 5
        ins = [
            torch.randn(B, T, H, P, generator=g, dtype=d),
            torch.randn(B, T, H, generator=g, dtype=d),
            -torch.exp(torch.rand(H, generator=g, dtype=d) * 2),
            torch.randn(B, T, G, N, generator=g, dtype=d),
            torch.randn(B, T, G, N, generator=g, dtype=d),
            torch.randn(H, generator=g, dtype=d),
            torch.randn(H, generator=g, dtype=d) * 0.5,
            torch.randn(B, H, P, N, generator=g, dtype=d),
        ]
        got = fwd_bwd(
            lambda x, dt, A, Bm, Cm, D, db, h: ssd_scan_reference(
                x, dt, A, Bm, Cm, D=D, dt_bias=db, initial_state=h, output_final_state=True, chunk_size=16
            ),
            ins,
        )
        ref = fwd_bwd(lambda x, dt, A, Bm, Cm, D, db, h: ssd_loop(x, dt, A, Bm, Cm, D, db, initial_state=h), ins)
        names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "h0"]
    compare(["o", "S"], names, got, ref, errors)
    return judge_errors(errors, 1e-10)
