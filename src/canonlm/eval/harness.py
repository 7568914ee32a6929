"""``python -m canonlm.eval.harness``: lm-evaluation-harness tasks on a canonlm run directly (no export step).

    python -m canonlm.eval.harness <run dir | checkpoint> --tasks hellaswag,lambada_openai [--batch-size 8]
    python -m canonlm.eval.harness <run> --tasks my_task --include-path my_tasks/ --limit 100 --out results.json
    python -m canonlm.eval.harness <run> --tasks reallife        # the paper's Result-12 list (TASK_PRESETS)

The run's model becomes the same transformers model an export loads (:class:`canonlm.hf.remote.modeling_canonlm.
CanonLMForCausalLM` around canonlm's ``CanonLM``, weights from the checkpoint, fp32) with the tokenizer an export
carries (:func:`canonlm.hf.tokenizer.export_tokenizer`), and is scored through lm-evaluation-harness's own ``HFLM``
(``lm_eval.models.huggingface.HFLM(pretrained=<model>, tokenizer=...)``), so the numbers are those of ``lm_eval
--model hf --model_args pretrained=<export>,trust_remote_code=True`` on the run's export. Needs the ``eval`` extra
(``pip install -e .[eval]``). Prints the results (``results`` of ``lm_eval.simple_evaluate``) as JSON; exit 2 with
one message for a bad run, task or option.

Speed (``bench/harness_speed.py`` measures it against ``lm_eval`` on the export, per architecture):

* ``loglikelihood`` requests run exactly as ``HFLM`` runs them (batched full forwards, ``--batch-size`` rows).
* Greedy ``generate_until`` requests (``do_sample`` false, temperature 0: lm-eval's default) are decoded with
  canonlm's decode cache (:meth:`canonlm.arch.model.CanonLM.new_cache`: KV, Canon, short-conv and recurrent states)
  instead of transformers' ``generate``, which on this model (no KV cache) re-runs every row's whole prefix at every
  step: one prefill per prompt length, then one position per step for the rows still generating, O(T) instead of
  O(T^2) token-forwards. Everything else is transformers' greedy loop as lm-eval drives it: the argmax of the same
  model's last logits (ties to the lowest id), the same stopping rules (an end token of the model's
  ``generation_config`` finishes a row, which then gets ``pad_token_id``; ``max_gen_toks``; lm-eval's own
  stop-sequence criteria objects, called on the same ids), so each batch yields the tokens ``lm_eval`` gets at the
  same ``--batch-size``. Sampling, other generation arguments (``top_k``, ``num_beams``, ``repetition_penalty``,
  ...) or a ``generation_config`` that sets a logits processor go through ``HFLM``'s transformers ``generate``.
* Tasks that are all plain tasks of ``--include-path`` are looked up in that folder alone
  (``TaskManager(include_path, include_defaults=False)``), which skips indexing lm-eval's ~15,000 task files
  (about 6 s on a 2-core CPU); anything else gets the full index.
* ``--device auto`` (the default) runs on CUDA when it is available, as ``lm_eval --model hf`` does without
  ``--device``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from pathlib import Path
from typing import Any

#: ``generation_config`` fields (as ``GenerationConfig.to_diff_dict`` lists them) that leave greedy decoding as a
#: plain argmax: token ids, bookkeeping, output flags, and ``max_length`` (lm-eval passes its own).
_PLAIN_GENERATION_FIELDS = frozenset(
    {
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "decoder_start_token_id",
        "transformers_version",
        "_from_model_config",
        "max_length",
        "do_sample",
        "num_beams",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "output_logits",
        "return_dict_in_generate",
        "_commit_hash",
        "cache_implementation",
    }
)


def resolve_device(device: str) -> str:
    """``device`` as a torch device string: ``auto`` -> ``cuda`` when a CUDA device is available, else ``cpu``.
    Raises ValueError naming the value and what is allowed for an unknown name or a CUDA device that is not here."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device={device!r}; allowed: auto | cpu | cuda | cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0 or (dev.index is not None and dev.index >= n):
            raise ValueError(
                f"--device={device!r}: this machine has {n} CUDA device(s); allowed: auto | cpu"
                + (f" | cuda | cuda:0..{n - 1}" if n else "")
            )
    elif dev.type != "cpu":
        raise ValueError(f"--device={device!r}; allowed: auto | cpu | cuda | cuda:N")
    return device


