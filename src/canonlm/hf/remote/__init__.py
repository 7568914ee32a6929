"""Modeling code that :func:`canonlm.hf.io.export_model` writes into an export, so that
``transformers.AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads every canonlm model
(Llama with Canon, partial RoPE or QK-norm; GLA, GDN, Mamba2) through ``config.json``'s ``auto_map``:
``configuration_canonlm.py`` (:class:`CanonLMConfig`) and ``modeling_canonlm.py`` (:class:`CanonLMForCausalLM`).

:mod:`canonlm.hf.remote.bundle` writes them together with every canonlm module they import (the model, its modules,
the sequence ops) as flat files with relative imports, so an export needs torch and transformers only, not canonlm;
:mod:`canonlm.hf.remote.native_stub` stands in for the native CPU Canon kernel, which an export does not carry.
Inside canonlm, ``canonlm.eval.harness`` uses the same classes on the installed package.
"""
