"""Layered probabilistic context-free grammars of the Lano task (paper App. A.5): representation, the official
JSON format (load / validate / save), a deterministic random generator of the same family, and family presets.

A grammar has ``depth + 1`` levels: level 0 holds the root alone, levels 1..depth-1 hold non-terminals, level
``depth`` holds the terminals. Every non-terminal of level l has a list of rules; a rule is a tuple of positions
(0-based) into level l+1's symbol list. Sentences are sampled top-down, every non-terminal picking one of its rules
uniformly (so all leaves sit on the terminal level). Terminal ``a`` (0-based position in the terminal level) is
token ``a + 1``; the sentence separator ``<bos>`` (the release's ``eos_token``) is token ``|T| + 1``.

Official JSON format (release ``Lano-cfg/configs/*.json``): ``all`` is a list of levels (root first), each a list
of nodes ``{"depth": l, "id": int, "name": str, "children": [[pos, ...], ...] | null}``; header keys ``depth``,
``num_sym``, ``vocab_size``, ``deg_min``/``deg_max`` (rules per non-terminal), ``len_min``/``len_max`` (rule
length), ``eos_token``/``mask_token``/``sep_token``, ``sizes`` (symbols per level), ``idx`` (ids per level),
``count`` and bookkeeping keys. :func:`load_grammar` reads and validates such a file exactly;
:func:`save_grammar` writes one (atomically) that the loader and the release's format readers accept.

Family presets (:data:`PRESETS`): the header facts of the released grammars (cfg3b, cfg3e1, cfg3e2, cfg3f, cfg3g,
cfg3h, cfg3i, cfg3j, cfg3k: depth, symbols per level, terminals, rules per non-terminal, rule lengths) plus
canonlm's small ``tiny`` family for CPU smoke tests. canonlm cannot ship the official files, so
:func:`random_grammar` draws a grammar *of the same family* from a seed; pass the official file to reproduce the
paper's grammar exactly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from canonlm.errors import ConfigError
from canonlm.data.seeding import below, instance_keys, stable_hash64, words
from canonlm.utils.io import atomic_write_text

GRAMMAR_KEY = "task.grammar_file"

# Header facts of the released grammars (read from the official JSON headers). ``num_sym``: symbols
# per non-terminal level below the root (an int = the same on every level; a list = levels 1..depth-1).
# ``distinct_children``: no symbol repeated inside one rule (the release's ``disallow_duplicate_sym``, true only for
# cfg3b). ``tiny`` is canonlm's own CPU family (sentences of at most 3**4 = 81 tokens).
PRESETS: dict[str, dict[str, Any]] = {
    "cfg3b": dict(
        depth=6, num_sym=3, num_terminals=3, deg_min=2, deg_max=2, len_min=2, len_max=3, distinct_children=True
    ),
    "cfg3e1": dict(depth=6, num_sym=[3, 9, 27, 81, 27], num_terminals=9, deg_min=3, deg_max=3, len_min=2, len_max=3),
    "cfg3e2": dict(depth=6, num_sym=[3, 9, 27, 27, 9], num_terminals=4, deg_min=3, deg_max=3, len_min=2, len_max=3),
    "cfg3f": dict(depth=6, num_sym=3, num_terminals=3, deg_min=3, deg_max=4, len_min=2, len_max=3),
    "cfg3g": dict(depth=6, num_sym=3, num_terminals=3, deg_min=3, deg_max=3, len_min=2, len_max=3),
    "cfg3h": dict(depth=6, num_sym=3, num_terminals=3, deg_min=2, deg_max=3, len_min=2, len_max=3),
    "cfg3i": dict(depth=6, num_sym=3, num_terminals=3, deg_min=2, deg_max=2, len_min=2, len_max=3),
    "cfg3j": dict(depth=7, num_sym=3, num_terminals=3, deg_min=3, deg_max=3, len_min=2, len_max=3),
    "cfg3k": dict(depth=7, num_sym=3, num_terminals=3, deg_min=3, deg_max=4, len_min=2, len_max=3),
    "tiny": dict(depth=4, num_sym=3, num_terminals=3, deg_min=2, deg_max=3, len_min=2, len_max=3),
}
FAMILY_KEYS = ("depth", "num_sym", "num_terminals", "deg_min", "deg_max", "len_min", "len_max", "distinct_children")


def _is_int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _name_of(i: int) -> str:
    """Two (or more) capital letters for id ``i`` >= 1: 1 -> AA, 2 -> AB, ..., 27 -> BA (the release's naming)."""
    k, s = i - 1, ""
    for _ in range(2):
        s = chr(65 + k % 26) + s
        k //= 26
    while k:
        s = chr(65 + k % 26) + s
        k //= 26
    return s


@dataclass(frozen=True, eq=False)
class Grammar:
    """A layered PCFG (uniform choice among each non-terminal's rules).

    Attributes:
        rules: ``rules[l][a]`` = tuple of rules of non-terminal a of level l (l = 0..depth-1); a rule is a tuple of
            positions into level l+1.
        num_terminals: |T|; terminal position a is token a+1; ``bos_id = eos_id = |T| + 1``.
        ids, names: per level (root first), the release's symbol ids / names (generated in the release's layout
            when not loaded from a file: terminals 1..|T|, specials |T|+1..|T|+3, non-terminals bottom-up).
        header: extra top-level JSON keys to write back on save (bookkeeping of the source file).
    Derived (read-only): ``depth``, ``sizes`` (symbols per level, root first), ``min_len`` / ``max_len`` (lists per
        level of int64 arrays: shortest / longest yield of each symbol), ``sentence_min_len``,
        ``sentence_max_len``, ``flat`` (numpy arrays for the numba kernels, see :meth:`_flatten`).
    Construct with :func:`load_grammar`, :func:`grammar_from_dict`, :func:`random_grammar` or
    ``Grammar(rules, num_terminals)`` (validated: ValueError on an inconsistent structure).
    """

    rules: tuple
    num_terminals: int
    ids: tuple = field(default=None)
    names: tuple = field(default=None)
    header: dict = field(default_factory=dict)

    def __post_init__(self):
        rules = tuple(tuple(tuple(tuple(int(c) for c in r) for r in sym) for sym in lvl) for lvl in self.rules)
        object.__setattr__(self, "rules", rules)
        problem = _structure_problem(rules, self.num_terminals)
        if problem:
            raise ValueError(f"invalid grammar: {problem}")
        sizes = tuple([len(lv) for lv in rules] + [int(self.num_terminals)])
        object.__setattr__(self, "sizes", sizes)
        if self.ids is None:
            object.__setattr__(self, "ids", _default_ids(sizes))
        else:
            object.__setattr__(self, "ids", tuple(tuple(int(x) for x in lv) for lv in self.ids))
        if self.names is None:
            object.__setattr__(self, "names", tuple(tuple(_name_of(i) for i in lv) for lv in self.ids))
        else:
            object.__setattr__(self, "names", tuple(tuple(str(x) for x in lv) for lv in self.names))
        # yield lengths per symbol, bottom-up
        mn = [None] * len(sizes)
        mx = [None] * len(sizes)
        mn[-1] = np.ones(self.num_terminals, dtype=np.int64)
        mx[-1] = np.ones(self.num_terminals, dtype=np.int64)
        for lv in range(len(rules) - 1, -1, -1):
            mn[lv] = np.array([min(int(mn[lv + 1][list(r)].sum()) for r in sym) for sym in rules[lv]], dtype=np.int64)
            mx[lv] = np.array([max(int(mx[lv + 1][list(r)].sum()) for r in sym) for sym in rules[lv]], dtype=np.int64)
        object.__setattr__(self, "min_len", mn)
        object.__setattr__(self, "max_len", mx)
        object.__setattr__(self, "flat", _flatten(self))

    # ------------------------------------------------------------------ facts
    @property
    def depth(self) -> int:
        """Levels below the root (terminal level included)."""
        return len(self.sizes) - 1

    @property
    def bos_id(self) -> int:
        """Token id of the sentence separator (the release's ``eos_token``): |T| + 1."""
        return self.num_terminals + 1

    @property
    def sentence_min_len(self) -> int:
        return int(self.min_len[0][0])

    @property
    def sentence_max_len(self) -> int:
        return int(self.max_len[0][0])

    @property
    def num_rules(self) -> int:
        return sum(len(sym) for lv in self.rules for sym in lv)

    def fingerprint(self) -> int:
        """64-bit digest of the rule structure and |T| (names and ids excluded): data namespaces depend on it."""
        return stable_hash64(
            "canonlm.cfg.grammar", [[list(map(list, s)) for s in lv] for lv in self.rules], self.num_terminals
        )

    def length_distribution(self) -> np.ndarray:
        """Exact distribution of the sentence length: float64 (sentence_max_len + 1,), entry L = P(len = L).

        Computed by convolving the length laws of a rule's children (bottom-up), averaging over rules."""
        law = [np.array([0.0, 1.0])] * self.num_terminals
        for lv in range(len(self.rules) - 1, -1, -1):
            new = []
            for sym in self.rules[lv]:
                acc = np.zeros(int(self.max_len[lv][len(new)]) + 1)
                for r in sym:
                    p = np.array([1.0])
                    for c in r:
                        p = np.convolve(p, law[c])
                    acc[: p.shape[0]] += p
                new.append(acc / len(sym))
            law = new
        return law[0]

    def entropy_rate(self) -> float:
        """Expected -log P(derivation) per token (nats): E[sum over non-terminal nodes of log #rules] / E[length].

        Used only to choose the per-token scale of :mod:`canonlm.data.cfg.inside`."""
        m = np.array([1.0])
        logp = 0.0
        for lv, syms in enumerate(self.rules):
            deg = np.array([len(s) for s in syms], dtype=np.float64)
            logp += float((m * np.log(deg)).sum())
            nxt = np.zeros(self.sizes[lv + 1])
            for a, sym in enumerate(syms):
                for r in sym:
                    for c in r:
                        nxt[c] += m[a] / len(sym)
            m = nxt
        return logp / float(m.sum())

    def to_dict(self) -> dict[str, Any]:
        """The grammar in the official JSON layout as a dict (see :func:`save_grammar`)."""
        T = self.num_terminals
        degs = [len(s) for lv in self.rules for s in lv]
        lens = [len(r) for lv in self.rules for s in lv for r in s]
        nt_sizes = list(self.sizes[1:-1])
        d: dict[str, Any] = dict(self.header)
        d.update(
            {
                "depth": self.depth,
                "num_sym": d.get("num_sym", nt_sizes[0] if nt_sizes and len(set(nt_sizes)) == 1 else T),
                "vocab_size": T,
                "deg_min": min(degs),
                "deg_max": max(degs),
                "len_min": min(lens),
                "len_max": max(lens),
                "eos_token": T + 1,
                "mask_token": T + 2,
                "sep_token": T + 3,
                "sizes": list(self.sizes),
                "idx": [list(lv) for lv in self.ids],
                "count": max(max(lv) for lv in self.ids),
            }
        )
        levels = []
        for lv in range(len(self.sizes)):
            nodes = []
            for a in range(self.sizes[lv]):
                ch = None if lv == self.depth else [list(r) for r in self.rules[lv][a]]
                nodes.append({"depth": lv, "id": self.ids[lv][a], "name": self.names[lv][a], "children": ch})
            levels.append(nodes)
        d["all"] = levels
        return d

    def __repr__(self) -> str:
        return (
            f"Grammar(depth={self.depth}, sizes={list(self.sizes)}, rules={self.num_rules}, "
            f"len {self.sentence_min_len}..{self.sentence_max_len})"
        )


@dataclass(frozen=True)
class FlatGrammar:
    """Numpy view of a grammar for the numba kernels. Global symbol g = ``lvl_off[l] + a``; G symbols in all.

    lvl_off int64 (depth+2,); sym_level int64 (G,); rule_off int64 (G_nt+1,) [rules of non-terminal g: rule_off[g]
    .. rule_off[g+1]; non-terminals are g < G_nt = lvl_off[depth]]; child_off int64 (R+1,); child int64 (total,)
    [global symbol of each child]; minlen / maxlen int64 (G,); logdeg float64 (G_nt,) [log #rules];
    num_terminals, depth: ints.
    """

    lvl_off: np.ndarray
    sym_level: np.ndarray
    rule_off: np.ndarray
    child_off: np.ndarray
    child: np.ndarray
    minlen: np.ndarray
    maxlen: np.ndarray
    num_terminals: int
    depth: int


def _flatten(g: Grammar) -> FlatGrammar:
    sizes = np.array(g.sizes, dtype=np.int64)
    lvl_off = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=lvl_off[1:])
    sym_level = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    rule_off, child_off, child = [0], [0], []
    for lv, syms in enumerate(g.rules):
        for sym in syms:
            for r in sym:
                child.extend(int(lvl_off[lv + 1]) + c for c in r)
                child_off.append(len(child))
            rule_off.append(len(child_off) - 1)
    return FlatGrammar(
        lvl_off=lvl_off,
        sym_level=sym_level,
        rule_off=np.array(rule_off, dtype=np.int64),
        child_off=np.array(child_off, dtype=np.int64),
        child=np.array(child, dtype=np.int64),
        minlen=np.concatenate(g.min_len).astype(np.int64),
        maxlen=np.concatenate(g.max_len).astype(np.int64),
        num_terminals=int(g.num_terminals),
        depth=g.depth,
    )


