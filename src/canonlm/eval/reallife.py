"""Real-life evaluations of a trained run (paper App. B, Fig. 23).

    python -m canonlm.eval.reallife --run <run dir | .ckpt> --task multihop|babilong [--tokenizer PATH]
        [--background FILE] [--babilong-dir DIR] [--lengths 0,1000,...] [--num-prompts 100] [--out results.json]
        [--force] [--hops 1,2] [--qa qa1,...,qa5] [--prompts FILE.json] [--question-cut verbatim|any_case]
        [--newline boundary|space] [--device auto] [--precision auto] [--batch-size 8] ...

* multihop: 1-hop / 2-hop birth-year prompts (:mod:`canonlm.data.reallife.multihop`) with background sentences from
  ``--background`` (a local text / JSONL file; e.g. a Wikipedia validation dump), names from canonlm's Capo lists,
  L from ``--lengths`` (default 0,1000,...,6000), greedy decoding of 8 tokens, exact 4-digit year match.
  ``--newline boundary`` (default) ends a sentence at every line break of the background file (one-article-per-line
  dumps, headings on their own line); ``space`` treats a single line break as a space (hard-wrapped prose).
* babilong: qa1..qa5 from local Babilong data (``--babilong-dir``; layouts in
  :mod:`canonlm.data.reallife.babilong`) at ``--lengths`` (default 0k,1k,2k,4k), greedy decoding of 20 tokens,
  Babilong's label scorer. ``--question-cut verbatim`` (default) scores exactly like Babilong's ``compare_answers``
  (whose cut at "Question" never fires, because it looks for it in the lower-cased output); ``any_case`` also cuts
  the output at "question" in any case (more lenient). ``--prompts FILE.json`` replaces canonlm's instruction /
  examples / post-prompt texts with your own set (same structure as ``babilong.PROMPTS``: ``{"qa1":
  {"instruction": ..., "examples": ..., "post_prompt": ...}, ...}``, e.g. the Babilong authors' Apache-2.0 prompts);
  the file path and its sha256 are recorded in the results (``settings.prompts``).

``--precision auto`` (the default) evaluates the model in the precision it was trained in (the run's
``trainer.precision``, reproduced as Lightning runs it: :func:`canonlm.eval.load.eval_precision`); a
``trainer.precision`` name (or ``fp32`` / ``bf16``) overrides it. The choice is recorded in the results
(``model.precision``).

``--run`` may also be a checkpoint without a run directory that records its model (``python -m canonlm.export
--from-hf`` output: an imported Hugging Face model); ``--tokenizer`` is then required.

The tokenizer defaults to the one recorded by the run's ``text`` task (its prepared data's meta.json). Prompts are
built (and tokenized) before the model is loaded, which is then rebuilt with room for the longest prompt. The table
is printed and the results (accuracy per cell, counts, every sample's decoded output) are written atomically to
``--out`` (default ``<run dir>/reallife_<task>.json``); an existing file is never replaced without ``--force``.
Exit status: 0 ok, 2 bad arguments / inputs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from canonlm.errors import ConfigError
from canonlm.utils.io import atomic_write_text


class EvalError(Exception):
    """A user-facing problem (printed, exit status 2)."""


def _ints(s: str, what: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise EvalError(f"--{what} {s!r}: expected comma-separated integers") from None


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{s!r}: expected true | false")


def format_multihop_table(res: dict[str, Any], num_prompts: int) -> str:
    """Accuracy table: rows L, columns hops (percent)."""
    acc = res["accuracy"]
    hops = list(acc)
    Ls = sorted({int(L) for h in hops for L in acc[h]})
    lines = [
        f"multi-hop birth-year accuracy (greedy, exact 4-digit year; {num_prompts} prompts per cell; "
        "2-hop chance ~33%)",
        f"  {'L':>6} " + " ".join(f"{h:>7}" for h in hops),
    ]
    for L in Ls:
        cells = [f"{100 * acc[h][str(L)]:6.1f}%" if str(L) in acc[h] else f"{'-':>7}" for h in hops]
        lines.append(f"  {L:>6} " + " ".join(cells))
    return "\n".join(lines)


def format_babilong_table(res: dict[str, Any], num_prompts: int | None) -> str:
    """Accuracy table: rows qa tasks, columns lengths (percent)."""
    acc = res["accuracy"]
    lens: list[str] = []
    for qa in acc:
        for ln in acc[qa]:
            if ln not in lens:
                lens.append(ln)
    lines = [
        f"babilong accuracy (greedy; target must be the only task label; up to {num_prompts} samples per cell)",
        f"  {'task':>5} " + " ".join(f"{ln:>7}" for ln in lens),
    ]
    for qa in acc:
        lines.append(
            f"  {qa:>5} " + " ".join(f"{100 * acc[qa][ln]:6.1f}%" if ln in acc[qa] else f"{'-':>7}" for ln in lens)
        )
    return "\n".join(lines)


def write_json_atomic(path: Path, obj: Any, force: bool = False) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file + ``os.replace``; FileExistsError if ``path`` exists
    and not ``force``."""
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to replace it")
    atomic_write_text(path, json.dumps(obj, indent=1, default=str))


