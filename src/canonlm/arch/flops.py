"""Analytic FLOPs per token of every CanonLM architecture (Llama, GLA, GDN, Mamba2; with Canon layers), for MFU.

Units: **FLOPs per token**, a multiply-add counted as 2 FLOPs (so ``x @ W`` with ``W`` of shape (m, n) costs
``2·m·n`` per row of ``x``). Per token means: the FLOPs of one sequence of ``seq_len`` tokens divided by
``seq_len`` (terms that grow with the position, such as attention, are averaged over the sequence).

What is counted (every term is read off the forward code of this repository; see docs/mfu.md for the table):

* every matrix product: the Linear layers of the mixers and the MLP, the LM head (also when tied to the embedding:
  it is still a d x V product), attention scores and values, and the chunked-scan products of GLA / GDN / SSD;
* the depthwise causal convolutions: Canon-A/B/C/D (kernel ``canon.kernel``) and the mixers' own short convs
  ``b`` (kernel ``conv_kernel``): ``2·K·channels`` each (K multiply-adds per channel and token);
* GDN's unit-lower-triangular solve (``scan_solve``): ``C(C-1)`` FLOPs per right-hand-side column and chunk.

What is not counted (elementwise work, O(width) per token, a few percent at most; the convention of PaLM,
Megatron and torchtitan): the embedding lookup, RMSNorm / gated norms, RoPE, softmax, activations and gating
products, residual additions (including Canon's ``h + conv(h)``), biases, the decay/gate exponentials and cumulative
sums of the linear mixers, Mamba2's ``D·x`` skip, QK-norm and GDN's q/k L2 norm.

Training = forward + backward = **3 x forward** (the backward of a product ``Y = X W`` is two products of the same
size, ``dX = dY Wᵀ`` and ``dW = Xᵀ dY``; Kaplan et al. 2020, PaLM App. B). Activation recomputation is not counted
(this is model FLOPs, not hardware FLOPs), nor are the fused kernels' own recomputations.

Conventions for the sequence terms (``convention=``):

* ``"dense"`` (default, the MFU convention): every T x T attention block and every C x C intra-chunk block is counted
  in full, as PaLM / torchtitan count attention (they do not halve it for the causal mask) and as the chunked kernels
  compute the intra-chunk blocks; chunks are not padded (a last partial chunk of r positions costs r x r).
* ``"causal"``: only the lower triangle, diagonal included, of those blocks (T(T+1)/2 query-key pairs instead of T²):
  the work a causal kernel cannot skip.
* ``"reference"``: exactly the matrix products (``mm`` / ``bmm`` / ``conv``) that this repository's pure-PyTorch
  reference ops hand to PyTorch, as ``torch.utils.flop_counter.FlopCounterMode`` counts them: T padded to a
  multiple of the chunk, GLA's chunks padded to a power of two and its intra-chunk score blocks of size <= 2 done
  elementwise (not counted), GLA's state read skipped when there is only one chunk. ``scan_solve`` is reported in
  every convention, but the counter does not see it (``torch.linalg.solve_triangular``). tests/test_flops.py checks
  ``forward - scan_solve`` of this convention against the counter exactly for every architecture.

The scan terms follow the reference algorithms. fla's GLA and mamba_ssm's SSD kernels compute the same chunked
products (the dense count); fla's GDN kernel propagates the state without the K x K chunk transition of the
reference and does about 1-3 % less work per model at the paper's sizes (docs/mfu.md).

Sources: PaLM (Chowdhery et al. 2022, App. B: ``6N + 12·L·H·Q·T``), torchtitan ``get_num_flop_per_token`` and
``get_peak_flops`` (pytorch/torchtitan), the chunked algorithms of GLA (Yang et al. 2024), Gated DeltaNet (Yang et al.
2025, WY/UT form) and Mamba2 SSD (Dao & Gu 2024) as written in ``canonlm.ops.{gla,gdn,ssd}``.
"""

