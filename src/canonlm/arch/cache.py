"""Decode caches: the state a model carries between forward calls when it generates token by token.

One typed structure for every architecture, with no layer limit: :class:`DecodeCache` holds one dict per block
(:attr:`DecodeCache.layers`), filled by the modules that need history, keyed by the module's ``cache_key``:

=====================  ==============================  ===================================================
key                    shape                           written by
=====================  ==============================  ===================================================
``k``, ``v``           (B, S, H_kv, d_head)            attention (KV cache; S = tokens seen)
``canon_a`` … ``_d``   (B, C, K)                       Canon-A/B/C/D: the last K raw inputs (column K-1 newest)
``conv_q/k/v``         (B, C, K)                       GLA / GDN short convs (``b``)
``conv_xbc``           (B, C, K)                       Mamba2 conv1d (``b``)
``state``              (B, H, d_k, d_v) / (B, H, P, N)  GLA / GDN recurrent state; Mamba2 SSM state (fp32)
=====================  ==============================  ===================================================

Every tensor has the batch on dim 0, so :meth:`DecodeCache.select` can drop finished rows. ``seen`` counts the tokens
already processed (RoPE offset of the next call). A forward with a cache accepts any number of new tokens (prefill,
chunked prefill, one-token decode) and continues exactly where the previous call stopped.
"""

from __future__ import annotations

import torch


class DecodeCache:
    """Per-layer decode state of one batch of sequences (module docstring).

    Args:
        n_layers: number of blocks of the model.
    Attributes:
        layers: list of ``n_layers`` dicts ``key -> Tensor`` (filled lazily by the first forward).
        seen: tokens processed so far (every row has the same count).
    """

    def __init__(self, n_layers: int):
        if int(n_layers) < 1:
            raise ValueError(f"DecodeCache: n_layers={n_layers!r}; allowed: an integer >= 1")
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in range(int(n_layers))]
        self.seen = 0

    @property
    def batch_size(self) -> int | None:
        """Rows held (None before the first forward)."""
        for layer in self.layers:
            for t in layer.values():
                return int(t.shape[0])
        return None

    def select(self, index: torch.Tensor) -> "DecodeCache":
        """Keep only the rows ``index`` (LongTensor (B',), any order), in place; returns self."""
        for layer in self.layers:
            for key, t in layer.items():
                layer[key] = t.index_select(0, index.to(t.device))
        return self

    def __repr__(self) -> str:
        keys = sorted({k for layer in self.layers for k in layer})
        return f"DecodeCache(n_layers={len(self.layers)}, seen={self.seen}, rows={self.batch_size}, keys={keys})"