def _default_ids(sizes: Sequence[int]) -> tuple:
    """The release's id layout: terminals 1..T, specials T+1..T+3, then non-terminals bottom-up (root last)."""
    T = sizes[-1]
    ids = [None] * len(sizes)
    ids[-1] = tuple(range(1, T + 1))
    nxt = T + 4
    for lv in range(len(sizes) - 2, -1, -1):
        ids[lv] = tuple(range(nxt, nxt + sizes[lv]))
        nxt += sizes[lv]
    return tuple(ids)


def _structure_problem(rules: tuple, T: Any) -> str | None:
    """Why ``rules`` is not a valid layered grammar, or None."""
    if not _is_int(T) or T < 1:
        return f"the terminal level must hold at least 1 symbol, got {T!r}"
    if len(rules) < 1:
        return "at least one non-terminal level (the root) is required"
    if len(rules[0]) != 1:
        return f"level 0 must hold exactly one symbol (the root), got {len(rules[0])}"
    for lv, syms in enumerate(rules):
        nxt = T if lv == len(rules) - 1 else len(rules[lv + 1])
        if len(syms) < 1:
            return f"level {lv} is empty"
        for a, sym in enumerate(syms):
            if len(sym) < 1:
                return f"level {lv} node {a} has no rules"
            for k, r in enumerate(sym):
                if len(r) < 1:
                    return f"level {lv} node {a} rule {k} is empty"
                for c in r:
                    if not 0 <= c < nxt:
                        return f"level {lv} node {a} rule {k} child {c} out of range [0, {nxt})"
    return None