from __future__ import annotations

import math

from canonlm.arch.config import ModelConfig

CONVENTIONS = ("dense", "causal", "reference")

#: Keys of the dict returned by :func:`flops_per_token` (all present for every architecture; 0.0 where absent).
COMPONENTS = (
    "embedding",
    "lm_head",
    "mixer_proj",
    "attention",
    "scan_intra",
    "scan_state",
    "scan_solve",
    "canon",
    "short_conv",
    "mlp",
)


def mfu(tokens_per_s: float, flops_per_token_train: float, peak_flops: float, world_size: int = 1) -> float:
    """Model FLOPs utilisation: ``tokens_per_s · flops_per_token_train / (peak_flops · world_size)``.

    ``tokens_per_s`` is the global throughput (all ranks), ``flops_per_token_train`` the ``"total"`` of
    :func:`flops_per_token` with ``training=True``, ``peak_flops`` the dense (no 2:4 sparsity) bf16 tensor-core peak
    of one device in FLOP/s (A100 312e12, H100 SXM 989e12; table and sources in docs/mfu.md)."""
    return tokens_per_s * flops_per_token_train / (peak_flops * world_size)


def _lengths(T: int, C: int, convention: str) -> list[int]:
    """Chunk lengths of a sequence of T positions cut into chunks of C (C > T means one chunk of T). The reference
    pads the last chunk to C (``"reference"``); the other conventions count the real lengths."""
    C = min(C, T)
    n, r = divmod(T, C)
    if convention == "reference":
        return [C] * (n + (r > 0))
    return [C] * n + ([r] if r else [])


