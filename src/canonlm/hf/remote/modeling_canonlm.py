"""``CanonLMForCausalLM``: canonlm's ``CanonLM`` behind the transformers ``PreTrainedModel`` interface.

Written into every export that is not a plain transformers ``LlamaForCausalLM`` by ``python -m canonlm.export``;
``config.json``'s ``auto_map`` names it, so ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``
loads the export. The export does not need canonlm installed: :mod:`canonlm.hf.remote.bundle` writes this file and
every canonlm module it needs (the model, its Canon / mixer modules and the sequence ops: pure-PyTorch paths, plus the
fla / mamba-ssm / causal-conv1d / flash-attn kernels, imported only when installed and usable) beside it as flat files
with relative imports, so the network is canonlm's own code at export time and its logits are canonlm's. Inside
canonlm (``canonlm.eval.harness``) the same class runs on the installed package. Weights: ``model.safetensors`` with
the keys ``model.<CanonLM.state_dict() key>``.

The interface follows transformers' ``LlamaForCausalLM`` (4.51 and 5.x):

* ``forward(input_ids=None, attention_mask=None, labels=None, inputs_embeds=None, output_hidden_states=None,
  return_dict=None, **kwargs)`` -> ``CausalLMOutputWithPast``: ``logits`` (B, T, V); with ``labels`` the mean
  next-token cross-entropy (labels shifted inside, ``-100`` ignored; with ``num_items_in_batch``, as transformers'
  ``Trainer`` passes under gradient accumulation, the sum over that count); ``hidden_states`` a tuple of
  ``n_layers + 1`` tensors (B, T, d) -- the embedding output, the input of every later block, and last the output of
  the final norm -- when asked. ``inputs_embeds`` (B, T, d) replaces ``input_ids`` (exactly one of the two).
* ``gradient_checkpointing_enable()`` recomputes every block in the backward (transformers' checkpoint function,
  training mode only); ``resize_token_embeddings`` through :meth:`set_input_embeddings` /
  :meth:`set_output_embeddings`, which keep canonlm's config (``config.canonlm["vocab_size"]``) in step; tied
  embeddings are declared to transformers (``tie_word_embeddings``, ``_tied_weights_keys``).
* Padding: canonlm models use absolute positions from the first token, so a left-padded row (what ``generate`` and
  lm-evaluation-harness use for batched generation) runs on its real tokens alone (pad positions get zero logits);
  right padding needs nothing; a mask with a gap is refused.
* ``generate`` works through ``GenerationMixin`` without a KV cache (every step re-runs the prefix; ``python -m
  canonlm.generate`` decodes with canonlm's cache); a Llama refuses, before generating, a prompt that with the new
  tokens would pass its context (``max_seq_len`` positions).
* LoRA (peft): every projection is an ``nn.Linear`` called as a module, so adapters on it act and train; the names
  per architecture are in the export's model card (Llama: ``wqkv``, ``wo``, ``w13``, ``w2``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
import transformers
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from canonlm.arch.config import build_model_config
from canonlm.arch.model import CanonLM
from canonlm.arch.positional import rope_angles

from .configuration_canonlm import CanonLMConfig

_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
# transformers 5 reads a {target: source} map, 4.x a list of the tied (dropped when saved) parameters
_TIED = {"model.lm_head.weight": "model.tok_emb.weight"}


def model_config(canonlm: dict):
    """canonlm's ``ModelConfig`` from the ``canonlm`` dict of the config (``dataclasses.asdict`` of it)."""
    d = dict(canonlm)
    canon, pos = d.pop("canon", None), d.pop("pos", None)
    return build_model_config(d, canon, pos)


