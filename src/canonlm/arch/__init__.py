"""Models: CanonLM (= LlamaCanon: Llama + Canon layers A/B/C/D; or GLA / GDN / Mamba2 with Canon-AbCD), its config,
the Canon module, token mixers, decode cache and LM loss (paper §4, App. C).

Imports only ``canonlm.ops`` (never ``canonlm.train`` / ``canonlm.data``, nor lightning): cheap to import.

    from canonlm.arch import LlamaCanon, build_model_config, lm_loss
    cfg = build_model_config({"size": "4L128D"}, canon={"set": "ABCD"}, pos={"type": "rope"}, vocab_size=64)
    model = CanonLM(cfg)                            # arch=llama | gla | gdn | mamba2 (build_model_config({"arch": ..}))
    logits = model(input_ids)                       # (B, T, V)
    cache = model.new_cache(); model(prompt, cache); model(next_token, cache)   # decode == full forward
    out = lm_loss(logits, targets, mask)             # {"loss_sum", "nll_sum", "n_tokens"}
    logits = model(input_ids, doc_ids=doc_ids)      # document masking (opt-in): see canonlm.arch.doc_mask
"""

from canonlm.arch.cache import DecodeCache
from canonlm.arch.canon import Canon
from canonlm.arch.config import (
    ARCHS,
    SIZES,
    CanonConfig,
    ConfigError,
    ModelConfig,
    PosConfig,
    build_model_config,
    parse_size,
    validate,
)
from canonlm.arch.doc_mask import doc_mask_problem
from canonlm.arch.loss import lm_loss
from canonlm.arch.mixers import GLA, Attention, GatedDeltaNet, Mamba2Mixer
from canonlm.arch.model import Block, CanonLM, LlamaCanon, resolve_backends
from canonlm.arch.modules import MLP, GatedRMSNorm, RMSNorm
from canonlm.arch.positional import apply_rope, interleaved_to_half_permutation, rope_angles

__all__ = [
    "ARCHS",
    "SIZES",
    "CanonConfig",
    "ConfigError",
    "ModelConfig",
    "PosConfig",
    "build_model_config",
    "parse_size",
    "validate",
    "Canon",
    "RMSNorm",
    "GatedRMSNorm",
    "MLP",
    "Attention",
    "GLA",
    "GatedDeltaNet",
    "Mamba2Mixer",
    "Block",
    "CanonLM",
    "LlamaCanon",
    "DecodeCache",
    "resolve_backends",
    "lm_loss",
    "apply_rope",
    "rope_angles",
    "interleaved_to_half_permutation",
    "doc_mask_problem",
]
