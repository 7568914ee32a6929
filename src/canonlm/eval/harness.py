"""``python -m canonlm.eval.harness``: lm-evaluation-harness tasks on a canonlm run directly (no export step).

    python -m canonlm.eval.harness <run dir | checkpoint> --tasks hellaswag,lambada_openai [--batch-size 8]
    python -m canonlm.eval.harness <run> --tasks my_task --include-path my_tasks/ --limit 100 --out results.json

The run's model becomes the same transformers model an export loads (:class:`canonlm.hf.remote.modeling_canonlm.
CanonLMForCausalLM` around canonlm's ``CanonLM``, weights from the checkpoint, fp32 on the CPU or the run's device)
with the tokenizer an export carries (:func:`canonlm.hf.tokenizer.export_tokenizer`), and is scored through
lm-evaluation-harness's own ``HFLM`` (``lm_eval.models.huggingface.HFLM(pretrained=<model>, tokenizer=...)``), so the
numbers are those of ``lm_eval --model hf --model_args pretrained=<export>,trust_remote_code=True`` on the run's
export. Needs the ``eval`` extra (``pip install -e .[eval]``). Prints the results (``results`` of
``lm_eval.simple_evaluate``) as JSON; exit 2 with one message for a bad run, task or option.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def harness_model(run: str | Path, device: str = "cpu"):
    """``(CanonLMForCausalLM, tokenizer)`` of a canonlm run directory or checkpoint (a distributed FSDP2 folder
    included), as an export would load them. Raises :class:`canonlm.hf.InteropError` (no tokenizer for this task,
    unreadable run) and ImportError (transformers missing)."""
    import torch

    from canonlm.hf import InteropError, read_canonlm
    from canonlm.hf.io import remote_config
    from canonlm.hf.remote.configuration_canonlm import CanonLMConfig
    from canonlm.hf.remote.modeling_canonlm import CanonLMForCausalLM
    from canonlm.hf.tokenizer import export_tokenizer

    cfg, sd, meta = read_canonlm(run)
    tok, ids, note = export_tokenizer(meta.get("task"), cfg.vocab_size)
    if tok is None:
        raise InteropError(f"{run}: {note}; lm-evaluation-harness needs a tokenizer")
    hcfg = {k: v for k, v in remote_config(cfg).items() if k not in ("architectures", "auto_map", "model_type")}
    hcfg.update(ids)
    model = CanonLMForCausalLM(CanonLMConfig(**hcfg))
    model.model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=True)
    return model.eval().to(device), tok


def evaluate(run: str | Path, tasks: list[str], *, include_path: str | None = None, batch_size: int = 8,
             limit: int | None = None, device: str = "cpu", log_samples: bool = False) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of ``tasks`` on the run (module docstring); returns its result dict."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tok = harness_model(run, device)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size, device=device)
    tm = TaskManager(include_path=include_path) if include_path else TaskManager()
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=limit, log_samples=log_samples)


def main(argv: list[str] | None = None) -> int:
    """CLI (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m canonlm.eval.harness",
                                 description="lm-evaluation-harness tasks on a canonlm run (no export needed).")
    ap.add_argument("run", help="run directory or checkpoint")
    ap.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    ap.add_argument("--include-path", default=None, help="folder of extra task YAMLs")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="also write the results JSON here (must not exist)")
    a = ap.parse_args(argv)
    if a.batch_size < 1:
        print(f"canonlm.eval.harness: error: --batch-size={a.batch_size}; allowed: an integer >= 1", file=sys.stderr)
        return 2
    if a.out and Path(a.out).exists():
        print(f"canonlm.eval.harness: error: --out={a.out} exists; nothing is overwritten", file=sys.stderr)
        return 2
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("canonlm.eval.harness: error: lm-evaluation-harness is not installed (pip install -e .[eval])",
              file=sys.stderr)
        return 2
    from canonlm.hf import InteropError

    try:
        res = evaluate(a.run, [t for t in a.tasks.split(",") if t], include_path=a.include_path,
                       batch_size=a.batch_size, limit=a.limit, device=a.device)
    except (InteropError, KeyError, ValueError) as e:
        print(f"canonlm.eval.harness: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(res["results"], indent=2, sort_keys=True, default=str)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