# ---------------------------------------------------------------------------------------------- JSON
def _bad(path: Any, why: str) -> ConfigError:
    return ConfigError(GRAMMAR_KEY, str(path), f"a Lano grammar JSON file in the official format; problem: {why}")


def grammar_from_dict(d: Any, path: Any = "<dict>") -> Grammar:
    """Validate a parsed official-format grammar and build a :class:`Grammar` (rules, ids and names exactly as given).

    Checks: ``all`` is a list of >= 2 non-empty levels of node objects; level 0 is the root alone; non-terminal
    nodes have a non-empty list of non-empty rules of integer positions in range of the next level; terminal nodes
    (last level) have ``children: null``; node ``depth`` equals its level; ids are unique integers, the terminal
    ids are exactly 1..|T| in order and no non-terminal uses one of them or ``eos_token``; the header keys present
    (``depth``, ``sizes``, ``idx``, ``vocab_size``, ``eos_token``, ``deg_min``/``deg_max``, ``len_min``/``len_max``)
    agree with the levels.
    Raises: ConfigError("task.grammar_file", path, ...) naming the first problem found.
    """
    if not isinstance(d, dict):
        raise _bad(path, "the top level is not a JSON object")
    lv_all = d.get("all")
    if not isinstance(lv_all, list) or len(lv_all) < 2:
        raise _bad(path, "key 'all' must be a list of at least 2 levels (root first, terminals last)")
    for lv, nodes in enumerate(lv_all):
        if not isinstance(nodes, list) or not nodes or not all(isinstance(x, dict) for x in nodes):
            raise _bad(path, f"level {lv} of 'all' must be a non-empty list of node objects")
    if len(lv_all[0]) != 1:
        raise _bad(path, f"level 0 must hold exactly the root, got {len(lv_all[0])} nodes")
    depth = len(lv_all) - 1
    rules = []
    ids, names = [], []
    for lv, nodes in enumerate(lv_all):
        lv_ids, lv_names, lv_rules = [], [], []
        for a, node in enumerate(nodes):
            where = f"level {lv} node {a}"
            if "depth" in node and node["depth"] != lv:
                raise _bad(path, f"{where} has depth {node['depth']!r}, expected {lv}")
            nid = node.get("id")
            if not _is_int(nid):
                raise _bad(path, f"{where} has no integer 'id'")
            lv_ids.append(int(nid))
            lv_names.append(str(node.get("name", _name_of(int(nid)) if nid >= 1 else str(nid))))
            if "children" not in node:
                raise _bad(path, f"{where} has no 'children' key")
            ch = node["children"]
            if lv == depth:
                if ch is not None:
                    raise _bad(path, f"{where} is a terminal (last level) but its children are not null")
                continue
            if not isinstance(ch, list) or not ch:
                raise _bad(path, f"{where} is a non-terminal but has no rules (children must be a non-empty list)")
            nxt = len(lv_all[lv + 1])
            sym = []
            for k, r in enumerate(ch):
                if not isinstance(r, list) or not r or not all(_is_int(c) for c in r):
                    raise _bad(path, f"{where} rule {k} must be a non-empty list of integers, got {r!r}")
                bad = [c for c in r if not 0 <= c < nxt]
                if bad:
                    raise _bad(path, f"{where} rule {k} child {bad[0]} out of range [0, {nxt}) of level {lv + 1}")
                sym.append(tuple(int(c) for c in r))
            lv_rules.append(tuple(sym))
        ids.append(tuple(lv_ids))
        names.append(tuple(lv_names))
        if lv < depth:
            rules.append(tuple(lv_rules))
    T = len(lv_all[-1])
    flat_ids = [i for lv in ids for i in lv]
    if len(set(flat_ids)) != len(flat_ids):
        raise _bad(path, "symbol ids are not unique")
    if list(ids[-1]) != list(range(1, T + 1)):
        raise _bad(path, f"terminal ids must be 1..{T} in order (they are the tokens), got {list(ids[-1])}")
    eos = d.get("eos_token", T + 1)
    if eos != T + 1:
        raise _bad(path, f"eos_token must be |T|+1 = {T + 1} (the <bos> separator token), got {eos!r}")
    nt_ids = [i for lv in ids[:-1] for i in lv]
    clash = [i for i in nt_ids if 1 <= i <= T + 1]
    if clash:
        raise _bad(path, f"non-terminal id {clash[0]} collides with a terminal or the eos token (1..{T + 1})")
    # header consistency
    if "depth" in d and d["depth"] != depth:
        raise _bad(path, f"header depth={d['depth']!r} but 'all' has {depth} levels below the root")
    sizes = [len(x) for x in lv_all]
    if "sizes" in d and d["sizes"] != sizes:
        raise _bad(path, f"header sizes={d['sizes']!r} but the levels hold {sizes} symbols")
    if "idx" in d and d["idx"] != [list(x) for x in ids]:
        raise _bad(path, "header idx does not list the node ids level by level")
    if "vocab_size" in d and d["vocab_size"] != T:
        raise _bad(path, f"header vocab_size={d['vocab_size']!r} but the terminal level holds {T} symbols")
    degs = [len(s) for lv in rules for s in lv]
    lens = [len(r) for lv in rules for s in lv for r in s]
    for key, vals, what in (("deg_min", degs, "rules per non-terminal"), ("len_min", lens, "rule length")):
        lo, hi = d.get(key), d.get(key.replace("min", "max"))
        if lo is not None and min(vals) < lo:
            raise _bad(path, f"a {what} of {min(vals)} is below header {key}={lo}")
        if hi is not None and max(vals) > hi:
            raise _bad(path, f"a {what} of {max(vals)} is above header {key.replace('min', 'max')}={hi}")
    header = {k: v for k, v in d.items() if k not in ("all",)}
    try:
        return Grammar(rules=tuple(rules), num_terminals=T, ids=tuple(ids), names=tuple(names), header=header)
    except ValueError as e:  # pragma: no cover - everything Grammar checks was checked above
        raise _bad(path, str(e)) from None