def _pairs(L: int, convention: str) -> int:
    """Query-key pairs of one L x L causal block: all L² (dense / reference) or the lower triangle L(L+1)/2."""
    return L * (L + 1) // 2 if convention == "causal" else L * L


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _gla_scan(T: int, C: int, H: int, K: int, V: int, convention: str) -> tuple[float, float]:
    """(intra, state) FLOPs of one sequence of chunked GLA (canonlm.ops.gla), all H heads.

    Per chunk of L positions and head: scores ``A = (q ⊙ decay)(k ⊙ decay)ᵀ`` 2·L²·K, ``A v`` 2·L²·V (intra); chunk
    state ``U = (k ⊙ decay)ᵀ v`` 2·L·K·V and the read of the entry state ``(q ⊙ decay) S`` 2·L·K·V (state).
    ``"reference"``: chunks padded to C2 = next power of two of min(C, T); the score blocks are built by recursive
    halving, with matmuls only for halves u >= 4, i.e. ``sum_u C2·u·K = C2·(C2 - 4)·K`` (the u <= 2 blocks and the
    diagonal are elementwise); the state read only runs when there is more than one chunk."""
    if convention == "reference":
        Cm = min(C, T)
        n, C2 = -(-T // Cm), _next_pow2(Cm)
        intra = n * (C2 * max(C2 - 4, 0) * K + 2 * C2 * C2 * V)
        state = n * 2 * C2 * K * V * (2 if n > 1 else 1)
        return float(H * intra), float(H * state)
    intra = sum(_pairs(L, convention) * 2 * (K + V) for L in _lengths(T, C, convention))
    return float(H * intra), float(H * T * 4 * K * V)


def _gdn_scan(T: int, C: int, H: int, K: int, V: int, convention: str) -> tuple[float, float, float]:
    """(intra, state, solve) FLOPs of one sequence of the chunked gated delta rule (canonlm.ops.gdn, WY/UT form),
    all H heads.

    Per chunk of L positions and head: ``k kᵀ`` 2·L²·K, ``P = q kᵀ`` 2·L²·K, ``P Wk`` 2·L²·K, ``P U`` 2·L²·V
    (intra); ``Kdᵀ Wk`` 2·L·K², ``Kdᵀ U`` 2·L·K·V, the chunk transition ``M S`` 2·K²·V and the state read
    ``Qe S`` 2·L·K·V (state); the unit-lower-triangular solve ``(I + A)⁻¹ [βV | βΓK]`` L(L-1)·(K + V) (solve; a
    ``torch.linalg.solve_triangular`` call, which FlopCounterMode does not count)."""
    ls = _lengths(T, C, convention)
    intra = sum(_pairs(L, convention) * (6 * K + 2 * V) for L in ls)
    state = sum(2 * L * K * K + 4 * L * K * V + 2 * K * K * V for L in ls)
    solve = sum(L * (L - 1) * (K + V) for L in ls)
    return float(H * intra), float(H * state), float(H * solve)


def _ssd_scan(T: int, C: int, H: int, P: int, N: int, G: int, convention: str) -> tuple[float, float]:
    """(intra, state) FLOPs of one sequence of chunked SSD (canonlm.ops.ssd), H heads of width P, G groups, state N.

    Per chunk of L positions: scores ``C Bᵀ`` 2·L²·N per *group* (B and C are shared by the heads of a group),
    ``(L ⊙ scores) x̄`` 2·L²·P per head (intra); chunk state ``x̄ᵀ B`` 2·L·P·N and the read ``C Hᵀ`` 2·L·P·N per
    head (state)."""
    ls = _lengths(T, C, convention)
    intra = sum(_pairs(L, convention) * 2 * (G * N + H * P) for L in ls)
    state = sum(L for L in ls) * 4 * H * P * N
    return float(intra), float(state)


def flops_per_token(
    cfg: ModelConfig, seq_len: int, *, training: bool = True, chunk_size: int | None = None, convention: str = "dense"
) -> dict[str, float]:
    """FLOPs per token of :class:`~canonlm.arch.model.CanonLM` built from ``cfg``, by component.

    Args:
        cfg: a validated :class:`ModelConfig` (widths: ``d_model``, ``n_heads``, ``kv_heads``, ``head_dim``,
            ``key_dim`` / ``value_dim`` / ``head_k_dim`` / ``head_v_dim``, ``ssm_state``, ``n_groups``,
            ``mamba_expand``, ``gate_low_rank_dim``, ``output_gate_rank``, ``ffn_dim`` (``ffn_ratio``, ``d_ff``,
            rounding), ``mlp``, ``n_layers`` (already x ``n_layers_factor``), ``canon``, ``conv_kernel``,
            ``vocab_size``).
        seq_len: T, tokens per sequence (training window).
        training: True: ``total = 3 x forward`` (forward + backward); False: ``total = forward``.
        chunk_size: chunk C of the GLA / GDN / SSD chunked algorithms; None = ``cfg.chunk_size``. The fla kernels
            (GLA, GDN) always use C = 64 whatever the config says; mamba_ssm uses ``cfg.chunk_size``.
        convention: ``"dense"`` (default; full T x T and C x C blocks, the PaLM / torchtitan convention),
            ``"causal"`` (lower triangles only) or ``"reference"`` (exactly the products of the repository's
            reference ops, as FlopCounterMode counts them). See the module docstring.

    Returns:
        ``{component: FLOPs per token}`` with the forward FLOPs of every component summed over all layers --
        ``embedding`` (0: a lookup), ``lm_head`` (2·d·V), ``mixer_proj`` (the mixers' Linear layers),
        ``attention`` (Llama scores + values, 4·H·d_head·T dense), ``scan_intra`` / ``scan_state`` /
        ``scan_solve`` (the chunked GLA / GDN / SSD terms), ``canon`` (Canon-A/B/C/D), ``short_conv`` (the
        mixers' own convs ``b``), ``mlp`` -- plus ``forward`` (their sum) and ``total`` (``3 x forward`` when
        ``training``, else ``forward``): the number to multiply by tokens/s for MFU.

    Raises:
        ValueError: ``seq_len`` or ``chunk_size`` not a positive int, or an unknown ``convention``.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"flops_per_token: convention={convention!r}; allowed: {' | '.join(CONVENTIONS)}")
    T = seq_len
    C = cfg.chunk_size if chunk_size is None else chunk_size
    for name, val in (("seq_len", T), ("chunk_size", C)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"flops_per_token: {name}={val!r}; allowed: a positive int")
    d, Kc, cv = cfg.d_model, cfg.canon.kernel, cfg.canon
    f = dict.fromkeys(COMPONENTS, 0.0)
    f["lm_head"] = 2.0 * d * cfg.vocab_size

    # ---- one block (per token; attention and scan terms per sequence / T)
    mixer = attn = intra = state = solve = canon = short = mlp = 0.0
    if cv.has("A"):
        canon += 2 * Kc * d
    if cfg.arch == "llama":
        H, Hkv, dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        qkv = (H + 2 * Hkv) * dh
        mixer = 2 * d * qkv + 2 * H * dh * d  # wqkv, wo
        keys = (T + 1) / 2 if convention == "causal" else T  # keys per query, averaged over positions
        attn = 4 * H * dh * keys  # q kᵀ and (softmax) v, per query head
        if cv.has("B"):
            canon += 2 * Kc * qkv
    elif cfg.arch in ("gla", "gdn"):
        H, Kd, Vd, dk, dv = cfg.n_heads, cfg.key_dim, cfg.value_dim, cfg.head_k_dim, cfg.head_v_dim
        mixer = 2 * d * (2 * Kd + Vd) + 2 * Vd * d  # q, k, v, o_proj
        r = cfg.output_gate_rank
        mixer += 2 * d * Vd if r == 0 else 2 * (d * r + r * Vd)  # g_proj (full or low rank)
        if cfg.arch == "gla":
            rg = cfg.gate_low_rank_dim
            mixer += 2 * (d * rg + rg * Kd)  # gk_proj (low-rank forget gate)
            intra, state = _gla_scan(T, C, H, dk, dv, convention)
        else:
            mixer += 2 * 2 * d * H  # a_proj, b_proj
            intra, state, solve = _gdn_scan(T, C, H, dk, dv, convention)
        if cv.has("B"):
            canon += 2 * Kc * (2 * Kd + Vd)
        if cv.has("b"):
            short = 2 * cfg.conv_kernel * (2 * Kd + Vd)  # conv_q, conv_k, conv_v
    else:  # mamba2
        H, G, N = cfg.n_heads, cfg.n_groups, cfg.ssm_state
        di = cfg.mamba_expand * d
        proj = 2 * di + 2 * G * N + H
        mixer = 2 * d * proj + 2 * di * d  # in_proj, out_proj
        intra, state = _ssd_scan(T, C, H, di // H, N, G, convention)
        if cv.has("B"):
            canon += 2 * Kc * proj
        if cv.has("b"):
            short = 2 * cfg.conv_kernel * (di + 2 * G * N)  # conv1d over xBC
    if cfg.has_mlp:
        F_ = cfg.ffn_dim
        up = 2 * F_ if cfg.mlp == "gated" else F_
        mlp = 2 * d * up + 2 * F_ * d  # w13 (or w1), w2
        if cv.has("C"):
            canon += 2 * Kc * d
        if cv.has("D"):
            canon += 2 * Kc * up

    L = cfg.n_layers
    f["mixer_proj"] = float(L * mixer)
    f["attention"] = float(L * attn)
    f["scan_intra"] = L * intra / T
    f["scan_state"] = L * state / T
    f["scan_solve"] = L * solve / T
    f["canon"] = float(L * canon)
    f["short_conv"] = float(L * short)
    f["mlp"] = float(L * mlp)
    f["forward"] = math.fsum(f[k] for k in COMPONENTS)
    f["total"] = 3 * f["forward"] if training else f["forward"]
    return f
