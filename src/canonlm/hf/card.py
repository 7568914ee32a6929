"""The model card (``README.md``) and ``generation_config.json`` of an export.

The card says what the model is (architecture, size, Canon, positions, parameters), how it was trained (the run's
command-line overrides from ``.hydra/overrides.yaml``, task and data), what it scored (the run's ``results.json``),
which tokenizer comes with it, and how to load it in the export's format -- including that the ``canonlm`` format's
modeling code needs canonlm installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from canonlm.arch.config import ModelConfig

LOAD = {
    "native": ("transformers' own `LlamaForCausalLM`; nothing else is needed.",
               'from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained("{dir}")'),
    "canonlm": ("canonlm's modeling code (`modeling_canonlm.py`, `configuration_canonlm.py`, in this folder). It "
                "imports canonlm: **install canonlm first** (`pip install canonlm`, or `pip install -e .` in its "
                "repository).",
                'from transformers import AutoModelForCausalLM\n'
                'model = AutoModelForCausalLM.from_pretrained("{dir}", trust_remote_code=True)'),
    "official": ("the official PhysicsLM4 `LlamaCanonForCausalLM` (lingua layout `default/params.json` + "
                 "`default/consolidated.pth`). Copy the release's `configuration_llama_canon.py`, "
                 "`modeling_llama_canon.py` and `canon_helper.py` into this folder (not shipped here).",
                 'import sys; sys.path.insert(0, "{dir}")\nfrom transformers import AutoModelForCausalLM\n'
                 'model = AutoModelForCausalLM.from_pretrained("{dir}", trust_remote_code=True)'),
    "llamacanon": ("the official `LlamaCanonConfig` in `config.json`, weights in safetensors. Copy the release's "
                   "three class files here; its `from_pretrained` reads the lingua layout, so build from the config:",
                   'import sys; sys.path.insert(0, "{dir}")\nfrom safetensors.torch import load_file\n'
                   'from transformers import AutoConfig, AutoModelForCausalLM\n'
                   'cfg = AutoConfig.from_pretrained("{dir}", trust_remote_code=True)\n'
                   'model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=True)\n'
                   'model.load_state_dict(load_file("{dir}/model.safetensors"), strict=not cfg.tie_word_embeddings)'),
}


def generation_config(ids: Mapping[str, int | None], max_length: int) -> dict[str, Any]:
    """``generation_config.json``: greedy decoding, the token ids, ``max_length`` = the trained context."""
    out = {"do_sample": False, "max_length": int(max_length)}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if ids.get(key) is not None:
            out[key] = int(ids[key])
    return out


def _describe(cfg: ModelConfig) -> str:
    pos = cfg.pos.type + (f" (rope_dim {cfg.rope_dim}, {cfg.pos.pairing} pairing, theta {cfg.pos.theta:g})"
                          if cfg.rope_dim else "")
    canon = (f"Canon-{cfg.canon.set} (kernel {cfg.canon.kernel}, residual {cfg.canon.residual}, activation "
             f"{cfg.canon.activation})" if cfg.canon.set else "no Canon layers")
    return (f"`{cfg.arch}` {cfg.n_layers}L{cfg.d_model}D, {cfg.n_heads} heads, vocabulary {cfg.vocab_size}, context "
            f"{cfg.max_seq_len}; {canon}; positions: {pos}; QK-norm {cfg.qk_norm}; tied embeddings "
            f"{cfg.tie_embeddings}")


def model_card(cfg: ModelConfig, fmt: str, meta: Mapping[str, Any], run_dir: Path | None, tokenizer_note: str,
               n_params: int) -> str:
    """The export's ``README.md`` text (module docstring)."""
    lines = ["---", "library_name: transformers", "tags: [canonlm, physics-of-language-models, canon-layers]", "---",
             "", f"# {run_dir.name if run_dir else 'canonlm model'}", "",
             f"A model trained with canonlm (a reproduction of *Physics of Language Models, Part 4.1: Architecture "
             f"Design and the Magic of Canon Layers*, Allen-Zhu 2025): {_describe(cfg)}. {n_params:,} parameters.", ""]
    why, code = LOAD[fmt]
    lines += ["## Load", "", f"Format `{fmt}`: {why}", "", "```python", code.format(dir="<this folder>"), "```", ""]
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
        flat = {f"{split}/{k}": v for split in ("val", "test") for k, v in (r.get(split) or {}).items()
                if isinstance(v, (int, float))}
        if flat:
            lines += ["## Results (the run's results.json)", "", "| metric | value |", "|---|---|"]
            lines += [f"| {k} | {v:.6g} |" for k, v in sorted(flat.items())][:60]
            lines += ["", f"Steps: {r.get('steps')}; training time {r.get('train_time_s')} s.", ""]
    lines += ["## Tokenizer", "", tokenizer_note + ".", ""]
    return "\n".join(lines)