def load_grammar(path: str | os.PathLike) -> Grammar:
    """Read an official-format grammar JSON file (e.g. the release's ``cfg3f.json``) exactly.

    Raises: ConfigError("task.grammar_file", path, ...) if the file is missing/unreadable, not JSON, or not a valid
    grammar (see :func:`grammar_from_dict`).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise _bad(path, f"cannot read the file ({type(e).__name__}: {e})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(path, f"invalid JSON ({e})") from None
    return grammar_from_dict(d, path)


def save_grammar(grammar: Grammar, path: str | os.PathLike) -> None:
    """Write ``grammar`` in the official JSON format (atomic: a temporary file in the same folder, then rename).

    The file loads back to an identical grammar with :func:`load_grammar`. Raises OSError if the folder is not
    writable."""
    atomic_write_text(path, json.dumps(grammar.to_dict()))


# ---------------------------------------------------------------------------------------------- random family
def random_grammar(
    seed: int,
    depth: int,
    num_sym: int | Sequence[int],
    num_terminals: int,
    deg_min: int,
    deg_max: int,
    len_min: int,
    len_max: int,
    distinct_children: bool = False,
    cover_all: bool = True,
    max_tries: int = 10_000,
) -> Grammar:
    """Draw a layered grammar of the given family, deterministically from ``seed`` (counter-based words, no RNG
    state; identical on every platform and numpy version).

    Args:
        seed: int >= 0. depth: levels below the root (terminal level included), >= 1.
        num_sym: symbols of each non-terminal level below the root: an int (all levels) or a list of depth-1 ints.
        num_terminals: |T| >= 1. deg_min..deg_max: rules per non-terminal (uniform). len_min..len_max: rule length
            (uniform, >= 1). distinct_children: no symbol twice in one rule (the release's
            ``disallow_duplicate_sym``).
        cover_all: every symbol of a level appears in some rule of the level above.
    Construction, level by level from the root: each non-terminal draws its number of rules, each rule its length;
    with ``cover_all`` the next level's symbols are first placed in distinct, uniformly chosen child slots, the
    other slots are uniform. A level is redrawn (next counter) while it has a non-terminal with two equal rules, a
    rule repeating a symbol (``distinct_children``), two non-terminals with the same rule set, or too few slots to
    cover the next level.
    Grammars of one family differ in local ambiguity from seed to seed (a one-token flip of a sampled cfg3f-family
    sentence stays derivable 12-31% of the time over seeds 0..5; 9% for the official cfg3f): the release's selection
    criteria, if any, are not documented, so none is applied.
    Returns: :class:`Grammar`. Raises ValueError for inconsistent parameters or when ``max_tries`` draws of a level
    all fail (a family that cannot satisfy the constraints).
    """
    for key, v, lo in (
        ("seed", seed, 0),
        ("depth", depth, 1),
        ("num_terminals", num_terminals, 1),
        ("deg_min", deg_min, 1),
        ("deg_max", deg_max, 1),
        ("len_min", len_min, 1),
        ("len_max", len_max, 1),
    ):
        if not _is_int(v) or v < lo:
            raise ValueError(f"{key}={v!r} is not allowed; allowed: an integer >= {lo}")
    if deg_min > deg_max or len_min > len_max:
        raise ValueError(
            f"need deg_min <= deg_max and len_min <= len_max, got {deg_min}..{deg_max}, {len_min}..{len_max}"
        )
    if _is_int(num_sym):
        nts = [int(num_sym)] * (depth - 1)
    elif isinstance(num_sym, Sequence) and not isinstance(num_sym, str) and all(_is_int(x) for x in num_sym):
        nts = [int(x) for x in num_sym]
    else:
        raise ValueError(f"num_sym={num_sym!r} is not allowed; allowed: an int or a list of depth-1={depth - 1} ints")
    if len(nts) != depth - 1 or any(x < 1 for x in nts):
        raise ValueError(f"num_sym={num_sym!r} is not allowed; allowed: depth-1={depth - 1} positive sizes")
    sizes = [1] + nts + [int(num_terminals)]
    if distinct_children and len_min > min(sizes[1:]):
        raise ValueError("distinct_children needs len_min <= the size of every level")
    ns = stable_hash64(
        "canonlm.cfg.random_grammar",
        int(seed),
        depth,
        sizes,
        deg_min,
        deg_max,
        len_min,
        len_max,
        bool(distinct_children),
        bool(cover_all),
    )
    rules = []
    for lv in range(depth):
        n_here, n_next = sizes[lv], sizes[lv + 1]
        for attempt in range(max_tries):
            level = _draw_level(
                instance_keys(ns, np.array([lv]), np.array([attempt]))[0],
                n_here,
                n_next,
                deg_min,
                deg_max,
                len_min,
                len_max,
                distinct_children,
                cover_all,
            )
            if level is not None:
                rules.append(level)
                break
        else:
            raise ValueError(
                f"no valid level {lv} in {max_tries} draws (sizes {sizes}, deg {deg_min}..{deg_max}, "
                f"len {len_min}..{len_max}); relax the constraints"
            )
    header = {
        "num_sym": num_sym if _is_int(num_sym) else list(nts),
        "disallow_duplicate_sym": bool(distinct_children),
        "disallow_duplicate_seq": True,
    }
    return Grammar(rules=tuple(rules), num_terminals=int(num_terminals), header=header)


def _draw_level(
    key: np.uint64,
    n_here: int,
    n_next: int,
    deg_min: int,
    deg_max: int,
    len_min: int,
    len_max: int,
    distinct: bool,
    cover: bool,
):
    """One attempt at the rules of a level (None if it violates a constraint). All randomness: words of ``key``."""
    key = np.asarray([key], dtype=np.uint64)
    deg = deg_min + below(words(key, 0, np.arange(n_here)), deg_max - deg_min + 1)
    n_rules = int(deg.sum())
    rlen = len_min + below(words(key, 1, np.arange(n_rules)), len_max - len_min + 1)
    S = int(rlen.sum())
    if cover and S < n_next:
        return None
    kids = below(words(key, 2, np.arange(S)), n_next)
    if cover:
        # a uniform random injection of the next level's symbols into the slots: sort slots by random keys
        order = np.argsort(words(key, 3, np.arange(S)), kind="stable")
        kids[order[:n_next]] = np.arange(n_next)
    roff = np.concatenate([[0], np.cumsum(rlen)])
    doff = np.concatenate([[0], np.cumsum(deg)])
    level = []
    for a in range(n_here):
        sym = []
        for k in range(int(doff[a]), int(doff[a + 1])):
            r = tuple(int(c) for c in kids[roff[k] : roff[k + 1]])
            if distinct and len(set(r)) < len(r):
                return None
            sym.append(r)
        if len(set(sym)) < len(sym):
            return None
        level.append(tuple(sym))
    if len({frozenset(s) for s in level}) < len(level):
        return None
    return tuple(level)


def family_params(spec: str | Mapping[str, Any]) -> dict[str, Any]:
    """Family parameters of a preset name (:data:`PRESETS`) or a mapping of :data:`FAMILY_KEYS` (missing
    ``distinct_children`` = false). Raises ValueError for an unknown preset or keys."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown grammar family {spec!r}; allowed: {' | '.join(PRESETS)}")
        return {"distinct_children": False, **PRESETS[spec]}
    if isinstance(spec, Mapping):
        d = dict(spec)
        unknown = sorted(set(d) - set(FAMILY_KEYS))
        missing = sorted(set(FAMILY_KEYS) - set(d) - {"distinct_children"})
        if unknown or missing:
            raise ValueError(f"grammar family keys: unknown {unknown}, missing {missing}; allowed: {FAMILY_KEYS}")
        d.setdefault("distinct_children", False)
        if not isinstance(d["num_sym"], int):
            d["num_sym"] = list(d["num_sym"])
        return d
    raise ValueError(f"grammar family {spec!r} must be a preset name or a mapping")


def preset_grammar(name: str | Mapping[str, Any], seed: int = 0) -> Grammar:
    """The grammar canonlm generates for family preset ``name`` (or a family mapping) and ``seed``."""
    return random_grammar(int(seed), **family_params(name))


__all__ = [
    "Grammar",
    "FlatGrammar",
    "PRESETS",
    "FAMILY_KEYS",
    "load_grammar",
    "save_grammar",
    "grammar_from_dict",
    "random_grammar",
    "family_params",
    "preset_grammar",
]
