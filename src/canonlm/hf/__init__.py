"""Hugging Face interop: every canonlm model -> a directory ``transformers.AutoModelForCausalLM`` loads (native
``LlamaForCausalLM``, or canonlm's own modeling code), and the official PhysicsLM4 ``LlamaCanonForCausalLM``
(release files ``configuration_llama_canon.py``, ``modeling_llama_canon.py``, ``canon_helper.py``) both ways, in
config.json + safetensors and in the lingua layout of the released checkpoints. The CLI is
``python -m canonlm.export``; see docs/huggingface.md.

* :mod:`canonlm.hf.mapping` -- config and state-dict conversion both ways (pure functions, no transformers import).
* :mod:`canonlm.hf.lingua` -- the lingua layout (``<dir>/<variant>/params.json`` + ``consolidated.pth``).
* :mod:`canonlm.hf.tokenizer`, :mod:`canonlm.hf.card` -- the tokenizer, ``generation_config.json`` and model card
  of an export.
* :mod:`canonlm.hf.remote` -- the modeling code written into ``canonlm``-format exports with the canonlm modules it
  needs (:mod:`canonlm.hf.remote.bundle`: self-contained, torch and transformers only).
* :mod:`canonlm.hf.io` -- reading run directories / checkpoints / safetensors directories, atomic writing,
  :func:`load_init_weights` for training's ``init_from``.
"""

from canonlm.hf.io import (
    checkpoint_dict,
    export_model,
    hf_to_canonlm,
    import_hf,
    load_canonlm_checkpoint,
    load_init_weights,
    read_canonlm,
    read_hf_dir,
    read_weights,
)
from canonlm.hf.mapping import (
    InteropError,
    expected_hf_shapes,
    from_hf_config,
    from_hf_state_dict,
    hf_format,
    model_config_from_dict,
    structural_differences,
    to_hf_config,
    to_hf_state_dict,
)

__all__ = [
    "InteropError",
    "export_model",
    "import_hf",
    "load_init_weights",
    "load_canonlm_checkpoint",
    "read_canonlm",
    "read_hf_dir",
    "read_weights",
    "hf_to_canonlm",
    "checkpoint_dict",
    "hf_format",
    "to_hf_config",
    "to_hf_state_dict",
    "from_hf_config",
    "from_hf_state_dict",
    "expected_hf_shapes",
    "model_config_from_dict",
    "structural_differences",
]