def harness_model(run: str | Path, device: str = "auto"):
    """``(CanonLMForCausalLM, tokenizer)`` of a canonlm run directory or checkpoint (a distributed FSDP2 folder
    included), as an export would load them, in fp32 on ``device`` (:func:`resolve_device`). Raises
    :class:`canonlm.hf.InteropError` (no tokenizer for this task, unreadable run), ValueError (bad device) and
    ImportError (transformers missing)."""
    import torch

    from canonlm.hf import InteropError, read_canonlm
    from canonlm.hf.io import remote_config
    from canonlm.hf.remote.configuration_canonlm import CanonLMConfig
    from canonlm.hf.remote.modeling_canonlm import CanonLMForCausalLM
    from canonlm.hf.tokenizer import export_tokenizer

    device = resolve_device(device)
    cfg, sd, meta = read_canonlm(run)
    tok, ids, note = export_tokenizer(meta.get("task"), cfg.vocab_size, cfg.max_seq_len)
    if tok is None:
        raise InteropError(f"{run}: {note}; lm-evaluation-harness needs a tokenizer")
    hcfg = {k: v for k, v in remote_config(cfg).items() if k not in ("architectures", "auto_map", "model_type")}
    hcfg.update(ids)
    model = CanonLMForCausalLM(CanonLMConfig(**hcfg))
    model.model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=True)
    return model.eval().to(device), tok