class CanonLMForCausalLM(PreTrainedModel, GenerationMixin):
    """A canonlm model (any arch) as a transformers causal LM (module docstring). ``self.model`` is the
    ``CanonLM``."""

    config_class = CanonLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_cache_class = False
    supports_gradient_checkpointing = True
    _tied_weights_keys = dict(_TIED) if _TRANSFORMERS_5 else list(_TIED)
    # save_pretrained copies the modeling files (this one and the bundle it imports) of a class registered for an auto
    # class; AutoModelForCausalLM registers a remote-code class in transformers 5, not in 4.x: the export's copy
    # registers itself (canonlm's own module, used in process by canonlm.eval.harness, does not)
    _auto_class = None if __module__.startswith("canonlm.") else "AutoModelForCausalLM"

    def __init__(self, config: CanonLMConfig):
        super().__init__(config)
        self.model = CanonLM(model_config(config.canonlm))
        self.gradient_checkpointing = False  # set by transformers' gradient_checkpointing_enable()
        self._rope_device: torch.device | None = None  # the RoPE tables are (re)built where the model first runs
        self._cpu_canon = False  # whether place_on pinned Canon to its torch path (on the CPU)
        self.post_init()

    def _init_weights(self, module):  # the weights come from the export; CanonLM initialised itself
        pass

    # ------------------------------------------------------------------------------------------ embeddings
    def get_input_embeddings(self):
        return self.model.tok_emb

    def set_input_embeddings(self, value: torch.nn.Embedding) -> None:
        """Replace the token embedding (``resize_token_embeddings``); the vocabulary size follows it in this
        config, in ``config.canonlm`` and in the model's own config (its id check)."""
        self.model.tok_emb = value
        n = int(value.num_embeddings)
        self.model.cfg = dataclasses.replace(self.model.cfg, vocab_size=n)
        self.config.canonlm = dict(self.config.canonlm, vocab_size=n)
        self.config.vocab_size = n

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value: torch.nn.Linear) -> None:
        self.model.lm_head = value

    # ------------------------------------------------------------------------------------------ forward
    def place_on(self, device: torch.device) -> None:
        """Resolve canonlm's kernels for ``device`` and the parameters' dtype (after ``.to(...)``), and build the RoPE
        tables there; :meth:`forward` calls it on its input's device. Call it before using ``self.model`` (the
        ``CanonLM``) directly, e.g. with its decode cache.

        On the CPU an ``auto`` Canon request runs canonlm's pure-PyTorch ``torch`` path, also where canonlm is
        installed (``canonlm.eval.harness``): an export carries no native CPU kernel
        (:mod:`canonlm.hf.remote.native_stub`), so both compute the same numbers. Elsewhere ``auto`` stays ``auto``
        (CUDA: Dao's / fla's kernels when installed)."""
        device = torch.device(device)
        cfg = self.model.cfg
        kernels = dict(cfg.kernels)
        if self._cpu_canon and kernels.get("canon") == "torch":
            del kernels["canon"]  # this method's own pin, from an earlier CPU placement
        pin = device.type == "cpu" and "canon" not in kernels and cfg.ops == "auto"
        if pin:
            kernels["canon"] = "torch"
        changed = kernels != cfg.kernels
        if changed:
            self.model.cfg = dataclasses.replace(cfg, kernels=kernels)
        self._cpu_canon = pin
        want = (device, next(self.model.parameters()).dtype)
        if changed or self.model.placement is None or (self.model.placement[0], self.model.placement[1]) != want:
            self.model.place(*want)
        if self.model.rope_cos is not None and self._rope_device != device:
            # non-persistent buffers: not in the weights file, and built on the meta device by from_pretrained
            cfg = self.model.cfg
            cos, sin = rope_angles(cfg.rope_dim, cfg.max_seq_len, cfg.pos.theta, device=device)
            self.model.rope_cos, self.model.rope_sin = cos, sin
            self._rope_device = device

    def _run(self, input_ids, inputs_embeds, checkpoint_fn, want_hidden: bool):
        hidden = [] if want_hidden else None
        logits = self.model(input_ids, inputs_embeds=inputs_embeds, hidden_states=hidden, checkpoint_fn=checkpoint_fn)
        return logits, hidden

    def _forward_rows(self, input_ids, inputs_embeds, attention_mask, checkpoint_fn, want_hidden: bool):
        """Logits (B, T, V) and hidden states. Rows with left padding (``attention_mask`` 0...0 1...1, as
        transformers' ``generate`` and lm-evaluation-harness pad for generation) run on their tokens alone, so their
        first real token sits at position 0 as in training; pad positions get zeros. Right padding needs nothing
        (causal)."""
        self._check_no_holes(attention_mask)
        if attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask[:, 0].all()):
            logits, hidden = self._run(input_ids, inputs_embeds, checkpoint_fn, want_hidden)
            return logits, None if hidden is None else tuple(hidden)
        lead = input_ids if input_ids is not None else inputs_embeds
        T = lead.shape[1]
        starts = (attention_mask.to(torch.int64).cumsum(1) == 0).sum(1).tolist()  # leading pads per row
        rows, hrows = [], []
        for r, s in enumerate(starts):
            s = min(int(s), T - 1)  # a row of pads only: its last position runs alone (its logits are not read)
            logits, hidden = self._run(
                None if input_ids is None else input_ids[r : r + 1, s:],
                None if inputs_embeds is None else inputs_embeds[r : r + 1, s:],
                checkpoint_fn,
                want_hidden,
            )
            rows.append(F.pad(logits, (0, 0, s, 0)))
            if hidden is not None:
                hrows.append([F.pad(h, (0, 0, s, 0)) for h in hidden])
        hidden = tuple(torch.cat([h[i] for h in hrows], dim=0) for i in range(len(hrows[0]))) if hrows else None
        return torch.cat(rows, dim=0), hidden

    @staticmethod
    def _check_no_holes(attention_mask: torch.Tensor | None) -> None:
        if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[1] < 2:
            return
        m = attention_mask.to(torch.int64)
        first = (m.cumsum(1) == 0).sum(1, keepdim=True)  # leading pads
        pos = torch.arange(m.shape[1], device=m.device).unsqueeze(0)
        body = pos >= first
        # after the leading pads: ones, then possibly right padding (zeros); never a 1 after a 0
        after = torch.where(body, m, torch.ones_like(m))
        if bool((after[:, 1:] > after[:, :-1]).any()):
            raise ValueError(
                "attention_mask has a gap (a 0 between 1s after the padding): canonlm models read a "
                "contiguous sequence per row; pad on the left or the right only"
            )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        num_items_in_batch=None,
        **kwargs,
    ):
        """Module docstring. ``kwargs`` that transformers' ``generate`` passes (``use_cache``, ``cache_position``,
        ...) are ignored: there is no KV cache. Raises ValueError: neither or both of ``input_ids`` /
        ``inputs_embeds``, ids outside the vocabulary, a mask with a gap, ``output_attentions=True`` (the mixers
        compute no attention matrix), positions past a Llama's context."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if output_attentions:
            raise ValueError(
                "output_attentions=True: canonlm models do not return attention weights (SDPA / flash "
                "attention and the linear mixers compute no attention matrix)"
            )
        lead = input_ids if input_ids is not None else inputs_embeds
        self.place_on(lead.device)
        if input_ids is not None:
            V = self.model.cfg.vocab_size
            if input_ids.numel() and (int(input_ids.max()) >= V or int(input_ids.min()) < 0):
                # a tokenizer whose ids reach past the embedding (Capo's: BPE tokens no biography holds get ids >= V)
                raise ValueError(
                    f"input_ids hold id {int(input_ids.max())} (or a negative one); the model's "
                    f"vocabulary has ids 0..{V - 1}: the text holds tokens the model was never trained "
                    "on"
                )
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        ckpt = None
        if self.gradient_checkpointing and self.training:
            ckpt = getattr(self, "_gradient_checkpointing_func", None) or functools.partial(
                checkpoint, use_reentrant=False
            )
        logits, hidden = self._forward_rows(input_ids, inputs_embeds, attention_mask, ckpt, output_hidden_states)
        loss = None
        if labels is not None:
            lg = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
            lab = labels[:, 1:].reshape(-1).to(lg.device)
            if num_items_in_batch is None:
                loss = F.cross_entropy(lg, lab, ignore_index=-100)
            else:  # transformers' ForCausalLMLoss under gradient accumulation: sum / items in the whole batch
                n = num_items_in_batch.to(lg.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
                loss = F.cross_entropy(lg, lab, ignore_index=-100, reduction="sum") / n
        if return_dict is False:
            out = tuple(t for t in (loss, logits, hidden) if t is not None)
            return out
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden)

    # ------------------------------------------------------------------------------------------ generation
    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, attention_mask=None, inputs_embeds=None, **kwargs
    ):
        """The whole sequence at every step (no KV cache). With ``inputs_embeds`` (``generate(inputs_embeds=...)``)
        transformers' ``input_ids`` hold the new tokens only: their embeddings follow the prompt's."""
        if inputs_embeds is None:
            return {"input_ids": input_ids, "attention_mask": attention_mask}
        if input_ids is not None and input_ids.shape[1]:
            new = self.get_input_embeddings()(input_ids).to(inputs_embeds.dtype)
            inputs_embeds = torch.cat([inputs_embeds, new], dim=1)
        return {"inputs_embeds": inputs_embeds, "attention_mask": attention_mask}

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """transformers' ``generate``, after one check: a model with a positional limit (Llama: ``max_seq_len``
        positions, its RoPE table) refuses with one ValueError, before any step, a request whose longest row (real
        tokens of the prompt, as left-padded rows run from position 0) plus ``max_new_tokens`` -- or ``max_length``
        when no ``max_new_tokens`` is given -- would pass that limit."""
        limit = self.model.max_positions
        if limit is not None:
            ids = inputs if inputs is not None else kwargs.get("input_ids")
            emb = kwargs.get("inputs_embeds")
            prompt = 0
            if ids is not None and ids.dim() == 2:
                mask = kwargs.get("attention_mask")
                prompt = (
                    int(mask.sum(1).max())
                    if mask is not None and mask.dim() == 2 and mask.numel()
                    else int(ids.shape[1])
                )
            elif emb is not None and emb.dim() == 3:
                prompt = int(emb.shape[1])
            gc = generation_config if generation_config is not None else self.generation_config
            new = kwargs.get("max_new_tokens", getattr(gc, "max_new_tokens", None))
            if new is not None:
                total, asked = prompt + int(new), f"the prompt ({prompt} tokens) plus max_new_tokens={int(new)}"
            else:
                length = kwargs.get("max_length", getattr(gc, "max_length", None)) or prompt
                total, asked = max(int(length), prompt), f"max_length={int(length)} (prompt {prompt} tokens)"
            if total > limit:
                raise ValueError(
                    f"generate: {asked} reach {total} positions, past the model's context of {limit} "
                    f"(model.max_seq_len; a Llama has no positions beyond it): ask for at most "
                    f"{max(limit - prompt, 0)} new tokens or shorten the prompt"
                )
        return super().generate(inputs, generation_config, **kwargs)
