"""Lano: learning a hierarchical language (layered CFG) (paper App. A.5).

Training stream ``<bos> s1 <bos> s2 <bos> ...`` (paper App. A.5): one instance = ``<bos> sentence``, the next
instance's ``<bos>`` closing it; loss on every token; packed left-aligned by :mod:`canonlm.data.packing`. Sentences
are sampled top-down from the grammar, every non-terminal choosing one of its rules uniformly
(:mod:`canonlm.data.cfg.sample`; counter-based, so instance (w, i) of a split is a pure function of (seed, grammar,
max_sentence_len, split, w, i)).

The grammar: ``grammar_file: <path>`` loads an official JSON grammar (e.g. the release's ``cfg3f.json``) exactly;
with ``grammar_file: null`` (default) canonlm generates a grammar *of the same family* as the preset named by
``grammar`` (depth, symbols per level, rules per non-terminal, rule lengths of the released cfg3f / cfg3j / ...,
:data:`canonlm.data.cfg.grammar.PRESETS`) from ``grammar_seed`` -- the official files cannot be shipped, so without
them the grammar is *not* the paper's.

Sentence-length cap (``max_sentence_len``, [gap]): the exact longest sentence of cfg3f is 729 tokens and of cfg3j
2052, longer than the paper's 512 / 1536 windows, but left-aligned packing needs every instance to fit a window.
``auto`` (default) caps sentences at ``context - 1`` tokens by rejection (a longer draw is redrawn with the next
counter); the rejected mass is tiny (official cfg3f at 512: 1.2e-6, cfg3j/cfg3k at 1536: < 1e-50) and is reported
as :attr:`LanoTask.rejected_mass`. ``null`` = no cap (the context must then hold the grammar's longest sentence).

Evaluation (paper App. A.5; ``eval_mode = "generate"``): from the prompt ``<bos>`` the model samples at
``eval_temperature`` until it emits ``<bos>``; a sample is correct iff it ends with ``<bos>`` and the sentence before
it is non-empty and derivable (:func:`canonlm.data.cfg.check`). KL: for sample indices ``idx < kl_samples`` the
split's sentence (idx, 0) is scored teacher-forced against the exact next-symbol law (:mod:`canonlm.data.cfg.inside`).

Vocabulary (already compact): 0 = pad, 1..|T| = terminals, |T|+1 = ``<bos>`` (the release's
``eos_token``); ``vocab_size = |T| + 2``.
"""

from __future__ import annotations

import math
from pathlib import Path
from numbers import Real
from typing import Any, Mapping

import numpy as np

from canonlm.data import ConfigError
from canonlm.data.cfg.check import check
from canonlm.data.cfg.grammar import PRESETS, Grammar, family_params, load_grammar, random_grammar
from canonlm.data.cfg.inside import lano_kl, next_symbol_probs
from canonlm.data.cfg.sample import sample_sentences
from canonlm.data.seeding import instance_keys, stable_hash64, words
from canonlm.data.tasks import Instance, InstanceBatch, Prompts, check_split
from canonlm.data.tasks._common import (
    cached_namespace,
    check_choice,
    check_indices,
    check_int,
    decode_plain,
    is_int,
    merge_config,
    parse_index,
)

DEFAULTS: dict[str, Any] = dict(
    name="lano",
    grammar="cfg3f",
    grammar_file=None,
    grammar_seed=0,
    max_sentence_len="auto",
    context=512,
    tail="drop",
    seed=0,
    eval_num_samples=500,
    eval_temperature=1.0,
    kl_samples=32,
    kl_restrict="renormalize",
)
KEYS = tuple(DEFAULTS)
_P_EVAL_NOISE = 1  # purpose of the generation-noise key words (sampler purposes start at 16)
_MIN_ACCEPT = 0.01  # an explicit cap must keep at least this much of the length law
_AUTO_MAX_REJECT = 1e-4  # max_sentence_len: auto may drop at most this much (official cfg3f at 512: 1.2e-6)


