"""``CanonLMForCausalLM``: canonlm's ``CanonLM`` behind the transformers ``PreTrainedModel`` interface.

Copied into every export that is not a plain transformers ``LlamaForCausalLM`` by ``python -m canonlm.export``;
``config.json``'s ``auto_map`` names it, so ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``
loads the export. It needs canonlm installed (``pip install canonlm``): the network is canonlm's own code, so its
logits are canonlm's. Weights: ``model.safetensors`` with the keys ``model.<CanonLM.state_dict() key>``.

``forward(input_ids, attention_mask=None, labels=None)`` returns ``CausalLMOutputWithPast`` with ``logits`` ``(B, T,
V)`` and, with ``labels``, the mean next-token cross-entropy (labels shifted inside, ``-100`` ignored), as
transformers' causal LMs do. Padding: canonlm models use absolute positions from the first token, so a left-padded
row (what ``generate`` and lm-evaluation-harness use for batched generation) runs on its real tokens alone; right
padding needs nothing; a mask with a gap is refused. ``generate`` works through ``GenerationMixin`` without a KV
cache (every step re-runs the prefix; ``python -m canonlm.generate`` decodes with canonlm's cache).
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

    def _logits(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Logits (B, T, V). Rows with left padding (``attention_mask`` 0...0 1...1, as transformers' ``generate``
        and lm-evaluation-harness pad for generation) run on their tokens alone, so their first real token sits at
        position 0 as in training; pad positions get zero logits. Right padding needs nothing (causal)."""
        if attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask[:, 0].all()):
            self._check_no_holes(attention_mask)
            return self.model(input_ids)
        self._check_no_holes(attention_mask)
        starts = (attention_mask.to(torch.int64).cumsum(1) == 0).sum(1).tolist()  # leading pads per row
        rows = []
        for r, s in enumerate(starts):
            lg = self.model(input_ids[r:r + 1, s:])
            rows.append(torch.nn.functional.pad(lg, (0, 0, s, 0)))
        return torch.cat(rows, dim=0)

    @staticmethod
    def _check_no_holes(attention_mask: torch.Tensor | None) -> None:
        if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[1] < 2:
            return
        m = attention_mask.to(torch.int64)
        first = (m.cumsum(1) == 0).sum(1, keepdim=True)                     # leading pads
        pos = torch.arange(m.shape[1], device=m.device).unsqueeze(0)
        body = (pos >= first)
        # after the leading pads: ones, then possibly right padding (zeros); never a 1 after a 0
        after = torch.where(body, m, torch.ones_like(m))
        if bool((after[:, 1:] > after[:, :-1]).any()):
            raise ValueError("attention_mask has a gap (a 0 between 1s after the padding): canonlm models read a "
                             "contiguous sequence per row; pad on the left or the right only")

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        self._placed(input_ids)
        V = self.model.cfg.vocab_size
        if input_ids.numel() and (int(input_ids.max()) >= V or int(input_ids.min()) < 0):
            # a tokenizer whose ids reach past the embedding (Capo's: BPE tokens no biography holds get ids >= V)
            raise ValueError(f"input_ids hold id {int(input_ids.max())} (or a negative one); the model's vocabulary "
                             f"has ids 0..{V - 1}: the text holds tokens the model was never trained on")
        logits = self._logits(input_ids, attention_mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}
