"""The model card (``README.md``) and ``generation_config.json`` of an export.

The card says what the model is (architecture, size, Canon, positions, parameters), how it was trained (the run's
command-line overrides from ``.hydra/overrides.yaml``, task and data), what it scored (the run's ``results.json``),
which tokenizer comes with it, how to load it in the export's format (the ``canonlm`` format needs torch and
transformers only: its modeling code is bundled), how it generates (token ids, context) and which module names LoRA
adapters (peft ``target_modules``) take.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from canonlm.arch.config import ModelConfig

LOAD = {
    "native": (
        "transformers' own `LlamaForCausalLM`; nothing else is needed (`pip install torch transformers`).",
        'from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained("{dir}")',
    ),
    "canonlm": (
        "canonlm's own modeling code, bundled in this folder (`modeling_canonlm.py`, "
        "`configuration_canonlm.py` and the `canonlm_*.py` files they import): it needs **torch and "
        "transformers only** (`pip install torch transformers`; transformers 4.51 or 5.x), not canonlm. "
        "On CUDA it uses the fast kernels of "
        "`fla-core` (GLA, GDN, Canon), `causal-conv1d` (Canon), `mamba-ssm` (Mamba2) and `flash-attn` when "
        "they are installed, and its pure-PyTorch paths otherwise.",
        "from transformers import AutoModelForCausalLM\n"
        'model = AutoModelForCausalLM.from_pretrained("{dir}", trust_remote_code=True)',
    ),
    "official": (
        "the official PhysicsLM4 `LlamaCanonForCausalLM` (lingua layout `default/params.json` + "
        "`default/consolidated.pth`). Copy the release's `configuration_llama_canon.py`, "
        "`modeling_llama_canon.py` and `canon_helper.py` into this folder (not shipped here).",
        'import sys; sys.path.insert(0, "{dir}")\nfrom transformers import AutoModelForCausalLM\n'
        'model = AutoModelForCausalLM.from_pretrained("{dir}", trust_remote_code=True)',
    ),
    "llamacanon": (
        "the official `LlamaCanonConfig` in `config.json`, weights in safetensors. Copy the release's "
        "three class files here; its `from_pretrained` reads the lingua layout, so build from the config:",
        'import sys; sys.path.insert(0, "{dir}")\nfrom safetensors.torch import load_file\n'
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        'cfg = AutoConfig.from_pretrained("{dir}", trust_remote_code=True)\n'
        "model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=True)\n"
        'model.load_state_dict(load_file("{dir}/model.safetensors"), strict=not cfg.tie_word_embeddings)',
    ),
}
NATIVE_LORA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def generation_config(ids: Mapping[str, int | None]) -> dict[str, Any]:
    """``generation_config.json``: greedy decoding and the token ids (None ids left out). No ``max_length``: a
    length there would make every ``generate(max_new_tokens=...)`` warn; the modeling code refuses a Llama prompt
    that would pass the context instead."""
    out: dict[str, Any] = {"do_sample": False}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if ids.get(key) is not None:
            out[key] = int(ids[key])
    return out


def lora_targets(cfg: ModelConfig) -> list[str]:
    """The ``nn.Linear`` modules of one block of ``CanonLM(cfg)`` under the names peft's ``target_modules`` matches
    (a name matches every module whose dotted path ends with it): the last part of the path, or the last two for the
    halves of a low-rank projection (``gk_proj.0``). The model is built on the meta device (no memory, no kernel)."""
    import torch

    from canonlm.arch.model import CanonLM

    with torch.device("meta"):
        block = CanonLM(cfg).blocks[0]
    out = []
    for name, mod in block.named_modules():
        if isinstance(mod, torch.nn.Linear):
            parts = name.split(".")
            out.append(".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1])
    return list(dict.fromkeys(out))


def _lora_section(cfg: ModelConfig, fmt: str) -> list[str]:
    if fmt == "native":
        names = NATIVE_LORA
        note = "transformers' Llama names."
    elif fmt == "canonlm":
        names = tuple(lora_targets(cfg))
        note = (
            "canonlm's names: "
            + (
                "`wqkv` is one Linear for q, k and v and `w13` one for the MLP's gate and up projections (so "
                "`q_proj` / `v_proj` / `gate_proj` do not exist here); "
                if cfg.arch == "llama"
                else ""
            )
            + "every one is called as a module, so an adapter on any of them acts in the forward and trains."
        )
    else:
        return []
    return [
        "## Fine-tuning (LoRA)",
        "",
        f"Linear layers of every block (peft `target_modules`): {', '.join(f'`{n}`' for n in names)} -- {note} "
        '`target_modules="all-linear"` takes all of them (not the LM head).',
        "",
        "```python",
        "from peft import LoraConfig, get_peft_model",
        f"model = get_peft_model(model, LoraConfig(r=8, target_modules={list(names)!r}))",
        "```",
        "",
    ]


def _generation_section(cfg: ModelConfig, ids: Mapping[str, int | None], fmt: str) -> list[str]:
    eos, pad, bos = ids.get("eos_token_id"), ids.get("pad_token_id"), ids.get("bos_token_id")
    if pad is None and eos is None and bos is None:
        text = (
            "`generation_config.json`: greedy. No token ids: the model records no task (pass `pad_token_id` "
            "to `generate`)."
        )
    else:
        text = (
            f"`generation_config.json`: greedy; pad id {pad}, "
            + (
                f"end id {eos} (generation stops there)"
                if eos is not None
                else "no end id: the task has no end token, so `generate` runs to `max_new_tokens`"
            )
            + (f", BOS id {bos}" if bos is not None else "")
            + "."
        )
    if cfg.arch == "llama" and fmt == "canonlm":
        text += (
            f" Context: {cfg.max_seq_len} positions; a prompt that with `max_new_tokens` would pass it is "
            "refused (`ValueError`) before generating."
        )
    elif cfg.arch == "llama":
        text += f" Trained context: {cfg.max_seq_len} positions."
    return ["## Generation", "", text, ""]


def _describe(cfg: ModelConfig) -> str:
    pos = cfg.pos.type + (
        f" (rope_dim {cfg.rope_dim}, {cfg.pos.pairing} pairing, theta {cfg.pos.theta:g})" if cfg.rope_dim else ""
    )
    if cfg.arch != "llama":
        pos = "none (a recurrent mixer)"
    canon = (
        f"Canon-{cfg.canon.set} (kernel {cfg.canon.kernel}, residual {cfg.canon.residual}, activation "
        f"{cfg.canon.activation})"
        if cfg.canon.set
        else "no Canon layers"
    )
    return (
        f"`{cfg.arch}` {cfg.n_layers}L{cfg.d_model}D, {cfg.n_heads} heads, vocabulary {cfg.vocab_size}, context "
        f"{cfg.max_seq_len}; {canon}; positions: {pos}; QK-norm {cfg.qk_norm}; tied embeddings "
        f"{cfg.tie_embeddings}"
    )


def model_card(
    cfg: ModelConfig,
    fmt: str,
    meta: Mapping[str, Any],
    run_dir: Path | None,
    tokenizer_note: str,
    n_params: int,
    ids: Mapping[str, int | None] | None = None,
) -> str:
    """The export's ``README.md`` text (module docstring); ``ids``: the token ids of ``config.json``."""
    lines = [
        "---",
        "library_name: transformers",
        "tags: [canonlm, physics-of-language-models, canon-layers]",
        "---",
        "",
        f"# {run_dir.name if run_dir else 'canonlm model'}",
        "",
        f"A model trained with canonlm (a reproduction of *Physics of Language Models, Part 4.1: Architecture "
        f"Design and the Magic of Canon Layers*, Allen-Zhu 2025): {_describe(cfg)}. {n_params:,} parameters.",
        "",
    ]
    why, code = LOAD[fmt]
    lines += ["## Load", "", f"Format `{fmt}`: {why}", "", "```python", code.format(dir="<this folder>"), "```", ""]
    lines += _generation_section(cfg, ids or {}, fmt) + _lora_section(cfg, fmt)
    lines += ["## Training", ""]
    task = dict(meta.get("task") or {})
    if task:
        shown = {k: v for k, v in task.items() if not isinstance(v, (dict, list)) or k == "name"}
        lines += [f"Task `{task.get('name')}`: `{json.dumps(shown, sort_keys=True, default=str)[:1500]}`", ""]
    over = run_dir / ".hydra" / "overrides.yaml" if run_dir else None
    if over is not None and over.is_file():
        import yaml

        try:
            args = yaml.safe_load(over.read_text()) or []
        except yaml.YAMLError:
            args = []
        lines += ["Command:", "", "```bash", "python train.py " + " ".join(str(a) for a in args), "```", ""]
    res = run_dir / "results.json" if run_dir else None
    if res is not None and res.is_file():
        try:
            r = json.loads(res.read_text())
        except json.JSONDecodeError:
            r = {}
        flat = {
            f"{split}/{k}": v
            for split in ("val", "test")
            for k, v in (r.get(split) or {}).items()
            if isinstance(v, (int, float))
        }
        if flat:
            lines += ["## Results (the run's results.json)", "", "| metric | value |", "|---|---|"]
            lines += [f"| {k} | {v:.6g} |" for k, v in sorted(flat.items())][:60]
            lines += ["", f"Steps: {r.get('steps')}; training time {r.get('train_time_s')} s.", ""]
    lines += ["## Tokenizer", "", tokenizer_note + ".", ""]
    if fmt != "native" and "no tokenizer" not in tokenizer_note:
        # transformers 5.x's AutoTokenizer reads config.json through AutoConfig first, and this config needs remote
        # code: without the flag it asks the trust-remote-code question (4.51 reads tokenizer_config.json only)
        lines += [
            "```python",
            "from transformers import AutoTokenizer",
            'tok = AutoTokenizer.from_pretrained("<this folder>", trust_remote_code=True)',
            "```",
            "",
            "(`trust_remote_code=True` spares transformers 5.x's question about this folder's model code; the "
            "tokenizer itself is transformers' `PreTrainedTokenizerFast`, which "
            "`PreTrainedTokenizerFast.from_pretrained` also loads without it.)",
            "",
        ]
    return "\n".join(lines)
