"""Multi-hop birth-year prompts (1-hop-L, 2-hop-L) and their scorer (paper App. B; official `multihop-birthyear.py`).

One prompt of ``hop`` in {1, 2}, background length ``L`` tokens and index ``i`` (a pure function of
(seed, hop, L, i), the background text, the name lists and the tokenizer, so every model sees identical prompts):

1. (N, k) = (5, 1) for 1-hop, (3, 2) for 2-hop. N*k distinct full names "first middle last" from the Capo name lists;
   N years drawn without replacement from 1950..2009. Group 1: "``{name} was born in the year of {year}.``" for the
   N first names; 2-hop group 2: "``{name2} was born in the same year as {name1}.``" with a random bijection
   name2_j -> name1_perm[j]. Groups in order (group 1, then group 2). Names, years and the bijection depend on
   (seed, hop, i) only, so the same people are asked about at every L (only the background changes).
2. Queried person: the first person of the last group (``query: first``, the release's behaviour behind the paper's
   numbers), or a uniformly random one (``query: random``). Target: their year (2-hop: the year of their partner).
3. Background: a random start sentence of the local background corpus (split into sentences by
   :func:`split_sentences`; by default every line break ends a sentence, ``newline: boundary`` -- see there), then
   the following sentences while the running token count stays < L (no wrap-around). ``length_count:
   per_sentence`` (release) counts each sentence tokenized alone; ``joined`` counts the background sentences joined
   with spaces. When the corpus ends first the background falls short: ``ensure_full_background: true`` (default)
   redraws the start sentence, ``false`` keeps the short background (release behaviour).
4. The statements are inserted at random gaps between background sentences (sorted gap indices, so their order is
   kept; several may share a gap), everything joined with single spaces.
5. Prompt: 1-hop ``text + " " + "\\n\\nAnswer me: {name} was born in the year of "`` (trailing space kept);
   2-hop ``INSTRUCTION_2HOP + "<context>" + text + "</context>" + "\\n\\nAnswer me: {name} was born in the year of "``.

Scoring (canonlm's choice, unstated in the paper): greedy decoding of ``max_new_tokens = 8`` tokens; correct iff the
first 4-digit number of the decoded continuation equals the target year. Chance for 2-hop: 1/3 (three candidate
years).

Randomness: counter-based SplitMix64 draws keyed by (seed, hop, index) for the facts and (seed, hop, L, index) for the
background (:mod:`canonlm.data.seeding`'s scheme, in pure Python integers; no global RNG).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from canonlm.data import ConfigError
from canonlm.data.reallife import as_encoder
from canonlm.data.seeding import stable_hash64

QUESTION = "\n\nAnswer me: {name} was born in the year of "
STATEMENT = "{name} was born in the year of {year}."
EQUIVALENCE = "{name2} was born in the same year as {name1}."
INSTRUCTION_2HOP = (
    "You will be asked questions about people's birth years, and the birth year descriptions are "
    "hidden in some random text. Some people's birth years are directly given, while others are given "
    "in the form that `name1' was born in the same year as `name2'.\n\n"
)
HOPS = {1: (5, 1), 2: (3, 2)}  # hop -> (N, k)
LENGTHS = (0, 1000, 2000, 3000, 4000, 5000, 6000)
YEARS = (1950, 2009)
LENGTH_COUNTS = ("per_sentence", "joined")
QUERIES = ("first", "random")
SPLITTERS = ("regex", "nltk")
NEWLINES = ("boundary", "space")  # the first is the default
_MAX_NAME_DRAWS = 20_000
_YEAR_RE = re.compile(r"(?<!\d)\d{4}(?!\d)")


# ============================================================================================== sentences
_ABBREV = frozenset(
    """mr mrs ms dr prof sr jr st mt ft vs etc al fig figs vol vols no nos inc ltd co corp dept est
