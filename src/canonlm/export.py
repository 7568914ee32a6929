"""``python -m canonlm.export``: canonlm <-> Hugging Face model directories (docs/huggingface.md).

    python -m canonlm.export <run dir | checkpoint.ckpt> <out dir>          # canonlm -> config.json + model.safetensors
    python -m canonlm.export --format official <run dir | ckpt> <out dir>   # canonlm -> the release's lingua layout
    python -m canonlm.export --from-hf <hf dir> <out.ckpt | out run dir>    # official LlamaCanon / native Llama -> canonlm
    python -m canonlm.export --from-hf <released dir> [--variant default] <out>   # a released checkpoint (lingua layout)

Export writes transformers ``LlamaForCausalLM`` (Llama without Canon, QK-norm or partial RoPE) or, for every other
model (Canon, partial RoPE, QK-norm, GLA, GDN, Mamba2), config.json + model.safetensors + canonlm's modeling code,
bundled (``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` with torch and transformers only, no
canonlm installed); ``--format official``
/ ``llamacanon`` write the official release's layouts (see :func:`canonlm.hf.io.export_model`). Import writes a
checkpoint in the layout training writes (``state_dict`` keys ``model.<name>``, ``checkpoint["canonlm"]``), usable
as ``init_from=<path>``, by evaluation and by generation. ``--from-hf`` reads the official lingua layout
(``<dir>/<variant>/params.json`` + ``consolidated.pth``, the layout of the released checkpoints) whenever
``<dir>/default/params.json`` exists or ``--variant`` is given; ``--format official`` writes that layout (plus a
``config.json`` whose ``auto_map`` names the release's classes). Exit codes: 0 written; 2 refused (one line naming what and why; nothing written).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    """``python -m canonlm.export``: export a run / checkpoint to a Hugging Face directory, or import one with
    ``--from-hf``. Prints a JSON summary on success; returns 0, or 2 after one error line (nothing written)."""
    ap = argparse.ArgumentParser(
        prog="python -m canonlm.export",
        description="Export a canonlm model to a Hugging Face directory, or import one "
        "(--from-hf) into a canonlm checkpoint.",
    )
    ap.add_argument("src", help="run directory or .ckpt (export); Hugging Face directory (with --from-hf)")
    ap.add_argument("out", help="new output directory (export); new .ckpt file or run directory (--from-hf)")
    ap.add_argument(
        "--from-hf",
        action="store_true",
        help="import a Hugging Face directory or a released checkpoint (lingua layout) into canonlm",
    )
    ap.add_argument(
        "--variant",
        default=None,
        help="with --from-hf: the lingua layout's variant folder (the released checkpoints: default)",
    )
    ap.add_argument(
        "--format",
        default="auto",
        choices=("auto", "canonlm", "official", "llamacanon"),
        help="export layout: auto (default) = transformers LlamaForCausalLM when the model is a plain "
        "Llama, else canonlm; canonlm = config.json + model.safetensors + canonlm's modeling code "
        "bundled (any model; AutoModelForCausalLM with trust_remote_code, torch and transformers "
        "only); official = "
        "the release's lingua layout (default/params.json + consolidated.pth) + config.json; "
        "llamacanon = the official LlamaCanonConfig in config.json + safetensors",
    )
    a = ap.parse_args(argv)
    from canonlm.hf import InteropError, export_model, import_hf

    if a.variant is not None and not a.from_hf:
        print("canonlm.export: error: --variant reads a released checkpoint and needs --from-hf", file=sys.stderr)
        return 2
    if a.format != "auto" and a.from_hf:
        print(
            "canonlm.export: error: --format chooses the export layout and cannot be used with --from-hf",
            file=sys.stderr,
        )
        return 2
    try:
        info = import_hf(a.src, a.out, variant=a.variant) if a.from_hf else export_model(a.src, a.out, fmt=a.format)
    except InteropError as e:
        print(f"canonlm.export: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
