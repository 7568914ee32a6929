"""Layered probabilistic context-free grammars for the Lano task (paper App. A.5; Physics of LM Part 1).

    from canonlm.data.cfg import load_grammar, preset_grammar, sample_sentences, check, next_symbol_probs, lano_kl
    g = load_grammar("cfg3f.json")                       # the official JSON format, exactly (or preset_grammar)
    tok, off, _ = sample_sentences(g, keys)              # counter-based top-down sampler (numba)
    ok = check(g, sentences)                             # layered bitset CYK recogniser (numba), bool (m,)
    p = next_symbol_probs(g, sentence)                   # exact P(next symbol | prefix), float64 (n+1, 1+|T|)

Modules: :mod:`.grammar` (representation, JSON load/validate/save, random family generator, presets),
:mod:`.sample`, :mod:`.check`, :mod:`.inside` (exact next-symbol law and the Lano KL). The kernels are compiled
with ``numba.njit(cache=True)`` (the first call in a fresh environment compiles them, a few seconds).
"""

from canonlm.data.cfg.grammar import (
    FAMILY_KEYS,
    PRESETS,
    FlatGrammar,
    Grammar,
    family_params,
    grammar_from_dict,
    load_grammar,
    preset_grammar,
    random_grammar,
    save_grammar,
)
from canonlm.data.cfg.sample import sample_sentences
from canonlm.data.cfg.check import check, check_ragged
from canonlm.data.cfg.inside import lano_kl, next_symbol_probs

__all__ = [
    "Grammar",
    "FlatGrammar",
    "PRESETS",
    "FAMILY_KEYS",
    "family_params",
    "grammar_from_dict",
    "load_grammar",
    "preset_grammar",
    "random_grammar",
    "save_grammar",
    "sample_sentences",
    "check",
    "check_ragged",
    "lano_kl",
    "next_symbol_probs",
]
