"""Models: LlamaCanon (Llama + Canon layers A/B/C/D), its config, Canon module and LM loss (spec models.md §1-2).

Imports only ``canonlm.ops`` (never ``canonlm.train`` / ``canonlm.data``, nor lightning): cheap to import.

    from canonlm.arch import LlamaCanon, build_model_config, lm_loss
    cfg = build_model_config({"size": "4L128D"}, canon={"set": "ABCD"}, pos={"type": "rope"}, vocab_size=64)
    model = LlamaCanon(cfg)
    logits = model(input_ids)                       # (B, T, V)
    out = lm_loss(logits, targets, mask)             # {"loss_sum", "nll_sum", "n_tokens"}
"""

from canonlm.arch.canon import Canon
from canonlm.arch.config import (SIZES, CanonConfig, ConfigError, ModelConfig, PosConfig, build_model_config,
                                 parse_size, validate)
from canonlm.arch.loss import lm_loss
from canonlm.arch.model import Attention, Block, LlamaCanon, resolve_backends
from canonlm.arch.modules import MLP, RMSNorm
from canonlm.arch.positional import apply_rope, interleaved_to_half_permutation, rope_angles

__all__ = [
    "SIZES", "CanonConfig", "ConfigError", "ModelConfig", "PosConfig", "build_model_config", "parse_size", "validate",
    "Canon", "RMSNorm", "MLP", "Attention", "Block", "LlamaCanon", "resolve_backends", "lm_loss",
    "apply_rope", "rope_angles", "interleaved_to_half_permutation",
]
