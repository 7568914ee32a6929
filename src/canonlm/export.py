"""``python -m canonlm.export``: canonlm <-> Hugging Face model directories (docs/huggingface.md).

    python -m canonlm.export <run dir | checkpoint.ckpt> <out dir>          # canonlm -> config.json + model.safetensors
    python -m canonlm.export --from-hf <hf dir> <out.ckpt | out run dir>    # official LlamaCanon / native Llama -> canonlm

Export writes transformers ``LlamaForCausalLM`` (Llama without Canon, QK-norm or partial RoPE) or the official
``LlamaCanonForCausalLM`` format (``model_type: "LlamaCanon"`` + ``auto_map``; copy the release's
``configuration_llama_canon.py``, ``modeling_llama_canon.py`` and ``canon_helper.py`` beside it). Import writes a
checkpoint in the layout training writes (``state_dict`` keys ``model.<name>``, ``checkpoint["canonlm"]``), usable
as ``init_from=<path>``. Exit codes: 0 written; 2 refused (one line naming what and why; nothing written).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    """``python -m canonlm.export``: export a run / checkpoint to a Hugging Face directory, or import one with
    ``--from-hf``. Prints a JSON summary on success; returns 0, or 2 after one error line (nothing written)."""
    ap = argparse.ArgumentParser(prog="python -m canonlm.export",
                                 description="Export a canonlm Llama to a Hugging Face directory, or import one "
                                             "(--from-hf) into a canonlm checkpoint.")
    ap.add_argument("src", help="run directory or .ckpt (export); Hugging Face directory (with --from-hf)")
    ap.add_argument("out", help="new output directory (export); new .ckpt file or run directory (--from-hf)")
    ap.add_argument("--from-hf", action="store_true", help="import a Hugging Face directory into canonlm")
    a = ap.parse_args(argv)
    from canonlm.hf import InteropError, export_model, import_hf

    try:
        info = import_hf(a.src, a.out) if a.from_hf else export_model(a.src, a.out)
    except InteropError as e:
        print(f"canonlm.export: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