@functools.lru_cache(maxsize=None)
def harness_lm_class():
    """The ``HFLM`` subclass :func:`evaluate` scores with (module docstring): ``HFLM`` with greedy ``generate_until``
    decoded on canonlm's decode cache. Built on first use (lm-eval is an optional extra). Its instances count the
    rows decoded that way in ``cached_rows`` and the ``generate`` calls left to transformers in ``hf_generate_calls``.
    """
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils_hf import stop_sequences_criteria

    class CanonLMHarnessLM(HFLM):
        """``HFLM`` on a ``CanonLMForCausalLM`` (canonlm.eval.harness module docstring)."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.cached_rows = 0
            self.hf_generate_calls = 0

        # -------------------------------------------------------------------------------- eligibility
        def _decoder(self):
            """canonlm's ``CanonLM`` inside the transformers model, when it offers decode caches; else None."""
            core = getattr(self.model, "model", None)
            ok = callable(getattr(core, "new_cache", None)) and callable(getattr(self.model, "place_on", None))
            return core if ok else None

        def _greedy(self, generation_kwargs: dict[str, Any]) -> bool:
            """Whether transformers' ``generate`` would decode greedily with no logits processor: lm-eval's
            temperature-0 normalisation (``HFLM._model_generate``) gives ``do_sample=False``, nothing else is asked,
            and the model's ``generation_config`` sets nothing beyond token ids and lengths."""
            kw = {k: v for k, v in generation_kwargs.items() if k != "attention_mask"}
            temp = kw.pop("temperature", 0.0)
            do_sample = kw.pop("do_sample", None)
            if do_sample is None and temp == 0.0:
                do_sample = False
            if kw or do_sample is not False or temp not in (0, 0.0, None):
                return False
            gc = getattr(self.model, "generation_config", None)
            if gc is None:
                return False
            diff = gc.to_diff_dict()
            if set(diff) - _PLAIN_GENERATION_FIELDS or diff.get("do_sample") or (diff.get("num_beams") or 1) != 1:
                return False
            return True

        # -------------------------------------------------------------------------------- generation
        def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
            """``HFLM._model_generate`` contract: ``context`` (B, W) left-padded prompt ids (``attention_mask`` in
            ``generation_kwargs``), ``max_length`` = W + max_gen_toks -> the (B, W + n) ids transformers' ``generate``
            returns. Greedy requests run :meth:`_decode_cached`; anything else ``HFLM``'s transformers ``generate``."""
            core = self._decoder()
            mask = generation_kwargs.get("attention_mask")
            rows = None
            if core is not None and self._greedy(generation_kwargs):
                rows = _prompt_rows(context, mask, int(core.cfg.vocab_size))
                limit = getattr(core, "max_positions", None)
                max_new = int(max_length) - int(context.shape[1])
                if rows is not None and (
                    max_new < 1 or (limit is not None and max(len(r) for r in rows) + max_new > int(limit))
                ):
                    rows = None  # transformers' generate refuses / handles it with its own message
            if rows is None:
                self.hf_generate_calls += 1
                return super()._model_generate(context, max_length, stop, **generation_kwargs)
            out = self._decode_cached(core, context, rows, max_new, stop)
            self.cached_rows += len(rows)
            return out

        def _eos_ids(self) -> list[int]:
            """The end tokens transformers' ``generate`` stops a row at: ``generation_config.eos_token_id``."""
            eos = getattr(self.model.generation_config, "eos_token_id", None)
            if eos is None:
                return []
            return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

        @torch.no_grad()
        def _decode_cached(self, core, context, rows: list[list[int]], max_new: int, stop: list[str]):
            """Greedy decoding of the batch ``context`` (B, W) whose rows hold the prompts ``rows`` (ids without the
            left padding), with the stopping rules of transformers' greedy ``_sample`` as lm-eval calls it
            (``transformers/generation/utils.py``, ``stopping_criteria.py``): after every step a row is finished when
            its new token is an end token of ``generation_config`` (it then gets ``pad_token_id`` from the next step
            on) or the batch reached ``max_new`` tokens, and the whole batch when lm-eval's stop-sequence criteria
            (``stop_sequences_criteria(tokenizer, stop, W, B)``, the same objects, called on the same ids) say so
            -- one of them returns True only once every row has shown its stop sequence, so until then a row that
            has shown it goes on generating, as in lm-eval. Only the logits come from elsewhere: prompts of one
            length share a :class:`~canonlm.arch.cache.DecodeCache` (one prefill, then one position per step;
            finished rows leave it) instead of transformers re-running every prefix. Returns (B, W + n) ids."""
            device = context.device
            self.model.place_on(device)  # the kernels and RoPE tables CanonLMForCausalLM.forward would use
            B, W = int(context.shape[0]), int(context.shape[1])
            eos = self._eos_ids()
            pad = self.tokenizer.pad_token_id
            pad = int(pad) if pad is not None else (eos[0] if eos else 0)
            criteria = stop_sequences_criteria(self.tokenizer, stop, W, B)
            autocast = (
                torch.autocast(device_type=device.type, dtype=self.mixed_precision_dtype)
                if self.mixed_precision_dtype is not None
                else contextlib.nullcontext()
            )
            groups: dict[int, list[int]] = {}  # prompt length -> rows, in cache order
            for r, ids in enumerate(rows):
                groups.setdefault(len(ids), []).append(r)
            caches, last = {}, {}  # group -> DecodeCache; group -> next-token logits (rows of the group, V), fp32

            def forward(n: int, ids: torch.Tensor) -> None:
                with autocast:
                    logits = core(ids, caches[n])
                # a copy of the last position only, as transformers takes it (the prefill's (B, T, V) is freed)
                last[n] = logits[:, -1].to(dtype=torch.float32, copy=True)

            for n, members in groups.items():
                caches[n] = core.new_cache()
                forward(n, torch.tensor([rows[r] for r in members], dtype=torch.long, device=device))
            seq = context.cpu()
            unfinished = [True] * B
            for step in range(max_new):
                nxt = [pad] * B
                for n, members in groups.items():
                    if any(unfinished[r] for r in members):
                        for r, t in zip(members, last[n].argmax(-1).tolist()):
                            if unfinished[r]:
                                nxt[r] = int(t)
                seq = torch.cat([seq, torch.tensor(nxt, dtype=seq.dtype)[:, None]], dim=1)
                done = criteria(seq, None)  # (B,) bool; all False for no stop sequence
                for r in range(B):
                    if unfinished[r] and (step + 1 >= max_new or nxt[r] in eos or bool(done[r])):
                        unfinished[r] = False
                if not any(unfinished):
                    break
                for n, members in groups.items():
                    keep = [j for j, r in enumerate(members) if unfinished[r]]
                    if not keep:
                        continue
                    if len(keep) < len(members):
                        caches[n].select(torch.tensor(keep, dtype=torch.long, device=device))
                        members[:] = [members[j] for j in keep]
                    forward(n, torch.tensor([[nxt[r]] for r in members], dtype=torch.long, device=device))
            return seq.to(device)

    return CanonLMHarnessLM


def _prompt_rows(context, mask, vocab_size: int) -> list[list[int]] | None:
    """The prompt ids of each row of a left-padded batch (``mask`` 0...0 1...1; None = no padding), or None when a
    row is empty, the mask is not plain left padding, or an id lies outside ``0..vocab_size - 1`` (transformers'
    path then raises its own error)."""
    ids = context.tolist()
    if mask is None:
        rows = ids
    else:
        rows = []
        for r, m in zip(ids, mask.tolist()):
            s = len(m) - sum(m)
            if any(m[:s]) or not all(m[s:]):
                return None
            rows.append(r[s:])
    if any(not r or min(r) < 0 or max(r) >= vocab_size for r in rows):
        return None
    return rows


