"""Mamba2 token mixer with Canon-B / its conv1d ``b`` (Dao & Gu 2024; HF transformers Mamba2Mixer).

    zxbcdt = in_proj x                          (B, T, 2·d_inner + 2·G·N + H) = [z ; xBC ; dt]
    [Canon-B on all of zxbcdt]
    xBC = silu(conv1d(xBC))  [b]  |  xBC unchanged (no b: the official ``noconv1d``, identity kernel, no SiLU)
    x, B, C = split(xBC, [d_inner, G·N, G·N])
    y = SSD(x, dt, A = -exp(A_log), B, C, D, dt_bias, softplus)   H_t = exp(Δ_t A) H_{t-1} + Δ_t x_t B_tᵀ, y_t = H_t C_t + D x_t
    out = out_proj( RMSNorm(y · silu(z)) )       (norm after the gate, per group of d_inner / G)

On CUDA with the ``mamba_ssm`` SSD backend and no decode cache, conv + scan + gated norm + out-proj run in one call of
``mamba_split_conv1d_scan_combined`` (noconv1d: identity kernel [0,0,0,1], activation None), unless ``out_proj`` is
not a plain ``nn.Linear`` (e.g. a peft LoRA layer): the kernel reads the weight, which would bypass the wrapper.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from canonlm.arch.canon import Canon
from canonlm.arch.config import ModelConfig
from canonlm.arch.mixers._shortconv import short_conv
from canonlm.arch.mixers.gdn import init_dt_bias_
from canonlm.arch.modules import GatedRMSNorm, at_least_fp32
from canonlm.ops import ssd as ssd_ops

A_INIT_RANGE = (1.0, 16.0)  # A_log = log U(1, 16) (official `modeling_mamba2_canon.py`)


class Mamba2Mixer(nn.Module):
    """Mamba2 mixer (HF ``Mamba2Mixer`` semantics, official ``noconv1d`` switch).

    Sizes: ``d_inner = mamba_expand · d``, H heads of ``P = d_inner / H``, G groups, state N (``ssm_state``),
    ``conv_dim = d_inner + 2·G·N``.
    Parameters: ``in_proj (d -> 2·d_inner + 2GN + H)`` no bias; ``conv1d`` (``b``: weight (conv_dim, K), bias, SiLU,
    non-residual); ``dt_bias, A_log, D (H,)``; ``norm`` GatedRMSNorm(d_inner, group d_inner/G, gate first);
    ``out_proj (d_inner -> d)`` no bias; Canon-B over the whole in_proj output (``B``).

    Forward: ``x (B, T, d)``, cos/sin ignored, ``cache`` layer dict or None -> ``(B, T, d)``; the cache holds the
    SSM ``state (B, H, P, N)`` (fp32) and the conv states. ``docs`` (:class:`~canonlm.arch.doc_mask.DocMask`, not
    with a cache): document masking -- Canon-B and conv1d restart per document, the SSD state restarts at every
    document (``ssd_scan(seq_idx=...)``), and the fused conv + scan kernel is not used.
    """

    def __init__(self, cfg: ModelConfig, backends: dict[str, str]):
        super().__init__()
        d, H, G, N = cfg.d_model, cfg.n_heads, cfg.n_groups, cfg.ssm_state
        self.d_inner = cfg.mamba_expand * d
        self.n_heads, self.head_dim, self.n_groups, self.ssm_state = H, self.d_inner // H, G, N
        self.conv_dim = self.d_inner + 2 * G * N
        self.chunk_size, self.backend, self.norm_eps = cfg.chunk_size, backends["ssd"], cfg.norm_eps
        proj = 2 * self.d_inner + 2 * G * N + H
        self.in_proj = nn.Linear(d, proj, bias=False)
        self.canon_b = Canon(proj, cfg.canon, backends["canon"], cache_key="canon_b") if cfg.canon.has("B") else None
        self.conv1d = (
            short_conv(self.conv_dim, cfg.conv_kernel, backends["canon"], "conv_xbc", bias=True)
            if cfg.canon.has("b")
            else None
        )
        self.conv_kernel = cfg.conv_kernel
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.norm = GatedRMSNorm(self.d_inner, cfg.norm_eps, norm_before_gate=False, group_size=self.d_inner // G)
        self.out_proj = nn.Linear(self.d_inner, d, bias=False)
        self.init_special_()

    @torch.no_grad()
    def init_special_(self) -> None:
        """``A_log = log U(1, 16)``, ``D = 1``, ``dt_bias`` per :func:`~canonlm.arch.mixers.gdn.init_dt_bias_`."""
        if self.A_log.device.type == "meta":
            return
        self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(*A_INIT_RANGE).log())
        self.D.fill_(1.0)
        init_dt_bias_(self.dt_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: dict | None = None,
        docs=None,
    ) -> torch.Tensor:
        if docs is not None and cache is not None:
            raise ValueError("Mamba2Mixer: document masking is not supported with a decode cache")
        B, T, _ = x.shape
        H, P, G, N, di = self.n_heads, self.head_dim, self.n_groups, self.ssm_state, self.d_inner
        zxbcdt = self.in_proj(x)
        if self.canon_b is not None:
            zxbcdt = self.canon_b(zxbcdt, cache, docs)
        A = -torch.exp(at_least_fp32(self.A_log))
        # zxbcdt's dtype is the compute dtype (in_proj's output: bf16 under bf16 autocast); layout dims positional.
        # The fused kernel reads out_proj's weight itself: only for a plain nn.Linear (a peft LoRA layer or another
        # wrapper around out_proj is called on the unfused path, so what it adds is not bypassed).
        if (
            cache is None
            and docs is None
            and type(self.out_proj) is nn.Linear
            and ssd_ops.use_fused_split(
                self.backend, str(x.device), zxbcdt.dtype, self.conv_kernel, self.d_inner, self.conv_dim, self.n_heads
            )
        ):
            if self.conv1d is not None:
                w, b, act = self.conv1d.weight, self.conv1d.bias, "silu"
            else:  # noconv1d: identity kernel, no bias, no activation (paper Result 7.1)
                w = torch.zeros(self.conv_dim, self.conv_kernel, device=x.device, dtype=self.in_proj.weight.dtype)
                w[:, -1] = 1.0
                b, act = None, None
            return ssd_ops.split_conv1d_scan_combined(
                zxbcdt,
                w,
                b,
                self.dt_bias,
                A,
                self.D,
                chunk_size=self.chunk_size,
                activation=act,
                rmsnorm_weight=self.norm.weight,
                rmsnorm_eps=self.norm_eps,
                outproj_weight=self.out_proj.weight,
                headdim=P,
                ngroups=G,
                norm_before_gate=False,
            )
        z, xbc, dt = zxbcdt.split([di, self.conv_dim, H], dim=-1)
        if self.conv1d is not None:
            xbc = self.conv1d(xbc, cache, docs)
        xs, Bm, Cm = xbc.split([di, G * N, G * N], dim=-1)
        state = None if cache is None else cache.get("state")
        y, state = ssd_ops.ssd_scan(
            xs.reshape(B, T, H, P),
            dt,
            A,
            Bm.reshape(B, T, G, N),
            Cm.reshape(B, T, G, N),
            chunk_size=self.chunk_size,
            D=self.D,
            dt_bias=self.dt_bias,
            dt_softplus=True,
            initial_state=state,
            output_final_state=cache is not None,
            backend=self.backend,
            seq_idx=None if docs is None else docs.seq_idx,
        )  # a cache is refused with docs
        if cache is not None:
            cache["state"] = state
        return self.out_proj(self.norm(y.reshape(B, T, di), z))
