"""Token mixers, one module each, all with the forward signature ``mixer(x, cos, sin, cache) -> y`` (x, y: (B, T, d)):
softmax attention (Llama), GLA, Gated DeltaNet and Mamba2 (paper App. C). :func:`build_mixer` picks one by
``cfg.arch``."""

from __future__ import annotations

from canonlm.arch.config import ModelConfig
from canonlm.arch.mixers.attention import Attention
from canonlm.arch.mixers.gdn import GatedDeltaNet
from canonlm.arch.mixers.gla import GLA
from canonlm.arch.mixers.mamba2 import Mamba2Mixer

MIXERS = {"llama": Attention, "gla": GLA, "gdn": GatedDeltaNet, "mamba2": Mamba2Mixer}


def build_mixer(cfg: ModelConfig, backends: dict[str, str]):
    """The token mixer of ``cfg.arch`` (llama -> Attention, gla -> GLA, gdn -> GatedDeltaNet, mamba2 ->
    Mamba2Mixer), built with the per-op backend names ``backends``."""
    return MIXERS[cfg.arch](cfg, backends)


__all__ = ["Attention", "GLA", "GatedDeltaNet", "Mamba2Mixer", "MIXERS", "build_mixer"]
