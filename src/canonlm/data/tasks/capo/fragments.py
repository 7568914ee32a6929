"""Capo fragments and compact vocabulary (one job: every piece of text a biography is made of, tokenised once).

Every template fragment (the text between subject and value, and after the value) and every attribute value is tokenised
ONCE; a biography is the concatenation of cached id arrays (:meth:`canonlm.data.tasks.capo.render.Renderer.tokens`).
This equals tokenising the whole text because every fragment boundary is a pre-token boundary of the GPT-2 regex: values
carry their leading space, start and end with a letter or digit, templates never end with a space and put punctuation or
a space after the value; this is verified on a sample of biographies whenever a task is built
(:meth:`Renderer.first_misaligned`) and in the tests on thousands. Templates are prefix-free at the token level
(:meth:`Fragments.prefix_conflicts`), so once a template's prefix is read the next token is certainly the value of that
attribute.

Vocabulary: compact (as the paper restricts the embedding to the GPT-2 ids that occur, Part 4.1 App. A.3): the token ids
occurring in any fragment, in increasing original id, become 1..V; ``<EOS>`` = V + 1 (it separates biographies); 0 =
pad. ``vocab_size = V + 2``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from canonlm.data.tasks._common import excl_cumsum
from canonlm.data.tasks.capo.assets import ATTRIBUTES, MONTHS, PRONOUNS, parse_template
from canonlm.data.tasks.capo.tokenizer import EOS_TEXT, from_json


class Fragments:
    """Token ids of every fragment under ``tokenizer``, and the compact vocabulary.

    Args: tokenizer: a ``tokenizers.Tokenizer`` (original ids). assets: :func:`load_assets`. T_tmpl: templates per
        attribute in use. years: (first, last) birth years. list_sizes: name -> length of each list of ``assets``.
    Attributes: tokenizer; templates (attribute -> the first T_tmpl templates); vocab_size, eos_id, n_used_tokens
        (= V + 1, ids that can occur); compact_to_orig int64 (vocab_size,) original id of each compact id (-1 for pad
        and <EOS>); fbase (kind -> id of its first fragment; 0 = empty, 1 = <EOS>), ftok int64 (compact ids of all
        fragments), foff int64 (offsets into ftok), flen int64 (tokens per fragment); tl int64 (6, T_tmpl) tokens of
        each template (prefix + suffix); TLA / TLB int64 (T_tmpl^3,) template tokens of attributes 0-2 / 3-5 by
        mixed-radix choice; value_len: kind (first, middle, last, month, day, year, city, univ, major, emp, hq, pron)
        -> int64 tokens of each value.
    """

    def __init__(
        self,
        tokenizer: Any,
        assets: Mapping[str, Any],
        T_tmpl: int,
        years: tuple[int, int],
        list_sizes: Mapping[str, int],
    ):
        A = assets
        texts: list[str] = ["", ""]  # 0 = empty, 1 = <EOS> (special, set below)
        base: dict[str, int] = {}

        def add(kind: str, items: Sequence[str]) -> None:
            base[kind] = len(texts)
            texts.extend(items)

        add("pron", [" " + p for p in PRONOUNS])
        add("first", A["first_names"])
        add("middle", [" " + v for v in A["middle_names"]])
        add("last", [" " + v for v in A["last_names"]])
        add("month", [" " + m for m in MONTHS])
        add("day", [f" {d}" for d in range(1, 29)])
        add("year", [f", {y}" for y in range(years[0], years[1] + 1)])
        add("city", [" " + v for v in A["birth_cities"]])
        add("univ", [" " + v for v in A["universities"]])
        add("major", [" " + v for v in A["majors"]])
        add("emp", [" " + v for v in A["employers"]])
        add("hq", [" " + v for v in A["hq_cities"]])
        self.templates = {a: A["templates"][a][:T_tmpl] for a in ATTRIBUTES}
        for a in ATTRIBUTES:
            parts = [parse_template(t) for t in self.templates[a]]
            add(f"pre_{a}", [p for p, _ in parts])
            add(f"suf_{a}", [s for _, s in parts])
        self.fbase = base
        self.tokenizer = tok = tokenizer
        enc = tok.encode_batch(texts[2:], add_special_tokens=False)
        ids = [[], []] + [e.ids for e in enc]
        used = np.unique(np.concatenate([np.asarray(x, dtype=np.int64) for x in ids if x] or [np.zeros(0, np.int64)]))
        V = int(used.shape[0])
        self.eos_id = V + 1
        self.vocab_size = V + 2
        self.n_used_tokens = V + 1  # ids that can occur (pad never does)
        c2o = np.full(self.vocab_size, -1, dtype=np.int64)
        c2o[1 : V + 1] = used
        self.compact_to_orig = c2o
        o2c = {int(o): i + 1 for i, o in enumerate(used)}
        flen = np.array([len(x) for x in ids], dtype=np.int64)
        flen[1] = 1
        ftok = np.zeros(int(flen.sum()), dtype=np.int64)
        foff = excl_cumsum(flen)
        for f, x in enumerate(ids):
            if x:
                ftok[foff[f] : foff[f + 1]] = [o2c[int(t)] for t in x]
        ftok[foff[1]] = self.eos_id
        self.ftok, self.foff, self.flen = ftok, foff, flen
        self._o2c = o2c
        self._tok_json = tok.to_str()
        self.T_tmpl = T = T_tmpl
        # template lengths (prefix + suffix) per attribute; sums for the two words of template choices
        tl = np.stack(
            [
                flen[base[f"pre_{a}"] : base[f"pre_{a}"] + T] + flen[base[f"suf_{a}"] : base[f"suf_{a}"] + T]
                for a in ATTRIBUTES
            ]
        )  # (6, T)
        x = np.arange(T**3)
        d0, d1, d2 = x % T, (x // T) % T, x // (T * T)
        self.TLA = (tl[0][d0] + tl[1][d1] + tl[2][d2]).astype(np.int64)
        self.TLB = (tl[3][d0] + tl[4][d1] + tl[5][d2]).astype(np.int64)
        self.tl = tl
        L = lambda k, n: flen[base[k] : base[k] + n]
        s = list_sizes
        self.value_len = dict(
            pron=L("pron", 2),
            first=L("first", s["first_names"]),
            middle=L("middle", s["middle_names"]),
            last=L("last", s["last_names"]),
            month=L("month", 12),
            day=L("day", 28),
            year=L("year", years[1] - years[0] + 1),
            city=L("city", s["birth_cities"]),
            univ=L("univ", s["universities"]),
            major=L("major", s["majors"]),
            emp=L("emp", s["employers"]),
            hq=L("hq", s["employers"]),
        )

    # ------------------------------------------------------------------ pickling (DataLoader spawn workers)
    def __getstate__(self) -> dict[str, Any]:
        st = dict(self.__dict__)
        st["tokenizer"] = None
        return st

    def __setstate__(self, st: dict[str, Any]) -> None:
        self.__dict__.update(st)
        self.tokenizer = from_json(self._tok_json)

    # ------------------------------------------------------------------ ids <-> text
    def encode(self, text: str) -> np.ndarray:
        """Compact ids (int64) of ``text`` tokenised as a whole (no special tokens). KeyError for a token that never
        occurs in biographies."""
        return np.array(
            [self._o2c[t] for t in self.tokenizer.encode(text, add_special_tokens=False).ids], dtype=np.int64
        )

    def token_names(self) -> list[str]:
        """Printable text of every compact id (index = id): ``<pad>``, the decoded token (with its leading space),
        ``<EOS>``."""
        return ["<pad>"] + [self.tokenizer.decode([int(o)]) for o in self.compact_to_orig[1:-1]] + ["<EOS>"]

    def decode(self, ids: Any) -> str:
        """Text of compact ids (list, numpy or torch): tokens decoded by the tokenizer, ``<EOS>`` printed as
        ``<|endoftext|>``, pad as ``<pad>``, unknown ids as ``<unk_id>``."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        out, run = [], []
        for t in ids:
            t = int(t)
            if 1 <= t < self.eos_id:
                run.append(int(self.compact_to_orig[t]))
                continue
            if run:
                out.append(self.tokenizer.decode(run))
                run = []
            out.append(EOS_TEXT if t == self.eos_id else "<pad>" if t == 0 else f"<unk_{t}>")
        if run:
            out.append(self.tokenizer.decode(run))
        return "".join(out)

    def prefix_conflicts(self) -> list[tuple[str, str]]:
        """Pairs (template, other template) of the pools in use whose prefix tokens (the text between the subject
        and the value) are equal to or a proper prefix of the other's. Empty for the shipped templates with the
        tokenizers tested: then, once a template's prefix has been read, the next token starts that attribute's
        value for certain, so the value's cross-entropy measures knowledge only (Part 3.3 Def. 4.3)."""
        fb, T = self.fbase, self.T_tmpl
        seqs = []
        for a in ATTRIBUTES:
            for t in range(T):
                f = fb[f"pre_{a}"] + t
                seqs.append((tuple(self.ftok[self.foff[f] : self.foff[f + 1]].tolist()), self.templates[a][t]))
        seqs.sort()
        out = []
        for k in range(len(seqs) - 1):  # sorted: a prefix sorts right before its extensions
            j = k + 1
            while j < len(seqs) and seqs[j][0][: len(seqs[k][0])] == seqs[k][0]:
                out.append((seqs[k][1], seqs[j][1]))
                j += 1
        return out

    # ------------------------------------------------------------------ biography lengths
    def base_len(self, pop: Mapping[str, np.ndarray]) -> np.ndarray:
        """int32 (N,): tokens of each person's biographies outside the templates, <EOS> included (the same for
        every rendering: the five pronouns, the name and the values)."""
        Ln = self.value_len
        base = (
            Ln["first"][pop["first"]]
            + Ln["middle"][pop["middle"]]
            + Ln["last"][pop["last"]]
            + Ln["month"][pop["month"]]
            + Ln["day"][pop["day"]]
            + Ln["year"][pop["year"]]
            + Ln["city"][pop["city"]]
            + Ln["univ"][pop["univ"]]
            + Ln["major"][pop["major"]]
            + Ln["emp"][pop["emp"]]
            + Ln["hq"][pop["emp"]]
            + 5 * Ln["pron"][pop["gender"]]
            + 1
        )
        return base.astype(np.int32)

    def _bio_len(self, f: Any) -> Any:
        """``f`` (np.max / np.min / np.mean) of every part of a biography, summed (+1 for <EOS>)."""
        Ln = self.value_len
        return (
            f(Ln["first"])
            + f(Ln["middle"])
            + f(Ln["last"])
            + f(Ln["month"])
            + f(Ln["day"])
            + f(Ln["year"])
            + f(Ln["city"])
            + f(Ln["univ"])
            + f(Ln["major"])
            + f(Ln["emp"] + Ln["hq"])
            + 5 * f(Ln["pron"])
            + f(self.tl, axis=1).sum()
            + 1
        )

    def max_bio_len(self) -> int:
        """Tokens of the longest possible biography, <EOS> included (each part at its maximum; exact)."""
        return int(self._bio_len(np.max))

    def min_bio_len(self) -> int:
        """Tokens of the shortest possible biography, <EOS> included."""
        return int(self._bio_len(np.min))

    def mean_bio_len(self) -> float:
        """Expected tokens per biography (<EOS> included) under uniform attributes and templates."""
        return float(self._bio_len(np.mean))
