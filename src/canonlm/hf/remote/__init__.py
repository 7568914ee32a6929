"""Modeling code that :func:`canonlm.hf.io.export_model` copies into an export, so that
``transformers.AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads every canonlm model
(Llama with Canon, partial RoPE or QK-norm; GLA, GDN, Mamba2) through ``config.json``'s ``auto_map``:
``configuration_canonlm.py`` (:class:`CanonLMConfig`) and ``modeling_canonlm.py`` (:class:`CanonLMForCausalLM`).

The files import canonlm (the model is canonlm's :class:`~canonlm.arch.model.CanonLM`), so the machine that loads
an export needs canonlm installed; the export's model card says so. Nothing in canonlm imports this package.
"""
