"""The Canon layer as an ``nn.Module`` (paper §4, eq. 4.1; official `huggingface/canon_helper.py`).

``Canon(h)_t = h_t + sum_{i=0}^{K-1} w[:, i] * h_{t-K+1+i}`` (``h_{<0} = 0``): a residual, causal, depthwise 1-D
convolution over time. The math runs in :func:`canonlm.ops.canon.causal_conv1d` (reference or fast backends);
this module owns the parameters, their initialisation and the backend choice.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from canonlm.arch.config import CanonConfig, ConfigError
from canonlm.ops import canon as canon_ops

# Per-lag weights of the "fixed" ablation (paper footnote 10): lag 0 (current token), 1, 2, 3.
FIXED_LAG_WEIGHTS = (1.0, 0.4, 0.2, 0.1)


class Canon(nn.Module):
    """Residual causal depthwise conv over ``channels`` features (one Canon-A/B/C/D site).

    Args:
        channels: C, the width of the hidden vectors it mixes (paper §4: d, (H+2H_kv)·d_head, 2·d_ff).
        cfg: :class:`~canonlm.arch.config.CanonConfig` (kernel K, residual, activation, bias, trainable, init).
        backend: backend name passed to ``canonlm.ops.canon.causal_conv1d`` / ``causal_conv1d_step`` (``"auto"``,
            ``"reference"`` or a name returned by ``canonlm.ops.canon.resolve_backend``); ``CanonLM.place`` sets it
            per layer, resolved for this layer's C and K (so a layer Dao's kernel cannot take gets fla or is refused).

    Parameters:
        weight: ``nn.Parameter`` of shape **(C, K)** (the kernels' layout; ``nn.Conv1d`` stores (C, 1, K)).
            ``weight[:, K-1]`` multiplies the current token, ``weight[:, 0]`` the token K-1 steps back.
        bias: ``(C,)`` zero-initialised, only if ``cfg.bias``.
        With ``cfg.trainable=False`` (cst-Canon, paper Fig. 24) both have ``requires_grad=False``.

    Init (:meth:`reset_parameters`; never touched by the model-level init, paper §4):
        ``default``: ``kaiming_uniform_(a=sqrt(5))`` with fan_in = K, i.e. ``U(-1/sqrt(K), 1/sqrt(K))`` -- what
        ``nn.Conv1d(C, C, K, groups=C)`` does; ``identity``: ``[0, .., 0, 1]``; ``fixed``: the per-lag scalars
        ``(1, .4, .2, .1)`` for lags 0..3 (current token 1), same for every channel, lags >= 4 get 0.

    Forward: ``x (B, T, C)`` -> ``(B, T, C)`` of ``x.dtype`` (under autocast the backend decides the dtype).
    With ``cache`` (a layer dict of :class:`~canonlm.arch.cache.DecodeCache`), the conv continues from the
    inputs stored under ``cache_key`` (the last K raw inputs, ``(B, C, K)``) and stores the new ones, so chunked
    calls equal one call. ``docs`` (a :class:`canonlm.ops.varlen.Documents`, e.g. the model's
    :class:`~canonlm.arch.doc_mask.DocMask`) or None: document masking (the conv restarts at each document start, on
    this layer's backend; :func:`canonlm.ops.canon.causal_conv1d`), not with a cache.
    Raises ValueError (forward) when ``x.shape[-1] != C`` or ``docs`` comes with a cache.

    ``cache_key`` names the state in the cache (``canon_a`` ... ``canon_d``, or ``conv_q`` etc. for a mixer's own
    short conv). ``native=True`` marks a mixer's own conv (``b``: GLA / GDN short convs, Mamba2 conv1d;
    paper §4): the model-level init may then redraw it (GLA / GDN: normal(0, 0.02)), which it never does for Canon.
    """

    def __init__(
        self, channels: int, cfg: CanonConfig, backend: str = "auto", cache_key: str = "canon", native: bool = False
    ):
        super().__init__()
        if channels < 1:
            raise ConfigError("canon.channels", channels, "a positive integer")
        if cfg.init not in ("default", "identity", "fixed"):
            raise ConfigError("canon.init", cfg.init, "default | identity | fixed")
        self.channels, self.kernel = channels, cfg.kernel
        self.residual, self.activation, self.init_mode = cfg.residual, cfg.activation, cfg.init
        self.backend, self.cache_key, self.native = backend, cache_key, bool(native)
        self.weight = nn.Parameter(torch.empty(channels, cfg.kernel), requires_grad=cfg.trainable)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=cfg.trainable) if cfg.bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)draw the weights per ``cfg.init`` (class docstring); bias = 0. Works on meta, regular and DTensor
        parameters (after FSDP2 ``to_empty``)."""
        w = self.weight
        if self.init_mode == "default":
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # fan_in of a (C, K) tensor = K, as for (C, 1, K)
        else:
            K = self.kernel
            lags = [0.0] * K
            if self.init_mode == "identity":
                lags[K - 1] = 1.0
            else:  # fixed: lag j sits at tap K-1-j
                for j, val in enumerate(FIXED_LAG_WEIGHTS[:K]):
                    lags[K - 1 - j] = val
            _fill_rows(w, torch.tensor(lags, dtype=w.dtype))
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, x: torch.Tensor, cache: dict | None = None, docs=None) -> torch.Tensor:
        if x.shape[-1] != self.channels:
            raise ValueError(f"Canon: input has {x.shape[-1]} channels, expected {self.channels}")
        if cache is None:
            return canon_ops.causal_conv1d(
                x,
                self.weight,
                self.bias,
                residual=self.residual,
                activation=self.activation,
                backend=self.backend,
                docs=docs,
            )
        if docs is not None:
            raise ValueError("Canon: document masking (docs) is not supported with a decode cache")
        prev = cache.get(self.cache_key)  # (B, C, K) last raw inputs, or None (zero history)
        if prev is not None and x.shape[1] == 1:
            y, cache[self.cache_key] = canon_ops.causal_conv1d_step(
                x[:, 0],
                prev,
                self.weight,
                self.bias,
                residual=self.residual,
                activation=self.activation,
                backend=self.backend,
            )
            return y.unsqueeze(1)
        init = None if prev is None else prev[:, :, 1:].to(x.dtype)
        y = canon_ops.causal_conv1d(
            x,
            self.weight,
            self.bias,
            residual=self.residual,
            activation=self.activation,
            backend=self.backend,
            initial_state=init,
        )
        cache[self.cache_key] = canon_ops.causal_conv1d_state(x, self.kernel, init)
        return y

    def extra_repr(self) -> str:
        return (
            f"{'native, ' if self.native else ''}channels={self.channels}, kernel={self.kernel}, "
            f"residual={self.residual}, "
            f"activation={self.activation}, bias={self.bias is not None}, "
            f"trainable={self.weight.requires_grad}, init={self.init_mode}, backend={self.backend}"
        )


def _fill_rows(w: torch.Tensor, row: torch.Tensor) -> None:
    """``w[c, :] = row`` for every channel c; ``w`` may be a regular tensor, a meta tensor or a DTensor."""
    if w.device.type == "meta":
        return
    full = row.to(w.device).expand(w.shape)
    if hasattr(w, "device_mesh"):  # DTensor (FSDP2): shard the full pattern like w
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(full.contiguous(), w.device_mesh, w.placements)
    w.copy_(full)