def _memo(encode: Callable[[str], Sequence[int]]) -> Callable[[str], Sequence[int]]:
    """``encode`` with a cache (ids kept as compact int32 arrays): every prompt is tokenized once although it is
    built twice (sizing pass, then evaluation)."""
    import numpy as np

    cache: dict[str, np.ndarray] = {}

    def f(text: str) -> np.ndarray:
        ids = cache.get(text)
        if ids is None:
            ids = cache[text] = np.asarray(encode(text), dtype=np.int32)
        return ids

    return f


def main(argv: Sequence[str] | None = None) -> int:
    """Command line ``python -m canonlm.eval.reallife`` (flags in the module docstring; ``--help``).

    Args: argv: the arguments without the program name (None = ``sys.argv[1:]``).
    Returns the exit status: 0 = evaluated (table on stdout, results JSON written to ``--out``, progress on stderr
        unless ``--quiet``); 2 = a user error -- bad flag values, missing run / checkpoint / tokenizer / background /
        Babilong data / prompt file, an invalid ``--prompts`` file, an existing ``--out`` without ``--force`` --
        reported as one line ``canonlm.eval.reallife: error: <message>`` on stderr, nothing written. argparse
        itself exits with status 2 (usage on stderr) for unknown or missing flags.
    """
    ap = argparse.ArgumentParser(
        prog="python -m canonlm.eval.reallife",
        description="Multi-hop birth-year / Babilong accuracy of a trained run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--run",
        required=True,
        help="run directory (logs/<task_name>/runs/<run_name>) or a .ckpt file "
        "(also one imported with python -m canonlm.export --from-hf)",
    )
    ap.add_argument("--task", required=True, choices=("multihop", "babilong"))
    ap.add_argument("--ckpt", default=None, help="checkpoint file (default <run>/checkpoints/last.ckpt)")
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json / local HF tokenizer dir (default: the run's; required for imported models)",
    )
    ap.add_argument("--eos-token", default=None, help="EOS token string (stops generation)")
    ap.add_argument("--background", default=None, help="multihop: local background text / JSONL file")
    ap.add_argument(
        "--names-dir",
        default=None,
        help="multihop: folder with first/middle/last_names.txt (default: canonlm's Capo lists)",
    )
    ap.add_argument("--babilong-dir", default=None, help="babilong: local data root")
    ap.add_argument(
        "--lengths",
        default=None,
        help="multihop: L in tokens (default 0,1000,...,6000); babilong: "
        "0k,1k,... or token counts (default 0k,1k,2k,4k)",
    )
    ap.add_argument("--hops", default="1,2", help="multihop: hops to evaluate")
    ap.add_argument("--qa", default="qa1,qa2,qa3,qa4,qa5", help="babilong: tasks")
    ap.add_argument("--num-prompts", type=int, default=100, help="prompts per cell")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: multihop 8, babilong 20")
    ap.add_argument("--seed", type=int, default=0, help="multihop prompt seed")
    ap.add_argument("--query", default="first", choices=("first", "random"), help="multihop queried person")
    ap.add_argument("--length-count", default="per_sentence", choices=("per_sentence", "joined"))
    ap.add_argument("--ensure-full-background", type=_bool, default=True, metavar="true|false")
    ap.add_argument("--splitter", default="regex", choices=("regex", "nltk"), help="multihop sentence splitter")
    ap.add_argument(
        "--newline",
        default="boundary",
        choices=("boundary", "space"),
        help="multihop background: a line break ends a sentence (boundary) or is a space (space)",
    )
    ap.add_argument(
        "--question-cut",
        default="verbatim",
        choices=("verbatim", "any_case"),
        help="babilong scorer: verbatim = Babilong's compare_answers (its 'Question' cut never fires); "
        "any_case = also cut the output at 'question' in any case",
    )
    ap.add_argument(
        "--prompts",
        default=None,
        metavar="FILE.json",
        help="babilong: your own prompt set {qa: {instruction, examples, post_prompt}} (default: canonlm's own texts)",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--precision",
        default="auto",
        help="auto = the run's training precision (trainer.precision); or 32-true | bf16-mixed | "
        "bf16-true | 16-mixed | 64-true | fp32 (= 32-true) | bf16 (= bf16-mixed)",
    )
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass")
    ap.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="positions of the rebuilt model (default: enough for the longest prompt)",
    )
    ap.add_argument("--out", default=None, help="results JSON (default <run dir>/reallife_<task>.json)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    try:
        return _main(a)
    except (EvalError, ConfigError, FileNotFoundError, FileExistsError, ValueError, ImportError) as e:
        print(f"canonlm.eval.reallife: error: {e}", file=sys.stderr)
        return 2


def _main(a: argparse.Namespace) -> int:
    from canonlm.data.reallife import as_decoder, as_encoder
    from canonlm.data.text import load_tokenizer
    from canonlm.config.rundir import resolve_run, run_tokenizer, task_config
    from canonlm.eval.load import check_precision, load_model

    t0 = time.perf_counter()
    log = (lambda s: None) if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    check_precision(a.precision, "--precision")
    if a.num_prompts < 1:
        raise EvalError(f"--num-prompts {a.num_prompts}: must be >= 1")
    run_dir, ck = resolve_run(a.run, a.ckpt)
    out = Path(a.out) if a.out else run_dir / f"reallife_{a.task}.json"
    if out.exists() and not a.force:
        raise EvalError(f"--out {out} exists; pass --force to replace it")

    # tokenizer: explicit, else the run's text task (the task as load_model gives it: the run's config, or the
    # checkpoint's recorded task for a checkpoint without one, e.g. an imported Hugging Face model)
    task_cfg = task_config(run_dir, ck)
    tok_path, eos_tok = a.tokenizer, a.eos_token
    if tok_path is None:
        tok_path, rec_eos = run_tokenizer(task_cfg)
        eos_tok = eos_tok or rec_eos
        if tok_path is None:
            if task_cfg.get("name") == "hf_import":
                src = task_cfg.get("source")
                hint = (
                    f" (e.g. {Path(src) / 'tokenizer.json'})"
                    if src and (Path(src) / "tokenizer.json").is_file()
                    else ""
                )
                raise EvalError(
                    f"--tokenizer is required: {ck} is a model imported from Hugging Face "
                    f"({src}) and records no tokenizer; pass --tokenizer PATH{hint}"
                )
            raise EvalError(f"--tokenizer is required: the run's task {task_cfg.get('name')!r} records no tokenizer")
    tok = load_tokenizer(tok_path, eos_token=eos_tok)
    encode, decode = _memo(as_encoder(tok)), as_decoder(tok)
    stop = (tok.eos_id,) if tok.eos_id is not None else ()
    max_new = a.max_new_tokens or (8 if a.task == "multihop" else 20)

    # build every prompt first (fails early on bad inputs; sizes the model)
    if a.task == "multihop":
        from canonlm.data.reallife.multihop import LENGTHS, MultiHopBuilder, evaluate_multihop

        if not a.background:
            raise EvalError("--background is required for --task multihop (a local text file)")
        lengths = _ints(a.lengths, "lengths") if a.lengths else list(LENGTHS)
        hops = _ints(a.hops, "hops")
        if not set(hops) <= {1, 2}:
            raise EvalError(f"--hops {a.hops!r}: allowed 1, 2")
        builder = MultiHopBuilder(
            encode,
            a.background,
            names_dir=a.names_dir,
            seed=a.seed,
            length_count=a.length_count,
            ensure_full_background=a.ensure_full_background,
            query=a.query,
            splitter=a.splitter,
            newline=a.newline,
        )
        longest = 0
        for hop in hops:
            for L in lengths:
                longest = max(longest, max(len(p.ids) for p in builder.build_many(hop, L, a.num_prompts)))
        settings = dict(
            builder.settings(),
            hops=hops,
            lengths=lengths,
            background=str(Path(a.background).resolve()),
            names_dir=a.names_dir,
            max_new_tokens=max_new,
            decoding="greedy",
            metric="first 4-digit number of the continuation == target year",
        )
    else:
        from canonlm.data.reallife.babilong import (
            LENGTHS,
            TASKS,
            build_prompt,
            evaluate_babilong,
            length_name,
            load_babilong,
            load_prompts,
        )

        if not a.babilong_dir:
            raise EvalError("--babilong-dir is required for --task babilong (local Babilong data)")
        lengths = [length_name(x) for x in a.lengths.split(",")] if a.lengths else list(LENGTHS)
        qas = [q.strip() for q in a.qa.split(",") if q.strip()]
        bad = [q for q in qas if q not in TASKS]
        if bad or not qas:
            raise EvalError(f"--qa {a.qa!r}: allowed {', '.join(TASKS)}")
        prompts, prompts_info = None, dict(source="canonlm", file=None, sha256=None)
        if a.prompts:
            prompts, digest = load_prompts(a.prompts, qas)
            prompts_info = dict(source="file", file=str(Path(a.prompts).resolve()), sha256=digest)
        longest = 0
        for qa in qas:
            for ln in lengths:
                for s in load_babilong(a.babilong_dir, qa, ln, limit=a.num_prompts):
                    longest = max(longest, len(encode(build_prompt(s, prompts=prompts))))
        settings = dict(
            qas=qas,
            lengths=lengths,
            babilong_dir=str(Path(a.babilong_dir).resolve()),
            max_new_tokens=max_new,
            decoding="greedy",
            question_cut=a.question_cut,
            prompts=prompts_info,
            metric="babilong compare_answers: target is the only task label in the first sentence",
        )

    need = longest + max_new
    msl = a.max_seq_len or max(int(task_cfg.get("context") or 0), need)
    lm_run = load_model(
        run_dir, ckpt=ck, device=a.device, batch_size=a.batch_size, precision=a.precision, max_seq_len=msl
    )
    if tok.vocab_size > lm_run.model_cfg.vocab_size:
        raise EvalError(
            f"tokenizer {tok_path} has {tok.vocab_size} ids but the model only {lm_run.model_cfg.vocab_size}"
        )
    if need > lm_run.model_cfg.max_seq_len:
        log(
            f"warning: prompts need {need} positions, the model accepts {lm_run.model_cfg.max_seq_len}; "
            "longer prompts are truncated"
        )
    if need > lm_run.trained_context:
        log(
            f"note: prompts up to {longest} tokens exceed the trained context {lm_run.trained_context} "
            "(length generalisation)"
        )

    if a.task == "multihop":
        res = evaluate_multihop(
            lm_run.lm,
            builder,
            decode,
            hops=hops,
            lengths=lengths,
            num_prompts=a.num_prompts,
            max_new_tokens=max_new,
            stop_ids=stop,
            log=log,
        )
        table = format_multihop_table(res, a.num_prompts)
    else:
        res = evaluate_babilong(
            lm_run.lm,
            encode,
            decode,
            a.babilong_dir,
            qas=qas,
            lengths=lengths,
            num_prompts=a.num_prompts,
            max_new_tokens=max_new,
            stop_ids=stop,
            question_cut=a.question_cut,
            prompts=prompts,
            log=log,
        )
        table = format_babilong_table(res, a.num_prompts)
    result = dict(
        task=a.task,
        model=lm_run.describe(),
        tokenizer=tok.describe(),
        settings=settings,
        num_prompts=a.num_prompts,
        longest_prompt=longest,
        time_s=round(time.perf_counter() - t0, 2),
        **res,
    )
    write_json_atomic(out, result, force=a.force)
    print(table, flush=True)
    print(f"results: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
