"""Capo rendering: person facts -> biography text and token ids (one job: what one exposure of a person reads).

Part 3.3 §2 (bioS); Part 4.1 §5. One biography = six sentences, one per attribute (birth date, birth city, university,
major, employer, work city), each from the first ``templates_per_attribute`` templates of the attribute's pool
(``capo_assets/templates.json``). The first sentence has the full name as its subject, the others "He"/"She".
``permute_sentences: true`` (paper, bioS(N)): a fresh sentence order on every exposure, the full name always in the
first sentence of the new order; ``false``: the fixed attribute order above. Templates are gender-neutral (no his/her),
so the first He/She is the only token that reveals the gender. Every random choice of exposure ``r`` (training pass, or
evaluation rendering) of person ``i`` is a pure function of (seed, N, generative parameters, split, r, i)
(:meth:`Renderer.namespace`, :mod:`canonlm.data.seeding`).

Token ids are concatenations of the cached fragment ids of :class:`canonlm.data.tasks.capo.fragments.Fragments`
(vectorised over many renderings); the text path (:meth:`Renderer.texts`) makes the same choices in plain Python and is
the oracle the fragment path is checked against (:meth:`Renderer.first_misaligned`).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from canonlm.data.seeding import below, instance_keys, words
from canonlm.data.tasks._common import cached_namespace, excl_cumsum
from canonlm.data.tasks.capo.assets import ATTRIBUTES, MONTHS, PRONOUNS

# purposes of the counter-based words under a render namespace (Renderer.namespace); values are part of the streams
P_TA, P_TB, P_ORDER, P_PERM, P_OFFSET, P_VAL = range(6)  # templates A/B, sentence order; train pass order, window
# offset (stream.py); val subset (evaluation.py)
ORDERS = np.array(list(itertools.permutations(range(6))), dtype=np.int64)  # (720, 6): attribute at position i
_INV_ORDERS = np.argsort(ORDERS, axis=1)  # position of attribute a
_SLOTS = 8  # fragment slots per sentence: subject x3, template prefix, value x3, template suffix
_BIO_FRAGS = 6 * _SLOTS + 1  # + <EOS>


def field_texts(assets: Mapping[str, Any], r: Mapping[str, int], first_year: int) -> dict[str, str]:
    """Text of each fact of one person record ``r`` (list indices as in the population, ``year`` counted from
    ``first_year``): ``name``, ``birth_date`` ("October 2, 1996"), ``birth_city``, ``university``, ``major``,
    ``employer``, ``work_city`` (the employer's headquarters city)."""
    A = assets
    return {
        "name": f"{A['first_names'][r['first']]} {A['middle_names'][r['middle']]} {A['last_names'][r['last']]}",
        "birth_date": f"{MONTHS[r['month']]} {r['day'] + 1}, {first_year + r['year']}",
        "birth_city": A["birth_cities"][r["city"]],
        "university": A["universities"][r["univ"]],
        "major": A["majors"][r["major"]],
        "employer": A["employers"][r["emp"]],
        "work_city": A["hq_cities"][r["emp"]],
    }


def compose_text(
    fields: Mapping[str, str],
    tmpl: Sequence[int],
    order: Sequence[int],
    gender: int,
    pools: Mapping[str, Sequence[str]],
) -> str:
    """The biography text: sentence k renders attribute ``order[k]`` with template ``tmpl[attribute]`` of its pool;
    subject = the full name in sentence 0, He/She (``gender`` 0/1) after; sentences joined by one space."""
    sents = []
    for pos, a in enumerate(order):
        attr = ATTRIBUTES[a]
        subj = fields["name"] if pos == 0 else PRONOUNS[gender]
        sents.append(pools[attr][tmpl[a]].replace("{S}", subj).replace("{V}", fields[attr]))
    return " ".join(sents)


class Renderer:
    """Renderings of a population: random choices, lengths, token ids and texts.

    Args: frags: the task's :class:`~canonlm.data.tasks.capo.fragments.Fragments`. assets: :func:`load_assets`.
        T_tmpl (templates per attribute), permute_sentences, years (first, last), gender, N, val_people, seed: the
        task's validated config values (the generative parameters that name the render namespaces).
    """

    def __init__(
        self,
        frags: Any,
        assets: Mapping[str, Any],
        T_tmpl: int,
        permute_sentences: bool,
        years: tuple[int, int],
        gender: str,
        N: int,
        val_people: int,
        seed: int,
    ):
        self.frags, self.assets = frags, assets
        self.T_tmpl, self.permute_sentences, self.years, self.gender = T_tmpl, permute_sentences, years, gender
        self.N, self.val_people, self.seed = N, val_people, seed
        self._ns_cache: dict[tuple, int] = {}

    def namespace(self, split: str, seed: int | None) -> int:
        """64-bit namespace of the renderings of ``split`` (cached; seed None = the task's seed)."""

        def parts() -> tuple:
            gen = dict(
                N=self.N,
                templates_per_attribute=self.T_tmpl,
                permute_sentences=self.permute_sentences,
                birth_years=list(self.years),
                gender=self.gender,
                assets=self.assets["digest"],
            )
            if split == "val":  # the val subset's choice; test renderings never depend on val settings
                gen.update(val_people=self.val_people)
            return "canonlm.data", "capo", "render", gen

        return cached_namespace(self._ns_cache, split, seed, self.seed, parts)

    def choices(self, ns: int, r: np.ndarray, person: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tA, tB, order index) of renderings (r, person): tA / tB in [0, T^3) encode the templates of attributes
        0-2 / 3-5 in mixed radix T; order index in [0, 720) (0 = fixed order)."""
        keys = instance_keys(ns, r, person)
        T3 = self.T_tmpl**3
        tA = below(words(keys, P_TA, 0), T3)
        tB = below(words(keys, P_TB, 0), T3)
        order = below(words(keys, P_ORDER, 0), 720) if self.permute_sentences else np.zeros_like(tA)
        return tA, tB, order

    def lengths(self, pop: dict[str, np.ndarray], ns: int, r: np.ndarray, person: np.ndarray) -> np.ndarray:
        """int64: tokens of the renderings (r, person), <EOS> included (no order needed: it does not change it)."""
        keys = instance_keys(ns, r, person)
        T3 = self.T_tmpl**3
        return (
            pop["base_len"][person].astype(np.int64)
            + self.frags.TLA[below(words(keys, P_TA, 0), T3)]
            + self.frags.TLB[below(words(keys, P_TB, 0), T3)]
        )

    def tokens(self, pop: dict[str, np.ndarray], ns: int, r: Any, person: Any) -> dict[str, np.ndarray]:
        """Token ids of renderings (r[b], person[b]) (vectorised), each biography followed by <EOS>.

        Returns dict: ``tokens`` int64 (S,); ``offsets`` int64 (B+1,); ``span_start``/``span_len`` int64 (B, 7)
        [token spans of groups 1..7 (name, birth date, birth city, university, major, employer, gender) counted
        from the biography's start]; ``order`` int64 (B, 6) attribute at each sentence position; ``tmpl`` int64
        (B, 6) template index per attribute."""
        r = np.asarray(r, dtype=np.int64).reshape(-1)
        person = np.asarray(person, dtype=np.int64).reshape(-1)
        B = person.shape[0]
        tA, tB, oi = self.choices(ns, r, person)
        T = self.T_tmpl
        tmpl = np.stack([tA % T, (tA // T) % T, tA // (T * T), tB % T, (tB // T) % T, tB // (T * T)], axis=1)
        fb = self.frags.fbase
        sent = np.zeros((B, 6, _SLOTS), dtype=np.int64)
        for a, attr in enumerate(ATTRIBUTES):
            sent[:, a, 3] = fb[f"pre_{attr}"] + tmpl[:, a]
            sent[:, a, 7] = fb[f"suf_{attr}"] + tmpl[:, a]
        g = lambda k: pop[k][person].astype(np.int64)
        sent[:, 0, 4] = fb["month"] + g("month")
        sent[:, 0, 5] = fb["day"] + g("day")
        sent[:, 0, 6] = fb["year"] + g("year")
        sent[:, 1, 4] = fb["city"] + g("city")
        sent[:, 2, 4] = fb["univ"] + g("univ")
        sent[:, 3, 4] = fb["major"] + g("major")
        emp = g("emp")
        sent[:, 4, 4] = fb["emp"] + emp
        sent[:, 5, 4] = fb["hq"] + emp
        order = ORDERS[oi]
        S = np.take_along_axis(sent, order[:, :, None], axis=1)
        S[:, 0, 0] = fb["first"] + g("first")
        S[:, 0, 1] = fb["middle"] + g("middle")
        S[:, 0, 2] = fb["last"] + g("last")
        S[:, 1:, 0] = (fb["pron"] + g("gender"))[:, None]
        frag = np.empty((B, _BIO_FRAGS), dtype=np.int64)
        frag[:, :-1] = S.reshape(B, 6 * _SLOTS)
        frag[:, -1] = 1  # <EOS>
        fl = self.frags.flen[frag]
        cum = np.cumsum(fl, axis=1)
        fstart = cum - fl
        flat_f, flat_l = frag.reshape(-1), fl.reshape(-1)
        nz = flat_l > 0
        flat_f, flat_l = flat_f[nz], flat_l[nz]
        tot = int(cum[:, -1].sum())
        src = np.repeat(self.frags.foff[flat_f] - excl_cumsum(flat_l)[:-1], flat_l) + np.arange(tot, dtype=np.int64)
        tokens = self.frags.ftok[src]
        offsets = excl_cumsum(cum[:, -1])
        pos = _INV_ORDERS[oi]  # (B, 6) sentence position of each attribute
        rows = np.arange(B)[:, None]
        vstart = fstart[rows, _SLOTS * pos[:, :5] + 4]
        vend = fstart[rows, _SLOTS * pos[:, :5] + 7]
        span_start = np.empty((B, 7), dtype=np.int64)
        span_len = np.empty((B, 7), dtype=np.int64)
        span_start[:, 0] = 0
        span_len[:, 0] = fstart[:, 3]
        span_start[:, 1:6] = vstart
        span_len[:, 1:6] = vend - vstart
        span_start[:, 6] = fstart[:, _SLOTS]
        span_len[:, 6] = fl[:, _SLOTS]
        return dict(tokens=tokens, offsets=offsets, span_start=span_start, span_len=span_len, order=order, tmpl=tmpl)

    def texts(self, pop: dict[str, np.ndarray], ns: int, r: Any, person: Any) -> list[str]:
        """Plain-text renderings (r[b], person[b]) (no <EOS>), from the same random choices as :meth:`tokens`."""
        r = np.asarray(r, dtype=np.int64).reshape(-1)
        person = np.asarray(person, dtype=np.int64).reshape(-1)
        tA, tB, oi = self.choices(ns, r, person)
        T = self.T_tmpl
        out = []
        for b in range(person.shape[0]):
            rec = {k: int(v[person[b]]) for k, v in pop.items()}
            ta, tb = int(tA[b]), int(tB[b])
            tm = [ta % T, (ta // T) % T, ta // (T * T), tb % T, (tb // T) % T, tb // (T * T)]
            out.append(
                compose_text(
                    field_texts(self.assets, rec, self.years[0]),
                    tm,
                    [int(x) for x in ORDERS[oi[b]]],
                    rec["gender"],
                    self.frags.templates,
                )
            )
        return out

    def first_misaligned(self, pop: dict[str, np.ndarray], encode: Callable[[str], np.ndarray]) -> str | None:
        """The first biography (pass 0 of every person of ``pop``, a fixed namespace) whose concatenated fragment ids
        differ from ``encode`` of its whole text (KeyError of ``encode`` counts as a difference); None if all agree
        (the fragment rule of :mod:`canonlm.data.tasks.capo.fragments` holds on this sample)."""
        n = pop["first"].shape[0]
        r, person = np.zeros(n, np.int64), np.arange(n)
        b = self.tokens(pop, 12345, r, person)
        texts = self.texts(pop, 12345, r, person)
        for k in range(n):
            got = b["tokens"][b["offsets"][k] : b["offsets"][k + 1] - 1]
            try:
                want = encode(texts[k])
            except KeyError:  # a token no fragment produces
                want = np.zeros(0, dtype=np.int64)
            if want.shape != got.shape or not np.array_equal(want, got):
                return texts[k]
        return None