gen col lt sgt capt cmdr adm gov rev hon pres jan feb mar apr jun jul aug sep sept oct nov dec approx ca cf ed eds
op pp""".split()
)
_BOUNDARY = re.compile(r"([.!?]+)([\"'\u201d\u2019)\]]*)\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9])")


def _blocks(text: str, newline: str) -> list[str]:
    """The units no sentence crosses: lines (``boundary``) or blank-line separated paragraphs (``space``)."""
    if newline not in NEWLINES:
        raise ConfigError("multihop.newline", newline, " | ".join(NEWLINES))
    return text.splitlines() if newline == "boundary" else re.split(r"\n\s*\n", text)


def split_sentences(text: str, newline: str = "boundary") -> list[str]:
    """Split text into sentences without any model or network (a simple, deterministic regex splitter).

    ``newline``: ``boundary`` (default) -- every line break ends a sentence, as in one-article-per-line dumps and
    extracted Wikipedia text, where headings and list items stand on their own line without a full stop (they would
    otherwise be glued to the next sentence); ``space`` -- only blank lines separate paragraphs and a single line break
    is an ordinary space (hard-wrapped prose, e.g. Project Gutenberg books). Inside a unit all whitespace runs become
    single spaces. A sentence ends at ``.``/``!``/``?`` (plus closing quotes/brackets) followed by whitespace and an
    upper-case letter, digit or opening quote -- except after a known abbreviation (Mr., Dr., St., e.g., ...), a
    single-letter initial ("J.") or a dotted acronym ("U.S."). Returns the list of non-empty sentences (stripped).
    Raises ConfigError("multihop.newline") for another ``newline``.
    """
    out: list[str] = []
    for para in _blocks(text, newline):
        para = " ".join(para.split())
        if not para:
            continue
        start = 0
        for m in _BOUNDARY.finditer(para):
            if m.group(1) == ".":
                w = re.search(r"(\S+)$", para[start : m.start(1)])
                word = w.group(1).lower().lstrip("(\"'") if w else ""
                if word in _ABBREV or (len(word) == 1 and word.isalpha()) or "." in word:
                    continue
            s = para[start : m.end(2)].strip()
            if s:
                out.append(s)
            start = m.end()
        tail = para[start:].strip()
        if tail:
            out.append(tail)
    return out


def _split_nltk(text: str, newline: str = "boundary") -> list[str]:
    try:
        import nltk
        from nltk.tokenize import sent_tokenize
    except ImportError:
        raise ConfigError("multihop.splitter", "nltk", "regex (nltk is not installed)") from None
    try:
        nltk.data.find("tokenizers/punkt")
    except LookupError:
        raise ConfigError(
            "multihop.splitter", "nltk", "regex, or install the punkt data offline first (no download at run time)"
        ) from None
    return [" ".join(s.split()) for para in _blocks(text, newline) for s in sent_tokenize(para) if s.strip()]


def load_background(
    path: str | Path, splitter: str = "regex", text_key: str = "text", newline: str = "boundary"
) -> list[str]:
    """Sentences of a local background file (a Wikipedia dump or any prose), in file order.

    ``.jsonl`` files: one JSON object per line, text in ``text_key`` (documents split separately); anything else is
    read as UTF-8 text. ``splitter``: ``regex`` (:func:`split_sentences`) | ``nltk`` (punkt, only if installed with its
    data; never downloads). ``newline``: ``boundary`` (default: a line break ends a sentence) | ``space`` (see
    :func:`split_sentences`). Raises FileNotFoundError for a missing file, ConfigError("multihop.splitter" /
    "multihop.newline") for an unknown/unavailable splitter or newline mode, ValueError for a file without sentences.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"background: {path} does not exist (give a local text file)")
    if splitter not in SPLITTERS:
        raise ConfigError("multihop.splitter", splitter, " | ".join(SPLITTERS))
    if newline not in NEWLINES:
        raise ConfigError("multihop.newline", newline, " | ".join(NEWLINES))
    base = split_sentences if splitter == "regex" else _split_nltk

    def split(text: str) -> list[str]:
        return base(text, newline)

    if p.suffix in (".jsonl", ".ndjson"):
        sents: list[str] = []
        with open(p, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    sents.extend(split(str(json.loads(line).get(text_key, ""))))
    else:
        sents = split(p.read_text(encoding="utf-8"))
    if not sents:
        raise ValueError(f"background: {path} holds no sentence")
    return sents


# ============================================================================================== names
def _default_names_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "tasks" / "capo_assets"


def unique_names(names: Sequence[str]) -> list[str]:
    """``names`` with whitespace runs collapsed to single spaces, blank entries dropped and repeats removed (first
    occurrence kept, order otherwise unchanged)."""
    return list(dict.fromkeys(n for n in (" ".join(str(x).split()) for x in names) if n))


def load_capo_names(names_dir: str | Path | None = None) -> tuple[list[str], list[str], list[str]]:
    """(first, middle, last) name lists of canonlm's Capo assets.

    Args: names_dir: folder with ``first_names.txt``, ``middle_names.txt``, ``last_names.txt`` (one name per line;
        ``*_name.txt`` also accepted); None = ``canonlm/data/tasks/capo_assets``.
    Returns the three lists de-duplicated (:func:`unique_names`: whitespace runs collapsed, blank lines and repeats
    dropped, first occurrence kept, file order otherwise).
    Raises FileNotFoundError naming the folder when a list is missing, ValueError for an empty list.
    """
    d = Path(names_dir) if names_dir is not None else _default_names_dir()
    out = []
    for part in ("first", "middle", "last"):
        f = next((d / n for n in (f"{part}_names.txt", f"{part}_name.txt") if (d / n).is_file()), None)
        if f is None:
            raise FileNotFoundError(f"names: no {part}_names.txt in {d} (pass names= or names_dir=)")
        names = unique_names(f.read_text(encoding="utf-8").splitlines())
        if not names:
            raise ValueError(f"names: {f} is empty")
        out.append(names)
    return out[0], out[1], out[2]


# ============================================================================================== prompts
@dataclass
class MultiHopPrompt:
    """One multi-hop prompt and the facts behind it.

    text: the prompt string; ids: its token ids (as the encoder returns them); target: the answer year; hop, L,
    index: coordinates; query_name: the person asked about; names1 / years: group 1 (names and their years, in
    statement order); names2 / perm: 2-hop group 2 and its bijection (names2[j] shares the year of names1[perm[j]]);
    statements: the problem sentences in order; background: (first sentence index, number of sentences) in the
    corpus; background_tokens: its length under the builder's counting mode; shortfall: the corpus ended before L
    was reached; tries: start sentences drawn.
    """

    text: str
    ids: Sequence[int]
    target: int
    hop: int
    L: int
    index: int
    query_name: str
    names1: list[str]
    years: list[int]
    names2: list[str] = field(default_factory=list)
    perm: list[int] = field(default_factory=list)
    statements: list[str] = field(default_factory=list)
    background: tuple[int, int] = (0, 0)
    background_tokens: int = 0
    shortfall: bool = False
    tries: int = 1


_M64 = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    """SplitMix64 finaliser on a Python int (same function as :func:`canonlm.data.seeding.mix64`)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class _Stream:
    """Counter-based random integers of one key: draw t is ``mix64(key + (t + 1) * G)`` (SplitMix64 outputs)."""

    __slots__ = ("key", "t")

    def __init__(self, key: int):
        self.key, self.t = key, 0

    def below(self, n: int) -> int:
        """Uniform integer in [0, n) (modulo bias < n / 2**64)."""
        self.t += 1
        return _mix((self.key + self.t * _G) & _M64) % n


def _key(base: int, *coords: int) -> int:
    k = base
    for c in coords:
        k = _mix((k + (int(c) + 1) * _G) & _M64)
    return k


class MultiHopBuilder:
    """Builds the multi-hop prompts (paper App. B) from a local background corpus with a pluggable tokenizer.

    Args:
        tokenizer: any callable ``text -> ids`` or a tokenizer with ``encode`` (see
            :func:`canonlm.data.reallife.as_encoder`); it counts background tokens and encodes the prompts.
        background: a local file path (:func:`load_background`) or a list of sentences.
        names: (first, middle, last) lists, de-duplicated here (:func:`unique_names`); None =
            :func:`load_capo_names` (``names_dir``).
        seed: prompt seed (default 0). length_count: ``per_sentence`` (default, release) | ``joined``.
        ensure_full_background: True (default) redraws the start sentence when the corpus ends before L is reached;
            False keeps the short background (release). query: ``first`` (default, release) | ``random``.
        splitter: ``regex`` | ``nltk`` (file backgrounds only). newline: ``boundary`` (default: a line break ends a
            sentence) | ``space`` (file backgrounds only; :func:`split_sentences`). max_tries: start sentences drawn
            before giving up.
    Raises ConfigError(``multihop.<key>``) for bad options, FileNotFoundError / ValueError for unusable inputs, and
        ValueError if the de-duplicated name lists give fewer distinct full names than a prompt needs (6).
    """

    def __init__(
        self,
        tokenizer: Any,
        background: str | Path | Sequence[str],
        *,
        names: tuple[Sequence[str], Sequence[str], Sequence[str]] | None = None,
        names_dir: str | Path | None = None,
        seed: int = 0,
        length_count: str = "per_sentence",
        ensure_full_background: bool = True,
        query: str = "first",
        splitter: str = "regex",
        newline: str = "boundary",
        max_tries: int = 1000,
    ):
        if length_count not in LENGTH_COUNTS:
            raise ConfigError("multihop.length_count", length_count, " | ".join(LENGTH_COUNTS))
        if query not in QUERIES:
            raise ConfigError("multihop.query", query, " | ".join(QUERIES))
        if not isinstance(ensure_full_background, bool):
            raise ConfigError("multihop.ensure_full_background", ensure_full_background, "true | false")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError("multihop.seed", seed, "an integer >= 0")
        if isinstance(max_tries, bool) or not isinstance(max_tries, int) or max_tries < 1:
            raise ConfigError("multihop.max_tries", max_tries, "an integer >= 1")
        if newline not in NEWLINES:
            raise ConfigError("multihop.newline", newline, " | ".join(NEWLINES))
        self.encode: Callable[[str], list[int]] = as_encoder(tokenizer)
        if isinstance(background, (str, Path)):
            self.sentences = load_background(background, splitter=splitter, newline=newline)
        else:
            self.sentences = [str(s) for s in background]
            if not self.sentences:
                raise ValueError("background: empty sentence list")
        first, middle, last = names if names is not None else load_capo_names(names_dir)
        self.first, self.middle, self.last = unique_names(first), unique_names(middle), unique_names(last)
        need = max(n * k for n, k in HOPS.values())
        sizes = (len(self.first), len(self.middle), len(self.last))
        if sizes[0] * sizes[1] * sizes[2] < need:
            raise ValueError(
                f"names: the lists hold {sizes[0]} first, {sizes[1]} middle and {sizes[2]} last distinct "
                f"names -> {sizes[0] * sizes[1] * sizes[2]} distinct full names, fewer than a prompt "
                f"needs ({need}); give longer name lists"
            )
        self.newline = newline
        self.seed = int(seed)
        self.length_count = length_count
        self.ensure_full_background = ensure_full_background
        self.query = query
        self.max_tries = max_tries
        self._len: dict[int, int] = {}
        self._base_facts = stable_hash64("canonlm-multihop-facts", self.seed)
        self._base_bg = stable_hash64("canonlm-multihop-background", self.seed)

    def settings(self) -> dict[str, Any]:
        """JSON-able description of the builder's switches."""
        return dict(
            seed=self.seed,
            length_count=self.length_count,
            ensure_full_background=self.ensure_full_background,
            query=self.query,
            newline=self.newline,
            sentences=len(self.sentences),
            years=list(YEARS),
        )

    # ------------------------------------------------------------------ background
    def sentence_tokens(self, i: int) -> int:
        """Tokens of background sentence i tokenized alone (cached)."""
        n = self._len.get(i)
        if n is None:
            n = self._len[i] = len(self.encode(self.sentences[i]))
        return n

    def _joined_tokens(self, s0: int, k: int) -> int:
        return len(self.encode(" ".join(self.sentences[s0 : s0 + k]))) if k else 0

    def take_background(self, s0: int, L: int) -> tuple[int, int, bool]:
        """From start sentence ``s0``: (k sentences taken, their token count, shortfall) under the counting mode:
        the largest k whose count stays < L (sentences added one by one); shortfall = the corpus ended first."""
        n = len(self.sentences)
        if self.length_count == "per_sentence":
            k = count = 0
            while s0 + k < n and count + self.sentence_tokens(s0 + k) < L:
                count += self.sentence_tokens(s0 + k)
                k += 1
            return k, count, s0 + k == n
        # joined: grow k exponentially until the joined count reaches L (or the corpus ends), then bisect
        if L <= 0:
            return 0, 0, False
        hi = 1
        while s0 + hi < n and self._joined_tokens(s0, hi) < L:
            hi *= 2
        hi = min(hi, n - s0)
        if self._joined_tokens(s0, hi) < L:
            return hi, self._joined_tokens(s0, hi), True
        lo = 0  # invariant: count(lo) < L <= count(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._joined_tokens(s0, mid) < L:
                lo = mid
            else:
                hi = mid
        return lo, self._joined_tokens(s0, lo), False

    # ------------------------------------------------------------------ prompts
    def build(self, hop: int, L: int, index: int) -> MultiHopPrompt:
        """Prompt ``index`` of (hop, L) -- a pure function of (seed, hop, L, index) and the inputs.

        Raises ValueError for hop not in {1, 2}, L < 0 or index < 0, or when no start sentence gives a full
        background of L tokens within ``max_tries`` draws (ensure_full_background)."""
        if hop not in HOPS:
            raise ValueError(f"hop={hop!r} is not allowed; allowed: 1 | 2")
        if int(L) < 0 or int(index) < 0:
            raise ValueError(f"L={L!r}, index={index!r}: both must be >= 0")
        L, index = int(L), int(index)
        N, k = HOPS[hop]
        rf = _Stream(_key(self._base_facts, hop, index))
        first, middle, last = self.first, self.middle, self.last
        names: list[str] = []
        draws = 0
        while len(names) < N * k:
            nm = f"{first[rf.below(len(first))]} {middle[rf.below(len(middle))]} {last[rf.below(len(last))]}"
            if nm not in names:
                names.append(nm)
            draws += 1
            if draws > _MAX_NAME_DRAWS:  # only if names with spaces collide ("Ann Marie"+"Lee" vs "Ann"+"Marie Lee")
                raise ValueError(
                    f"names: {draws} draws gave only {len(names)} distinct full names, a prompt needs "
                    f"{N * k}; give longer name lists (names containing spaces can coincide)"
                )
        pool = list(range(YEARS[0], YEARS[1] + 1))  # partial Fisher-Yates: N years without replacement
        for j in range(N):
            r = j + rf.below(len(pool) - j)
            pool[j], pool[r] = pool[r], pool[j]
        years = pool[:N]
        names1, names2 = names[:N], names[N:]
        statements = [STATEMENT.format(name=n, year=y) for n, y in zip(names1, years)]
        perm: list[int] = []
        if hop == 2:
            perm = list(range(N))  # Fisher-Yates: a uniform bijection
            for j in range(N - 1, 0, -1):
                r = rf.below(j + 1)
                perm[j], perm[r] = perm[r], perm[j]
            statements += [EQUIVALENCE.format(name2=names2[j], name1=names1[perm[j]]) for j in range(N)]
        q = 0 if self.query == "first" else rf.below(N)
        qname = names1[q] if hop == 1 else names2[q]
        target = years[q] if hop == 1 else years[perm[q]]

        rb = _Stream(_key(self._base_bg, hop, L, index))
        tries = 0
        while True:
            tries += 1
            s0 = rb.below(len(self.sentences))
            kb, count, short = self.take_background(s0, L)
            if not (short and self.ensure_full_background):
                break
            if tries >= self.max_tries:
                raise ValueError(
                    f"background: no start sentence reached L={L} tokens in {tries} draws "
                    f"({len(self.sentences)} sentences); use a longer background file"
                )
        bg = self.sentences[s0 : s0 + kb]
        gaps = sorted(rb.below(len(bg) + 1) for _ in statements)  # sorted gaps keep the statements' order
        pieces: list[str] = []
        prev = 0
        for st, g in zip(statements, gaps):
            pieces.extend(bg[prev:g])
            pieces.append(st)
            prev = g
        pieces.extend(bg[prev:])
        text = " ".join(pieces)
        question = QUESTION.format(name=qname)
        prompt = text + " " + question if hop == 1 else INSTRUCTION_2HOP + "<context>" + text + "</context>" + question
        return MultiHopPrompt(
            text=prompt,
            ids=self.encode(prompt),
            target=target,
            hop=hop,
            L=L,
            index=index,
            query_name=qname,
            names1=names1,
            years=years,
            names2=names2,
            perm=perm,
            statements=statements,
            background=(s0, kb),
            background_tokens=count,
            shortfall=short,
            tries=tries,
        )

    def build_many(self, hop: int, L: int, n: int, start: int = 0) -> list[MultiHopPrompt]:
        """Prompts ``start .. start+n-1`` of (hop, L)."""
        return [self.build(hop, L, i) for i in range(start, start + n)]


# ============================================================================================== scoring
def extract_year(text: str) -> int | None:
    """The first stand-alone 4-digit number in ``text`` (not part of a longer digit run), or None."""
    m = _YEAR_RE.search(text)
    return int(m.group(0)) if m else None


def score_multihop(output: str, target: int) -> bool:
    """True iff the first 4-digit number of the decoded continuation ``output`` equals ``target``."""
    return extract_year(output) == int(target)


def evaluate_multihop(
    lm: Any,
    builder: MultiHopBuilder,
    decode: Callable[[Sequence[int]], str],
    *,
    hops: Sequence[int] = (1, 2),
    lengths: Sequence[int] = LENGTHS,
    num_prompts: int = 100,
    max_new_tokens: int = 8,
    stop_ids: Sequence[int] = (),
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Greedy multi-hop accuracy of ``lm`` (:class:`canonlm.data.lm.LanguageModel`) per hop and L.

    Returns ``{"accuracy": {"1-hop": {L: acc}}, "counts": {"1-hop": {L: [correct, n]}}, "samples": [...]}`` (L keys
    are strings; samples hold hop, L, index, target, the decoded output, the extracted year and correctness).
    """
    acc: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, list[int]]] = {}
    samples: list[dict[str, Any]] = []
    for hop in hops:
        key = f"{hop}-hop"
        acc[key], counts[key] = {}, {}
        for L in lengths:
            prompts = builder.build_many(hop, L, num_prompts)
            outs = lm.generate(
                [np.asarray(p.ids, dtype=np.int64) for p in prompts], max_new_tokens, stop_ids=stop_ids, temperature=0.0
            )
            right = 0
            for p, o in zip(prompts, outs):
                text = decode(o)
                ok = score_multihop(text, p.target)
                right += ok
                samples.append(
                    dict(
                        hop=hop,
                        L=L,
                        index=p.index,
                        target=p.target,
                        output=text,
                        year=extract_year(text),
                        correct=bool(ok),
                        prompt_tokens=len(p.ids),
                        shortfall=p.shortfall,
                    )
                )
            acc[key][str(L)] = right / max(len(prompts), 1)
            counts[key][str(L)] = [right, len(prompts)]
            if log:
                log(f"multihop {key} L={L}: {right}/{len(prompts)} = {100 * acc[key][str(L)]:.1f}%")
    return {"accuracy": acc, "counts": counts, "samples": samples}


__all__ = [
    "MultiHopBuilder",
    "MultiHopPrompt",
    "split_sentences",
    "load_background",
    "load_capo_names",
    "unique_names",
    "extract_year",
    "score_multihop",
    "evaluate_multihop",
    "QUESTION",
    "STATEMENT",
    "EQUIVALENCE",
    "INSTRUCTION_2HOP",
    "HOPS",
    "LENGTHS",
    "YEARS",
    "NEWLINES",
]
