"""``CanonLMConfig``: the transformers config of a canonlm export (``model_type: "canonlm"``).

Written into every export that is not a plain transformers ``LlamaForCausalLM`` by ``python -m canonlm.export``
(:mod:`canonlm.hf.remote.bundle`); ``config.json``'s ``auto_map`` names it. It imports transformers only. The whole
canonlm model config is kept under ``canonlm`` (the dict of ``dataclasses.asdict(canonlm.arch.config.ModelConfig)``),
so the model is rebuilt exactly; the usual transformers fields (``vocab_size``, ``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``max_position_embeddings``, ``tie_word_embeddings``) are derived from
it for the tools that read them (generation, peft, lm-evaluation-harness). Token ids (``bos_token_id``,
``eos_token_id``, ``pad_token_id``) are the export's (the task's).
"""

from __future__ import annotations

from transformers import PretrainedConfig


class CanonLMConfig(PretrainedConfig):
    """transformers config of a canonlm model.

    Args:
        canonlm: ``dataclasses.asdict`` of canonlm's ``ModelConfig`` (arch, sizes, Canon, positions, ...). Its
            ``vocab_size``, ``d_model``, ``n_layers``, ``n_heads``, ``max_seq_len`` and ``tie_embeddings`` win over
            the transformers fields of the same meaning.
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
        if "tie_embeddings" in c:  # canonlm ties lm_head to the embedding itself; transformers is told so
            kwargs["tie_word_embeddings"] = bool(c["tie_embeddings"])
        super().__init__(**kwargs)
