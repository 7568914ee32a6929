"""The short convolutions that GLA / GDN / Mamba2 carry inside their mixer ("Canon-b", models.md §1.3)."""

from __future__ import annotations

from canonlm.arch.canon import Canon
from canonlm.arch.config import CanonConfig


def short_conv(channels: int, kernel: int, backend: str, cache_key: str, bias: bool = False) -> Canon:
    """A mixer's own depthwise causal conv as the original authors configured it: non-residual, SiLU, kernel
    ``kernel`` (4), PyTorch default init (the model-level init may redraw it: GLA / GDN normal(0, 0.02); Mamba2
    keeps the default with a zero bias). ``bias``: Mamba2's conv1d has one, GLA / GDN's do not. Returns a
    :class:`~canonlm.arch.canon.Canon` with ``native=True`` (same op and decode cache as Canon)."""
    cfg = CanonConfig(set="b", kernel=kernel, residual=False, activation=True, bias=bias, trainable=True,
                      init="default")
    return Canon(channels, cfg, backend, cache_key=cache_key, native=True)