def task_manager(tasks: list[str], include_path: str | None = None):
    """lm-eval's ``TaskManager`` for ``tasks``: over ``include_path`` alone when every name is a plain task there
    (no group or tag, which may name lm-eval's own tasks), else over lm-eval's tasks plus ``include_path``."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if tasks and all(t in own.all_subtasks for t in tasks):
            return own
        return TaskManager(include_path=include_path)
    return TaskManager()


def evaluate(
    run: str | Path,
    tasks: list[str],
    *,
    include_path: str | None = None,
    batch_size: int = 8,
    limit: int | None = None,
    device: str = "auto",
    log_samples: bool = False,
    lm: Any = None,
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of ``tasks`` on the run (module docstring); returns its result dict. ``lm``: an
    instance of :func:`harness_lm_class` to reuse (default: one built for ``run``, ``batch_size`` and ``device``).
    Raises InteropError / ValueError (bad run, device) and lm-eval's errors for unknown tasks."""
    import lm_eval

    if lm is None:
        model, tok = harness_model(run, device)
        lm = harness_lm_class()(pretrained=model, tokenizer=tok, batch_size=batch_size, device=str(model.device))
    return lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=task_manager(tasks, include_path), limit=limit, log_samples=log_samples
    )


#: Named task lists for ``--tasks``, expanded in place (``--tasks reallife,mmlu``). ``reallife``: the lm-eval tasks of
#: the paper's Result 12 (Physics of Language Models Part 4.1, 1.3B models on 100B tokens: PIQA, HellaSwag,
#: WinoGrande, ARC-easy / -challenge, SIQA, BoolQ, WikiText perplexity, LAMBADA), by their names in lm-eval 0.4
#: (``lm_eval/tasks/<folder>/*.yaml``): SIQA is ``social_iqa``; LAMBADA is ``lambada_openai``, the OpenAI version
#: that the release's evaluation list names.
TASK_PRESETS = {
    "reallife": (
        "piqa",
        "hellaswag",
        "winogrande",
        "arc_easy",
        "arc_challenge",
        "social_iqa",
        "boolq",
        "wikitext",
        "lambada_openai",
    ),
}


def expand_tasks(text: str) -> list[str]:
    """The lm-eval task names of a ``--tasks`` value: comma-separated names, each preset of :data:`TASK_PRESETS`
    replaced by its list; duplicates dropped (first kept), empty entries ignored."""
    out: list[str] = []
    for name in (t.strip() for t in text.split(",")):
        for t in TASK_PRESETS.get(name, (name,) if name else ()):
            if t not in out:
                out.append(t)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI (module docstring)."""
    ap = argparse.ArgumentParser(
        prog="python -m canonlm.eval.harness",
        description="lm-evaluation-harness tasks on a canonlm run (no export needed).",
    )
    ap.add_argument("run", help="run directory or checkpoint")
    ap.add_argument(
        "--tasks",
        required=True,
        help="comma-separated lm-eval task names, or a preset: "
        + "; ".join(f"{k} = {','.join(v)}" for k, v in TASK_PRESETS.items()),
    )
    ap.add_argument("--include-path", default=None, help="folder of extra task YAMLs")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available, as lm_eval) | cpu | cuda | cuda:N")
    ap.add_argument("--out", default=None, help="also write the results JSON here (must not exist)")
    a = ap.parse_args(argv)
    if a.batch_size < 1:
        print(f"canonlm.eval.harness: error: --batch-size={a.batch_size}; allowed: an integer >= 1", file=sys.stderr)
        return 2
    if a.out and Path(a.out).exists():
        print(f"canonlm.eval.harness: error: --out={a.out} exists; nothing is overwritten", file=sys.stderr)
        return 2
    try:
        resolve_device(a.device)
    except ValueError as e:
        print(f"canonlm.eval.harness: error: {e}", file=sys.stderr)
        return 2
    try:
        import lm_eval  # noqa: F401 -- imported to check that lm-eval is installed
    except ImportError:
        print(
            "canonlm.eval.harness: error: lm-evaluation-harness is not installed (pip install -e .[eval])",
            file=sys.stderr,
        )
        return 2
    from canonlm.hf import InteropError

    try:
        res = evaluate(
            a.run,
            expand_tasks(a.tasks),
            include_path=a.include_path,
            batch_size=a.batch_size,
            limit=a.limit,
            device=a.device,
        )
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
