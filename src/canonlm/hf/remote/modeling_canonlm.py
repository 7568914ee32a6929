"""``CanonLMForCausalLM``: canonlm's ``CanonLM`` behind the transformers ``PreTrainedModel`` interface.

Copied into every export that is not a plain transformers ``LlamaForCausalLM`` by ``python -m canonlm.export``;
``config.json``'s ``auto_map`` names it, so ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``
loads the export. It needs canonlm installed (``pip install canonlm``): the network is canonlm's own code, so its
logits are canonlm's. Weights: ``model.safetensors`` with the keys ``model.<CanonLM.state_dict() key>``.

``forward(input_ids, attention_mask=None, labels=None)`` returns ``CausalLMOutputWithPast`` with ``logits`` ``(B, T,
V)`` and, with ``labels``, the mean next-token cross-entropy (labels shifted inside, ``-100`` ignored), as
transformers' causal LMs do. Padding: canonlm models are causal and use absolute positions from 0, so inputs must be
left-aligned (right padding, which lm-evaluation-harness uses); an ``attention_mask`` with a zero before a one in a
row is refused. ``generate`` works through ``GenerationMixin`` without a KV cache (every step re-runs the prefix;
``python -m canonlm.generate`` decodes with canonlm's cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_canonlm import CanonLMConfig


class CanonLMForCausalLM(PreTrainedModel, GenerationMixin):
    """A canonlm model (any arch) as a transformers causal LM. ``self.model`` is the ``canonlm.arch.model.CanonLM``."""

    config_class = CanonLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_cache_class = False

    def __init__(self, config: CanonLMConfig):
        super().__init__(config)
        from canonlm.arch.model import CanonLM
        from canonlm.hf.mapping import model_config_from_dict

        self.model = CanonLM(model_config_from_dict(config.canonlm))
        self._rope_device: torch.device | None = None  # the RoPE tables are (re)built where the model first runs
        self.post_init()

    def _init_weights(self, module):  # the weights come from the export; CanonLM initialised itself
        pass

    def get_input_embeddings(self):
        return self.model.tok_emb

    def get_output_embeddings(self):
        return self.model.lm_head

    def _placed(self, input_ids: torch.Tensor) -> None:
        """Resolve canonlm's kernels for where the model now is (after ``.to(...)``, the parameters' dtype)."""
        p = next(self.model.parameters())
        want = (input_ids.device, p.dtype)
        if self.model.placement is None or (self.model.placement[0], self.model.placement[1]) != want:
            self.model.place(*want)
        if self.model.rope_cos is not None and self._rope_device != input_ids.device:
            # non-persistent buffers: not in the weights file, and built on the meta device by from_pretrained
            from canonlm.arch.positional import rope_angles

            cfg = self.model.cfg
            cos, sin = rope_angles(cfg.rope_dim, cfg.max_seq_len, cfg.pos.theta, device=input_ids.device)
            self.model.rope_cos, self.model.rope_sin = cos, sin
            self._rope_device = input_ids.device

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] > 1:
            m = attention_mask.to(torch.int64)
            if bool((m[:, 1:] > m[:, :-1]).any()):
                raise ValueError("canonlm models use absolute positions from the first token: left padding (a 0 "
                                 "before a 1 in attention_mask) is not supported; pad on the right")
        self._placed(input_ids)
        logits = self.model(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}
