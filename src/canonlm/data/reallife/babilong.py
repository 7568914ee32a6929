"""Babilong qa1-qa5 prompts from local data, and the label scorer (official `data-reallife-eval/Babilong/prompts.py`).

Data (never downloaded at run time): Babilong-format records ``{"input": <context>, "question": ..., "target": ...}``
per task ``qa1..qa5`` and length (``0k``, ``1k``, ``2k``, ``4k``, ...). :func:`find_babilong_file` accepts the layouts
of the public releases: ``<root>/<qa>/<length>.json`` (RMT-team/babilong: a JSON array, or JSON lines),
``<root>/<length>/<qa>.json[l]``, ``<root>/<qa>_<length>.json[l]`` and ``<root>/<length>/<qa>-*.parquet``
(babilong-1k-samples; needs pyarrow).

Prompt (the release's qa1-qa5 variant): the answer-format sentence lives in the instruction, the few-shot
examples are ``<context>\\n...\\n</context>\\n\\nQuestion: ...\\nAnswer: ...`` blocks, the post-prompt is empty, and
:data:`TEMPLATE` (``{instruction}\\n\\n{examples}\\n\\n{post_prompt}<context>\\n{context}\\n</context>\\n\\n``
``Question: {question}\\nAnswer: ``) is filled and stripped, so prompts end in ``Answer:`` without the trailing
space. The instruction and example texts below are canonlm's own (equivalent in role to the release's, not
copied).

Own prompts: :func:`load_prompts` reads a JSON file with the structure of :data:`PROMPTS` (``{"qa1":
{"instruction": ..., "examples": ..., "post_prompt": ...}, ...}``, e.g. the Babilong authors' Apache-2.0 prompts
converted to JSON) and returns it with the file's sha256; pass it as ``prompts=`` to :func:`build_prompt` /
:func:`evaluate_babilong` (CLI: ``python -m canonlm.eval.reallife --task babilong --prompts FILE.json``; the results
JSON records the file and its sha256).

Scoring (Babilong's ``compare_answers`` semantics, written independently): lower-case the output, keep the text
before the first ``.``, cut at ``<context>`` and ``<example>``, then at ``"Question"`` (see below); collect the task
labels that occur (substring match) in that text, drop those that occur in the question; correct iff the target is
the only label left. The ``question_cut`` switch (API argument, CLI ``--question-cut``):

* ``"verbatim"`` (default): exactly what ``compare_answers`` does -- it searches for ``"Question"`` in the output it
  has already lower-cased, which never matches, so in effect no cut happens there (an output that rambles on into a
  new "Question: ..." line keeps that text, and any label in it counts).
* ``"any_case"``: cut at "question" in any case, the evident intent of that cut (more lenient: trailing
  "Question: ..." text is ignored).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

ROOMS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")
TASK_LABELS: dict[str, tuple[str, ...]] = {
    "qa1": ROOMS,
    "qa2": ROOMS,
    "qa3": ROOMS,
    "qa4": ROOMS,
    "qa5": ("Bill", "Fred", "Jeff", "Mary", "apple", "football", "milk"),
}
TASKS = tuple(TASK_LABELS)
LENGTHS = ("0k", "1k", "2k", "4k")
TEMPLATE = (
    "{instruction}\n\n{examples}\n\n{post_prompt}<context>\n{context}\n</context>\n\nQuestion: {question}\nAnswer: "
)
QUESTION_CUTS = ("verbatim", "any_case")  # the first is the default (compare_answers semantics)
PROMPT_KEYS = ("instruction", "examples", "post_prompt")


def _example(context: str, question: str, answer: str) -> str:
    return f"<context>\n{context}\n</context>\n\nQuestion: {question}\nAnswer: {answer}"


_INTRO = (
    "The context below is a long stretch of unrelated text. A few short statements {what} are hidden in it. "
    "Ignore the rest of the text and answer the question using only those statements. "
)

PROMPTS: dict[str, dict[str, str]] = {
    "qa1": dict(
        instruction=_INTRO.format(what="saying where people go")
        + "A person who moved several times is now at the last place mentioned for them. "
        "Reply with one sentence of the form: NAME is in the PLACE.",
        examples="\n\n".join(
            [
                _example(
                    "Lena walked to the garden. Omar headed to the office. Lena ran to the kitchen.",
                    "Where is Lena?",
                    "Lena is in the kitchen.",
                ),
                _example(
                    "Pavel strolled into the bedroom. Ines hurried to the hallway. Pavel wandered to the bathroom. "
                    "Ines drifted back to the office.",
                    "Where is Ines?",
                    "Ines is in the office.",
                ),
            ]
        ),
        post_prompt="",
    ),
    "qa2": dict(
        instruction=_INTRO.format(what="about people moving between places and picking up or putting down objects")
        + "An object someone is holding travels with them; an object that was put down stays where it was left. "
        "Reply with one sentence of the form: The OBJECT is in the PLACE.",
        examples="\n\n".join(
            [
                _example(
                    "Nora went to the hallway. Nora took the umbrella. Nora walked to the bedroom.",
                    "Where is the umbrella?",
                    "The umbrella is in the bedroom.",
                ),
                _example(
                    "Theo picked up the cup. Theo went to the garden. Theo put down the cup. Theo moved to the office.",
                    "Where is the cup?",
                    "The cup is in the garden.",
                ),
            ]
        ),
        post_prompt="",
    ),
    "qa3": dict(
        instruction=_INTRO.format(what="about people moving between places and carrying objects")
        + "An object someone is holding travels with them; an object that was put down stays where it was left. "
        "Reply with one sentence of the form: Before the PLACE, the OBJECT was in the EARLIER PLACE.",
        examples="\n\n".join(
            [
                _example(
                    "Ida grabbed the lamp. Ida went to the hallway. Ida travelled to the bathroom.",
                    "Where was the lamp before the bathroom?",
                    "Before the bathroom, the lamp was in the hallway.",
                ),
                _example(
                    "Marco went to the kitchen. Marco lifted the basket. Marco went to the garden. Marco dropped the "
                    "basket. Marco headed to the office.",
                    "Where was the basket before the garden?",
                    "Before the garden, the basket was in the kitchen.",
                ),
            ]
        ),
        post_prompt="",
    ),
    "qa4": dict(
        instruction=_INTRO.format(what="about how places are arranged relative to each other")
        + "Reply with a single word: the name of the place.",
        examples="\n\n".join(
            [
                _example(
                    "The garden is north of the hallway. The office is south of the hallway.",
                    "What is the hallway north of?",
                    "office",
                ),
                _example(
                    "The bedroom is west of the bathroom. The kitchen is east of the bathroom.",
                    "What is west of the bathroom?",
                    "bedroom",
                ),
            ]
        ),
        post_prompt="",
    ),
    "qa5": dict(
        instruction=_INTRO.format(what="about people moving and handing objects to each other")
        + "Reply with a single word: a person or an object.",
        examples="\n\n".join(
            [
                _example(
                    "Anna took the book there. Anna handed the book to Pablo. Pablo went to the garden.",
                    "Who received the book?",
                    "Pablo",
                ),
                _example(
                    "Karl grabbed the key there. Karl gave the key to Rosa. Rosa walked to the kitchen.",
                    "What did Karl give to Rosa?",
                    "key",
                ),
                _example(
                    "Lisa picked up the ball there. Lisa went to the hallway. Lisa passed the ball to Ben.",
                    "Who gave the ball?",
                    "Lisa",
                ),
            ]
        ),
        post_prompt="",
    ),
}


@dataclass
class BabilongSample:
    """One Babilong record: ``input`` (the context), ``question``, ``target`` (the answer label), and where it came
    from (qa task, length name, record index)."""

    input: str
    question: str
    target: str
    qa: str
    length: str
    index: int


# ============================================================================================== loading
def length_name(x: int | str) -> str:
    """Canonical Babilong length name: 0 / 1000 / "1k" / "1K" -> "0k" / "1k"; "1m" / 1000000 -> "1M".
    ValueError for anything else."""
    if isinstance(x, str):
        s = x.strip()
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmM]?)", s)
        if not m:
            raise ValueError(f"length={x!r} is not allowed; allowed: e.g. 0k, 1k, 2k, 4k or a token count")
        if not m.group(2):
            return length_name(int(float(m.group(1))))
        v = m.group(1)
        return f"{v}{'M' if m.group(2) in 'mM' else 'k'}"
    n = int(x)
    if n < 0:
        raise ValueError(f"length={x!r} is not allowed; allowed: >= 0")
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n % 1000 == 0:
        return f"{n // 1000}k"
    if n % 500 == 0:
        return f"{n / 1000:g}k"
    raise ValueError(f"length={x!r} is not allowed; allowed: a multiple of 500 tokens (0k, 0.5k, 1k, ...)")


def find_babilong_file(root: str | Path, qa: str, length: int | str) -> Path:
    """The data file of (qa, length) under ``root`` (layouts in the module docstring). FileNotFoundError listing the
    paths tried.

    Search order (fixed, so the choice never depends on the interpreter's hash seed): the length spellings
    canonical (``length_name``), lower-case, upper-case (duplicates dropped), and for each spelling ``.json`` before
    ``.jsonl`` and the layouts ``<qa>/<length>``, ``<length>/<qa>``, ``<qa>_<length>``; parquet folders last."""
    r = Path(root)
    ln = length_name(length)
    names = tuple(dict.fromkeys((ln, ln.lower(), ln.upper())))  # ordered de-duplication
    cands = []
    for name in names:
        for ext in (".json", ".jsonl"):
            cands += [r / qa / f"{name}{ext}", r / name / f"{qa}{ext}", r / f"{qa}_{name}{ext}"]
    for c in cands:
        if c.is_file():
            return c
    for name in names:
        pq = sorted((r / name).glob(f"{qa}-*.parquet")) if (r / name).is_dir() else []
        if pq:
            return pq[0]
    raise FileNotFoundError(
        f"babilong: no data for {qa} {ln} under {root} (tried e.g. {cands[0]}, {cands[1]}, "
        f"{cands[2]}, {r / ln / (qa + '-*.parquet')})"
    )


def _records(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("babilong: reading parquet needs pyarrow (pip install pyarrow)") from None
        recs: list[dict[str, Any]] = []
        for f in sorted(path.parent.glob(path.name.split("-")[0] + "-*.parquet")):
            recs += pq.read_table(f).to_pylist()
        return recs
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    obj = None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        pass
    if isinstance(obj, dict):  # {"data": [...]} or a column layout {"input": [...], ...}
        if "data" in obj and isinstance(obj["data"], list):
            return obj["data"]
        if all(isinstance(obj.get(k), list) for k in ("input", "question", "target")):
            return [
                dict(input=i, question=q, target=t) for i, q, t in zip(obj["input"], obj["question"], obj["target"])
            ]
        return [obj]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_babilong(root: str | Path, qa: str, length: int | str, limit: int | None = None) -> list[BabilongSample]:
    """Records of (qa, length) from local Babilong data (first ``limit`` records if given).

    Raises ValueError for an unknown qa (allowed: qa1..qa5) or a record without input/question/target,
    FileNotFoundError when the data file is missing."""
    if qa not in TASK_LABELS:
        raise ValueError(f"qa={qa!r} is not allowed; allowed: {' | '.join(TASKS)}")
    path = find_babilong_file(root, qa, length)
    out = []
    for n, rec in enumerate(_records(path)):
        if limit is not None and n >= limit:
            break
        missing = [k for k in ("input", "question", "target") if k not in rec]
        if missing:
            raise ValueError(f"babilong: {path} record {n} lacks {', '.join(missing)}")
        out.append(
            BabilongSample(
                input=str(rec["input"]),
                question=str(rec["question"]),
                target=str(rec["target"]),
                qa=qa,
                length=length_name(length),
                index=n,
            )
        )
    return out


# ============================================================================================== prompts
def validate_prompts(prompts: Any, qas: Sequence[str] = TASKS, source: str = "prompts") -> dict[str, dict[str, str]]:
    """Check a prompt set: a dict ``{qa: {"instruction": str, "examples": str, "post_prompt": str}}`` holding every
    task of ``qas`` (extra ``qaN`` entries, e.g. qa6..qa20 of Babilong's set, are allowed and unused). Returns the
    entries of ``qas`` as plain dicts. Raises ValueError naming ``source``, the entry and what is expected."""
    want = 'an object {"qa1": {"instruction": ..., "examples": ..., "post_prompt": ...}, ...}'
    if not isinstance(prompts, dict):
        raise ValueError(f"{source}: expected {want}, got a JSON {type(prompts).__name__}")
    bad = [k for k in prompts if not (isinstance(k, str) and re.fullmatch(r"qa\d+", k))]
    if bad:
        raise ValueError(f"{source}: unknown key(s) {', '.join(map(repr, bad))}; allowed: task names qa1, qa2, ...")
    missing = [qa for qa in qas if qa not in prompts]
    if missing:
        raise ValueError(f"{source}: no prompt for {', '.join(missing)} (needed: {', '.join(qas)})")
    out: dict[str, dict[str, str]] = {}
    for qa in qas:
        p = prompts[qa]
        if not isinstance(p, dict):
            raise ValueError(
                f"{source}: {qa} must be an object with keys {', '.join(PROMPT_KEYS)}, got {type(p).__name__}"
            )
        lack = [k for k in PROMPT_KEYS if k not in p]
        extra = [k for k in p if k not in PROMPT_KEYS]
        if lack or extra:
            raise ValueError(
                f"{source}: {qa} has keys {sorted(p)}; expected exactly {', '.join(PROMPT_KEYS)}"
                + (f" (missing {', '.join(lack)})" if lack else "")
                + (f" (unknown {', '.join(map(repr, extra))})" if extra else "")
            )
        for k in PROMPT_KEYS:
            if not isinstance(p[k], str):
                raise ValueError(f"{source}: {qa}.{k} must be a string, got {type(p[k]).__name__}")
        out[qa] = {k: p[k] for k in PROMPT_KEYS}
    return out


def load_prompts(path: str | Path, qas: Sequence[str] = TASKS) -> tuple[dict[str, dict[str, str]], str]:
    """A user prompt set from a JSON file with the structure of :data:`PROMPTS` (see :func:`validate_prompts`).

    Returns (prompts of ``qas``, sha256 hex digest of the file's bytes). Raises FileNotFoundError for a missing file,
    ValueError (naming the file) for a file that is not UTF-8 JSON or does not have the expected structure."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"prompts: {path} does not exist (expected a JSON file like "
            '{"qa1": {"instruction": ..., "examples": ..., "post_prompt": ...}})'
        )
    raw = p.read_bytes()
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts: {path} is not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"prompts: {path}:{e.lineno}: invalid JSON: {e.msg}") from None
    return validate_prompts(obj, qas, source=f"prompts {path}"), hashlib.sha256(raw).hexdigest()


def format_prompt(
    context: str,
    question: str,
    *,
    instruction: str = "",
    examples: str = "",
    post_prompt: str = "",
    template: str = TEMPLATE,
) -> str:
    """Fill ``template`` and strip the result (so the prompt ends in ``Answer:``)."""
    return template.format(
        instruction=instruction, examples=examples, post_prompt=post_prompt, context=context, question=question
    ).strip()


def build_prompt(
    sample: BabilongSample,
    *,
    use_instruction: bool = True,
    use_examples: bool = True,
    use_post_prompt: bool = True,
    prompts: dict[str, dict[str, str]] | None = None,
) -> str:
    """The prompt of one sample with canonlm's own texts (:data:`PROMPTS`), or with ``prompts`` (a user set, e.g.
    from :func:`load_prompts`). ValueError if ``prompts`` has no entry for ``sample.qa``."""
    table = PROMPTS if prompts is None else prompts
    if sample.qa not in table:
        raise ValueError(f"prompts: no entry for {sample.qa} (have {', '.join(sorted(table)) or 'none'})")
    p = table[sample.qa]
    return format_prompt(
        sample.input,
        sample.question,
        instruction=p["instruction"] if use_instruction else "",
        examples=p["examples"] if use_examples else "",
        post_prompt=p["post_prompt"] if use_post_prompt else "",
    )


# ============================================================================================== scoring
def preprocess_output(output: str, question_cut: str = "verbatim") -> str:
    """Lower-case, keep the text before the first ``.``, cut at ``<context>``, ``<example>`` and "Question".

    ``question_cut``: ``verbatim`` (default; compare_answers: the search for "Question" in the lower-cased text never
    matches, so nothing is cut there) | ``any_case`` (cut at "question" in any case). ValueError otherwise."""
    if question_cut not in QUESTION_CUTS:
        raise ValueError(f"question_cut={question_cut!r} is not allowed; allowed: {' | '.join(QUESTION_CUTS)}")
    out = output.lower().split(".")[0]
    out = out.split("<context>")[0].split("<example>")[0]
    return out.split("question" if question_cut == "any_case" else "Question")[0]


def score_babilong(
    output: str, target: str, question: str, labels: Sequence[str], *, question_cut: str = "verbatim"
) -> bool:
    """True iff the target is the only task label in the preprocessed output once the labels mentioned in the
    question are removed (all comparisons lower-case, substring matches). ``question_cut``: see
    :func:`preprocess_output` (default ``verbatim`` = compare_answers)."""
    out = preprocess_output(output, question_cut)
    labs = {x.lower() for x in labels}
    q = question.lower()
    in_output = {x for x in labs if x in out} - {x for x in labs if x in q}
    return target.lower() in in_output and len(in_output) == 1


def evaluate_babilong(
    lm: Any,
    encode: Callable[[str], list[int]],
    decode: Callable[[Sequence[int]], str],
    root: str | Path,
    *,
    qas: Sequence[str] = TASKS,
    lengths: Sequence[int | str] = LENGTHS,
    num_prompts: int | None = 100,
    max_new_tokens: int = 20,
    stop_ids: Sequence[int] = (),
    question_cut: str = "verbatim",
    prompts: dict[str, dict[str, str]] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Greedy Babilong accuracy of ``lm`` (:class:`canonlm.data.lm.LanguageModel`) per qa task and length.

    ``question_cut``: the scorer switch (:func:`preprocess_output`; default ``verbatim``). ``prompts``: a user prompt
    set (:func:`load_prompts`; None = canonlm's :data:`PROMPTS`).
    Returns ``{"accuracy": {qa: {length: acc}}, "counts": {qa: {length: [correct, n]}}, "samples": [...]}``.
    Raises FileNotFoundError for missing data files, ValueError for an unknown qa / question_cut or a prompt set
    without an entry for a task of ``qas`` (all checked before any generation).
    """
    if question_cut not in QUESTION_CUTS:
        raise ValueError(f"question_cut={question_cut!r} is not allowed; allowed: {' | '.join(QUESTION_CUTS)}")
    for qa in qas:
        if qa not in TASK_LABELS:
            raise ValueError(f"qa={qa!r} is not allowed; allowed: {' | '.join(TASKS)}")
    if prompts is not None:
        prompts = validate_prompts(prompts, qas)
    for qa in qas:  # fail before any generation if a file is missing
        for L in lengths:
            find_babilong_file(root, qa, L)
    acc: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, list[int]]] = {}
    samples: list[dict[str, Any]] = []
    for qa in qas:
        acc[qa], counts[qa] = {}, {}
        for L in lengths:
            ln = length_name(L)
            data = load_babilong(root, qa, ln, limit=num_prompts)
            texts = [build_prompt(s, prompts=prompts) for s in data]
            outs = lm.generate(
                [np.asarray(encode(p), dtype=np.int64) for p in texts],
                max_new_tokens,
                stop_ids=stop_ids,
                temperature=0.0,
            )
            right = 0
            for s, o in zip(data, outs):
                text = decode(o)
                ok = score_babilong(text, s.target, s.question, TASK_LABELS[qa], question_cut=question_cut)
                right += ok
                samples.append(dict(qa=qa, length=ln, index=s.index, target=s.target, output=text, correct=bool(ok)))
            acc[qa][ln] = right / max(len(data), 1)
            counts[qa][ln] = [right, len(data)]
            if log:
                log(f"babilong {qa} {ln}: {right}/{len(data)} = {100 * acc[qa][ln]:.1f}%")
    return {"accuracy": acc, "counts": counts, "samples": samples}


__all__ = [
    "TASK_LABELS",
    "TASKS",
    "LENGTHS",
    "TEMPLATE",
    "PROMPTS",
    "PROMPT_KEYS",
    "QUESTION_CUTS",
    "BabilongSample",
    "length_name",
    "find_babilong_file",
    "load_babilong",
    "validate_prompts",
    "load_prompts",
    "format_prompt",
    "build_prompt",
    "preprocess_output",
    "score_babilong",
    "evaluate_babilong",
]
