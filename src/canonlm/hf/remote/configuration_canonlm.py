"""``CanonLMConfig``: the transformers config of a canonlm export (``model_type: "canonlm"``).

Copied into every export that is not a plain transformers ``LlamaForCausalLM`` by ``python -m canonlm.export``;
``config.json``'s ``auto_map`` names it. The whole canonlm model config is kept under ``canonlm`` (the dict of
``dataclasses.asdict(canonlm.arch.config.ModelConfig)``), so the model is rebuilt exactly; the usual transformers
fields (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``max_position_embeddings``, token ids) are derived
from it for the tools that read them (generation, lm-evaluation-harness).
"""

from __future__ import annotations

from transformers import PretrainedConfig


class CanonLMConfig(PretrainedConfig):
    """transformers config of a canonlm model.

    Args:
        canonlm: ``dataclasses.asdict`` of canonlm's ``ModelConfig`` (arch, sizes, Canon, positions, ...).
        **kwargs: ``PretrainedConfig`` fields (``bos_token_id``, ``eos_token_id``, ``pad_token_id``, ...).
    """

    model_type = "canonlm"

    def __init__(self, canonlm: dict | None = None, **kwargs):
        self.canonlm = dict(canonlm or {})
        c = self.canonlm
        self.vocab_size = c.get("vocab_size", kwargs.pop("vocab_size", None))
        self.hidden_size = c.get("d_model", kwargs.pop("hidden_size", None))
        self.num_hidden_layers = c.get("n_layers", kwargs.pop("num_hidden_layers", None))
        self.num_attention_heads = c.get("n_heads", kwargs.pop("num_attention_heads", None))
        self.max_position_embeddings = c.get("max_seq_len", kwargs.pop("max_position_embeddings", None))
        kwargs["tie_word_embeddings"] = False  # canonlm ties lm_head to the embedding inside the model itself
        super().__init__(**kwargs)