class LanoTask:
    """Lano task (paper App. A.5). Build with :func:`canonlm.data.tasks.build_task` (``"lano"``).

    Attributes:
        name: ``"lano"``. cfg: the validated config (every key of ``KEYS``). grammar: :class:`Grammar`.
        grammar_label: the preset name (or ``"custom"`` for a family mapping); with a grammar file it only labels
            the run. context, tail, seed, eval_num_samples, eval_temperature, kl_samples, kl_restrict: config.
        vocab_size: |T| + 2. pad_id: 0. bos_id: |T| + 1. symbol_ids: int64 (1+|T|,) = [<bos>, 1, .., |T|], the
            vocabulary ids of the next-symbol law's columns [eos, 1, .., |T|].
        max_len: longest sentence generated (the cap); rejected_mass: P(grammar sentence longer than max_len);
            mean_len: expected sentence length under the cap.
        num_groups: 2 (every sample in group 1). group_name: ``"grammar"``. chance: 0.0. eval_mode: ``"generate"``.
    Raises ConfigError (naming ``task.<key>``) for unknown keys, wrong types, an unknown preset / bad family mapping
    (``task.grammar``), an unreadable or invalid grammar file (``task.grammar_file``), a cap below the shortest
    sentence or keeping < 1% of the length law (``task.max_sentence_len``), a context that cannot hold
    ``<bos>`` + the longest (capped) sentence (``task.context``), bad tail / kl_restrict / counts / temperature.
    """

    group_name = "grammar"
    pad_id = 0
    eval_mode = "generate"
    chance = 0.0
    num_groups = 2

    def __init__(self, name: str, cfg: Mapping[str, Any]):
        c = merge_config(name, cfg, {"lano": DEFAULTS}, KEYS)
        self.name = name
        self.context = check_int("context", c["context"], 2)
        self.tail = check_choice("tail", c["tail"], ("drop", "carry"))
        self.seed = check_int("seed", c["seed"], 0)
        self.eval_num_samples = check_int("eval_num_samples", c["eval_num_samples"], 0)
        self.kl_samples = check_int("kl_samples", c["kl_samples"], 0)
        self.kl_restrict = check_choice("kl_restrict", c["kl_restrict"], ("renormalize", "raw"))
        temp = c["eval_temperature"]
        if isinstance(temp, bool) or not isinstance(temp, Real) or not temp >= 0 or not math.isfinite(temp):
            raise ConfigError("task.eval_temperature", temp, "a number >= 0 (1.0 = the paper; 0 = greedy)")
        self.eval_temperature = float(temp)
        self.grammar_seed = check_int("grammar_seed", c["grammar_seed"], 0)
        spec = c["grammar"]
        if hasattr(spec, "items"):  # a family mapping (dict or OmegaConf DictConfig) -> plain dict / lists
            spec = {k: (list(v) if hasattr(v, "__len__") and not isinstance(v, str) else v) for k, v in spec.items()}
        try:
            fam = family_params(spec)
        except ValueError as e:
            raise ConfigError(
                "task.grammar",
                spec,
                f"a family preset ({' | '.join(PRESETS)}) or a mapping of "
                f"depth, num_sym, num_terminals, deg_min, deg_max, len_min, "
                f"len_max[, distinct_children] ({e})",
            ) from None
        self.grammar_label = spec if isinstance(spec, str) else "custom"
        gf = c["grammar_file"]
        if gf is not None and not isinstance(gf, str):
            raise ConfigError("task.grammar_file", gf, "null | a path to an official-format grammar JSON file")
        self.grammar_file = gf
        if gf is not None:
            self.grammar: Grammar = load_grammar(gf)
            gh = self.grammar.header
            have = dict(
                depth=self.grammar.depth,
                num_terminals=self.grammar.num_terminals,
                deg_min=gh.get("deg_min", fam["deg_min"]),
                deg_max=gh.get("deg_max", fam["deg_max"]),
            )
            want = {k: fam[k] for k in have}
            if isinstance(spec, str) and have != want:  # the preset names the run (reports, paper context)
                match = [n for n in PRESETS if {k: family_params(n)[k] for k in have} == have]
                if Path(gf).stem in PRESETS:  # e.g. grammar_file=cfg3k.json with grammar=cfg3f: a mislabelled run
                    raise ConfigError(
                        "task.grammar",
                        spec,
                        f"the family of grammar_file={gf} ({have}; matching presets: {' | '.join(match) or 'none'})",
                    )
                self.grammar_label = Path(gf).stem  # a user's own grammar: labelled by its file
        else:
            try:
                self.grammar = random_grammar(self.grammar_seed, **fam)
            except ValueError as e:
                raise ConfigError("task.grammar", spec, f"a satisfiable grammar family ({e})") from None
        g = self.grammar

        # sentence-length cap
        ms = c["max_sentence_len"]
        gmin, gmax = g.sentence_min_len, g.sentence_max_len
        if ms == "auto":
            cap = min(gmax, self.context - 1)
            if cap < gmin:
                raise ConfigError(
                    "task.context",
                    self.context,
                    f"an integer >= {gmin + 1} (<bos> + the shortest sentence of the grammar)",
                )
        elif ms is None:
            cap = gmax
        elif is_int(ms) and ms >= 1:
            if ms < gmin:
                raise ConfigError(
                    "task.max_sentence_len",
                    ms,
                    f"auto | null | an integer >= {gmin} (the shortest sentence of the grammar)",
                )
            cap = min(int(ms), gmax)
        else:
            raise ConfigError("task.max_sentence_len", ms, "auto | null | a positive integer")
        if self.context < cap + 1:
            raise ConfigError(
                "task.context",
                self.context,
                f"an integer >= {cap + 1} (<bos> + the longest sentence, max_sentence_len={ms!r})",
            )
        law = g.length_distribution()
        kept = float(law[: cap + 1].sum())
        if ms == "auto" and float(law[cap + 1 :].sum()) > _AUTO_MAX_REJECT:
            # the automatic cap may only drop a negligible tail: otherwise training sees a different law than the
            # grammar's (and the KL reference), so the window must grow (or the cap be set explicitly)
            tail = np.cumsum(law[::-1])[::-1]  # tail[L] = P(length >= L)
            need = int(np.nonzero(tail <= _AUTO_MAX_REJECT)[0][0])  # smallest L with P(length >= L) <= limit
            raise ConfigError(
                "task.context",
                self.context,
                f"an integer >= {need} for this grammar (a window of {self.context} would drop "
                f"{float(law[cap + 1 :].sum()):.1%} of its sentences; max_sentence_len: auto drops at "
                f"most {_AUTO_MAX_REJECT:g}); or set task.max_sentence_len to an explicit cap",
            )
        if kept < _MIN_ACCEPT:
            key, val = ("task.context", self.context) if ms == "auto" else ("task.max_sentence_len", ms)
            raise ConfigError(
                key, val, f"a value keeping >= {_MIN_ACCEPT:.0%} of the sentence-length law (this one keeps {kept:.2e})"
            )
        self.max_len = int(cap)
        self.rejected_mass = float(law[cap + 1 :].sum())  # exactly 0 without a binding cap
        Ls = np.arange(cap + 1, dtype=np.float64)
        self.mean_len = float((law[: cap + 1] * Ls).sum() / kept)

        T = g.num_terminals
        self.vocab_size = T + 2
        self.bos_id = T + 1
        self.symbol_ids = np.concatenate([[self.bos_id], np.arange(1, T + 1)]).astype(np.int64)
        self.group_labels = {1: self.grammar_label}
        self.cfg = {**c, "grammar": spec}
        self._fp = g.fingerprint()
        self._ns_cache: dict[tuple[str, int], int] = {}

    # ------------------------------------------------------------------ vocabulary
    def token_names(self) -> list[str]:
        """``<pad>``, ``1``..``|T|`` (terminals), ``<bos>`` (index = id)."""
        return ["<pad>"] + [str(a) for a in range(1, self.grammar.num_terminals + 1)] + ["<bos>"]

    def decode(self, ids: Any) -> str:
        """Space-separated token names of a 1-D id sequence; unknown ids print as ``<unk_id>``."""
        return decode_plain(ids, self.token_names())

    # ------------------------------------------------------------------ sizes
    def max_instance_len(self, split: str) -> int:
        """1 + the longest generated sentence (the grammar's exact maximum, or the cap)."""
        check_split(split)
        return 1 + self.max_len

    def min_instance_len(self, split: str) -> int:
        """1 + the grammar's shortest sentence."""
        check_split(split)
        return 1 + self.grammar.sentence_min_len

    def estimate_lengths(self, split: str, w: np.ndarray, i: np.ndarray, seed: int | None = None) -> np.ndarray:
        """float64 (I,): the expected instance length 1 + E[sentence length] (exact, under the cap) for every
        instance (only sizes packing rounds)."""
        check_split(split)
        return np.full(np.asarray(w).reshape(-1).shape[0], 1.0 + self.mean_len)

    # ------------------------------------------------------------------ generation
    def _namespace(self, split: str, seed: int | None) -> int:
        # the cap is not part of the namespace: caps differ only on the (rare) rejected draws
        return cached_namespace(self._ns_cache, split, seed, self.seed, lambda: ("canonlm.data", "lano", self._fp))

    def generate(self, split: str, w: Any, i: Any, seed: int | None = None) -> InstanceBatch:
        """Generate instances ``(w[r], i[r])`` of ``split``: ``<bos> sentence`` each, loss on every token.

        Args: split: train | val | test. w, i: non-negative integer arrays of equal length I. seed: data seed
            (default: the config's).
        Returns: :class:`InstanceBatch` without answers (Q = 0; Lano is evaluated by generation); meta ``length``
            int64 (I,) sentence lengths (without <bos>).
        Raises ValueError for a bad split, negative or mismatched indices.
        """
        check_split(split)
        w, i = check_indices(w, i)
        keys = instance_keys(self._namespace(split, seed), w, i)
        tok, off, _ = sample_sentences(self.grammar, keys, self.max_len, prefix_bos=True, mean_len=self.mean_len)
        I = w.shape[0]
        e64 = np.zeros(0, dtype=np.int64)
        return InstanceBatch(
            tokens=tok,
            loss_mask=np.ones(tok.shape[0], dtype=bool),
            offsets=off,
            ans_inst=e64,
            ans_start=e64,
            ans_len=e64,
            ans_group=np.zeros(0, dtype=np.int32),
            ans_offsets=np.zeros(I + 1, dtype=np.int64),
            meta={"length": np.diff(off) - 1},
        )

    def instance(self, split: str, index: int | tuple[int, int], seed: int | None = None) -> Instance:
        """One instance; ``index`` = (w, i) or an int i meaning (i, 0). meta ``length`` (int). ValueError on bad
        input."""
        w, i = parse_index(index)
        b = self.generate(split, [w], [i], seed)
        L = b.tokens.shape[0]
        return Instance(
            tokens=b.tokens,
            loss_mask=b.loss_mask,
            answer_id=np.full(L, -1, dtype=np.int32),
            group=np.zeros(L, dtype=np.int32),
            meta={"length": int(b.meta["length"][0])},
        )

    def sentences(self, split: str, idx: Any, seed: int | None = None) -> list[np.ndarray]:
        """Sentences (idx[r], 0) of ``split`` without ``<bos>`` (list of int64 arrays)."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        b = self.generate(split, idx, np.zeros_like(idx), seed)
        return [b.tokens[b.offsets[r] + 1 : b.offsets[r + 1]] for r in range(len(b))]

    # ------------------------------------------------------------------ evaluation
    def check(self, sentences) -> np.ndarray:
        """bool (m,): which sentences (terminal tokens, no <bos>) the grammar derives (:func:`cfg.check`)."""
        return check(self.grammar, sentences)

    def eval_samples(self, split: str) -> int:
        """Generated samples per evaluation: ``eval_num_samples`` (default 500; the paper does not say)."""
        check_split(split)
        return self.eval_num_samples

    def prompts(self, split: str, idx: Any, seed: int | None = None) -> Prompts:
        """Generation prompts of samples ``idx``: ``[<bos>]`` each; noise keys a pure function of (seed, grammar,
        split, idx[r]); max_new_tokens = longest sentence + 1; stop at ``<bos>``."""
        check_split(split)
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if idx.size and idx.min() < 0:
            raise ValueError("sample indices must be >= 0")
        ns = stable_hash64("canonlm.data", "lano.eval", self._namespace(split, seed))
        keys = words(instance_keys(ns, idx, np.zeros_like(idx)), _P_EVAL_NOISE, 0)
        return Prompts(
            prompts=[np.array([self.bos_id], dtype=np.int64) for _ in range(idx.size)],
            max_new_tokens=self.max_len + 1,
            stop_ids=(self.bos_id,),
            temperature=self.eval_temperature,
            keys=keys,
            group=np.ones(idx.size, dtype=np.int64),
            meta={"idx": idx},
        )

    def score_generations(self, generations) -> np.ndarray:
        """bool (n,): generation r (tokens after the prompt) is correct iff it ends with ``<bos>`` and the tokens
        before it form a non-empty derivable sentence."""
        cands, ok = [], np.zeros(len(generations), dtype=bool)
        for gen in generations:
            gen = np.asarray(gen, dtype=np.int64).reshape(-1)
            closed = gen.shape[0] >= 2 and int(gen[-1]) == self.bos_id
            cands.append(gen[:-1] if closed else np.zeros(0, dtype=np.int64))
        if cands:
            ok = self.check(cands)
        return ok

    def evaluate(self, lm, split: str, idx: Any) -> dict[str, np.ndarray]:
        """Generation accuracy and KL of samples ``idx`` (paper App. A.5).

        Args: lm: :class:`canonlm.data.lm.LanguageModel` (vocabulary >= ``vocab_size``). split: train | val | test.
            idx: non-negative ints (n,), the sample indices.
        Returns dict of (n,) arrays: ``correct`` bool (see :meth:`score_generations`), ``group`` int64 (all 1), ``kl``
            float64 -- for idx[r] < kl_samples the mean over the n+1 positions of the split's sentence (idx[r], 0)
            of KL(p* || model) (:func:`canonlm.data.cfg.lano_kl`, restrict = ``kl_restrict``), NaN otherwise (the
            trainer averages extra metrics over non-NaN values, i.e. a nanmean over the kl_samples sentences);
            ``kl_uniform`` float64, the same KL for a model that predicts uniformly over its vocabulary (about an
            untrained one: the scale ``kl`` starts from), NaN where ``kl`` is.
        """
        pr = self.prompts(split, idx)
        idx = pr.meta["idx"]
        gens = lm.generate(pr.prompts, pr.max_new_tokens, pr.stop_ids, pr.temperature, pr.keys)
        correct = self.score_generations(gens)
        kl = np.full(idx.size, np.nan)
        kl_uniform = np.full(idx.size, np.nan)
        sel = np.nonzero(idx < self.kl_samples)[0]
        if sel.size:
            b = self.generate(split, idx[sel], np.zeros(sel.size, dtype=np.int64))
            seqs = [b.tokens[b.offsets[r] : b.offsets[r + 1]] for r in range(sel.size)]
            lps = lm.logprobs(seqs)
            for r, (seq, lp) in enumerate(zip(seqs, lps)):
                p_star = next_symbol_probs(self.grammar, seq[1:])
                kl[sel[r]] = lano_kl(p_star, lp, self.symbol_ids, restrict=self.kl_restrict)
                flat = np.full(np.shape(lp), -np.log(np.shape(lp)[-1]))  # log(1/V) at every position
                kl_uniform[sel[r]] = lano_kl(p_star, flat, self.symbol_ids, restrict=self.kl_restrict)
        return {"correct": correct, "group": pr.group, "kl": kl, "kl_uniform": kl_uniform}

    def explain_metrics(self, metrics: Mapping[str, float]) -> list[str]:
        """Lines that say how to read :meth:`evaluate`'s KL (printed under a run's closing table): its unit, the
        untrained scale (``kl_uniform``) and 0 for the grammar's own law. Returns a list of str (empty without
        ``kl``)."""
        if "kl" not in metrics:
            return []
        scale = (
            f"; a model uniform over the vocabulary (about an untrained one) scores {metrics['kl_uniform']:.4g}"
            if "kl_uniform" in metrics
            else ""
        )
        return [
            f"kl = KL(p* || model) in nats per position, mean over the first {self.kl_samples} sentences "
            f"(App. A.5; restrict={self.kl_restrict}); 0 = the grammar's own next-symbol law{scale}"
        ]

    def __repr__(self) -> str:
        src = self.grammar_file or f"{self.grammar_label} family, grammar_seed={self.grammar_seed}"
        return f"LanoTask({src}: {self.grammar!r}, max_len={self.max_len}, vocab_size={self.vocab_size})"
