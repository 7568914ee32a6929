"""Mano: mental evaluation of a random prefix expression modulo 23 (paper App. A.4).

One instance (paper App. A.4, compact layout):

    <bos> <len_ℓ> op ... operand ... <ans> answer          (2ℓ + 5 tokens)

e.g. ``<bos> <len_3> + * 4 5 - 7 1 <ans> 3`` = ((4*5) + (7-1)) mod 23, ℓ = 3.

* ℓ (the number of operators) is uniform in {1..L} for ``train`` and equal to L for ``val`` / ``test``.
* The expression tree is built top-down: a sub-tree with ℓ' > 0 operators draws its operator uniformly from
  ``ops`` and splits the other ℓ'-1 operators into a left sub-tree of ℓ1 ~ U{0..ℓ'-1} and a right one of
  ℓ'-1-ℓ1; a sub-tree with 0 operators is a leaf operand uniform in {0..mod-1}. It is written in prefix
  (pre-order) form, 2ℓ+1 tokens. The answer is its value mod ``mod``: ``sub`` = left - right, ``div`` = left times
  the modular inverse of right (``div`` needs a prime ``mod``).
* With ``div``, an expression containing a zero divisor is discarded and a new expression with the same ℓ is drawn
  (attempt 1, 2, ...) [gap: the release restarts, the paper never uses div; keeping ℓ fixed keeps ℓ uniform].
* Loss targets: every token (``loss_on: all``, paper) or ``<ans>`` and the answer token (``loss_on: answers``).
  Scored: the single answer token, metric group ℓ (``num_groups = L + 1``, group 0 unused); the paper's metric is
  its teacher-forced accuracy at ℓ = L over every problem of the 1024-token windows (paper App. A.4).

Randomness (counter-based, :mod:`canonlm.data.seeding`; instance (w, i) of a split is a pure function of the seed,
``L``, ``ops``, ``mod``, the split, w and i): with ``key`` = the instance key,

* ℓ = 1 + (word(key, purpose 0, 0) mod L) (train only);
* attempt a, prefix position p (0..2ℓ): word x = word(key, purpose 2 + a, p). An operator node with ℓ' operators
  uses op = ``ops[x mod n_ops]`` and ℓ1 = (x div n_ops) mod ℓ'; a leaf uses value x mod ``mod``;
* ``knowledge_augment``: the synonym of the token at sequence position t is bit (t mod 64) of
  word(key, purpose 1, t div 64) (0 = first synonym). Synonyms never change the expression: the namespace does
  not include ``knowledge_augment``, ``vocab`` or ``loss_on``, so those switches relabel the same problems.

The per-instance work runs in one numba kernel (``@njit(cache=True)``) drawing its words with
:mod:`canonlm.data.seeding_numba`, which reproduces :func:`canonlm.data.seeding.words` bit for bit.

Vocabulary, ``vocab: compact`` (n_ops = number of enabled operators, in the fixed order add, sub,
mul, div):

* ``knowledge_augment: false`` (paper): 0 = pad, 1..mod = operands 0..mod-1, mod+1..mod+n_ops = operators,
  mod+n_ops+1 = ``<bos>``, mod+n_ops+2 = ``<ans>``, mod+n_ops+2+ℓ = ``<len_ℓ>`` (ℓ = 1..L);
  ``vocab_size = mod + n_ops + L + 3``.
* ``knowledge_augment: true`` (release synonyms): 0 = pad, 1..mod = operands, then the operators'
  first synonyms (n_ops ids), their second synonyms (n_ops), ``<bos>``, ``<bos'>``, then per ℓ = 1..L the pair
  ``<len_ℓ>``, ``<len_ℓ'>``, then per ℓ the length-specific answer markers ``<ans_ℓ>``, ``<ans_ℓ'>``;
  ``vocab_size = mod + 2 n_ops + 4L + 3``.

``vocab: official`` (release ids, ``vocab_size = 10000``): operand v = 5000+v; add 1|5, sub 2|6, mul 3|7,
div 4|8; ``<bos>`` 9999|9998; ``<len_ℓ>`` 10ℓ|10ℓ+1; answer marker 10ℓ+4|10ℓ+5 (the answer marker is always the
length-specific one); without ``knowledge_augment`` only the first synonym of each is used. Configurations whose
official ids collide or exceed 9999 are rejected (e.g. L >= 500 with mod 23: 10ℓ reaches the operands).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
from numba import njit

from canonlm.data import ConfigError
from canonlm.data.seeding import instance_keys, words
from canonlm.data.seeding_numba import word
from canonlm.data.tasks import Instance, InstanceBatch, check_split
from canonlm.data.tasks._common import (
    cached_namespace,
    check_bool,
    check_choice,
    check_indices,
    check_int,
    decode_plain,
    is_int,
    merge_config,
    parse_index,
)

OPS = ("add", "sub", "mul", "div")  # canonical operator order (index = operator code)
OP_SYMBOLS = ("+", "-", "*", "/")
DEFAULTS: dict[str, Any] = dict(
    name="mano",
    L=10,
    ops=["add", "sub", "mul"],
    mod=23,
    knowledge_augment=False,
    loss_on="all",
    vocab="compact",
    context=1024,
    tail="drop",
    seed=0,
)
KEYS = tuple(DEFAULTS)

# Purposes of the random words of one instance (see canonlm.data.seeding.words); attempt a uses _P_NODE + a.
_P_ELL, _P_SYN, _P_NODE = 0, 1, 2
_MAX_L = 2**16
_MAX_MOD = 2**16
_MAX_EXPECTED_ATTEMPTS = 1000.0
_OFF_VOCAB = 10000
_OFF_OPERAND, _OFF_BOS = 5000, (9999, 9998)

_ONE = np.uint64(1)  # uint64 constants of the kernel's synonym bits
_B63 = np.uint64(63)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


# ---------------------------------------------------------------------------------------------- numba kernel
@njit(cache=True)
def _mano_kernel(
    keys, ell, offsets, op_code, mod, inv, ka, t_operand, t_op, t_bos, t_len, t_ans, out_tok, out_val, out_att
):
    """Fill ``out_tok`` (instance r at offsets[r]:offsets[r+1], 2ℓ+5 tokens), ``out_val`` (answer values) and
    ``out_att`` (attempts used). op_code: int64 (n_ops,) canonical code (0 add, 1 sub, 2 mul, 3 div) per enabled
    operator; inv: int64 (mod,) modular inverses (inv[0] unused); t_*: final token ids (synonym s in row s)."""
    n_ops = np.uint64(op_code.shape[0])
    umod = np.uint64(mod)
    lmax = 1
    for r in range(ell.shape[0]):
        if ell[r] > lmax:
            lmax = ell[r]
    kind = np.empty(2 * lmax + 1, dtype=np.int64)  # >= 0: enabled-operator index; < 0: leaf -1-v
    stack = np.empty(lmax + 2, dtype=np.int64)
    vals = np.empty(lmax + 2, dtype=np.int64)
    for r in range(keys.shape[0]):
        key = keys[r]
        lr = ell[r]
        n = 2 * lr + 1
        att = 0
        while True:
            sp = 1
            stack[0] = lr
            for p in range(n):
                sp -= 1
                s = stack[sp]
                x = word(key, _P_NODE + att, p)
                if s > 0:
                    kind[p] = np.int64(x % n_ops)
                    l1 = np.int64((x // n_ops) % np.uint64(s))
                    stack[sp] = s - 1 - l1  # right sub-tree (popped after the left one)
                    stack[sp + 1] = l1
                    sp += 2
                else:
                    kind[p] = -1 - np.int64(x % umod)
            vp = 0
            ok = True
            for p in range(n - 1, -1, -1):  # right to left: operands of an operator are on top of the stack
                k = kind[p]
                if k < 0:
                    vals[vp] = -1 - k
                    vp += 1
                    continue
                a = vals[vp - 1]  # left operand
                b = vals[vp - 2]  # right operand
                c = op_code[k]
                if c == 0:
                    v = (a + b) % mod
                elif c == 1:
                    v = (a - b + mod) % mod
                elif c == 2:
                    v = (a * b) % mod
                else:
                    if b == 0:
                        ok = False
                        break
                    v = (a * inv[b]) % mod
                vals[vp - 2] = v
                vp -= 1
            if ok:
                break
            att += 1
        val = vals[0]
        out_val[r] = val
        out_att[r] = att + 1
        o = offsets[r]
        m = 2 * lr + 5
        bits = np.uint64(0)
        blk = -1
        for t in range(m):
            s = 0
            if ka:
                if (t >> 6) != blk:
                    blk = t >> 6
                    bits = word(key, _P_SYN, blk)
                s = np.int64((bits >> (np.uint64(t) & _B63)) & _ONE)
            if t == 0:
                tok = t_bos[s]
            elif t == 1:
                tok = t_len[s, lr]
            elif t < m - 2:
                k = kind[t - 2]
                tok = t_op[s, k] if k >= 0 else t_operand[-1 - k]
            elif t == m - 2:
                tok = t_ans[s, lr]
            else:
                tok = t_operand[val]
            out_tok[o + t] = tok


# ---------------------------------------------------------------------------------------------- the task
class ManoTask:
    """Mano task (paper App. A.4). Build with :func:`canonlm.data.tasks.build_task` (``"mano"``).

    Attributes:
        name: ``"mano"``. cfg: the validated config (dict with every key of ``KEYS``; ``ops`` in canonical order).
        L, ops (tuple of operator names), mod, knowledge_augment, loss_on, vocab, context, tail, seed: config.
        vocab_size: int, pad id 0 included. pad_id: 0. num_groups: L + 1 (metric group = ℓ). group_name: ``"l"``.
        chance: 1 / mod (guessing the answer token).
        bos_id; ans_id (the single ``<ans>``: compact without knowledge_augment; else None).
        Id helpers (synonym 0 or, with knowledge_augment, 1): operand_id(v), op_id(op, s), bos_marker_id(s),
        len_id(ell, s), ans_marker_id(ell, s).
    Raises ConfigError (naming ``task.<key>``) for unknown keys, wrong types, L outside [1, 2**16], mod outside
    [2, 2**16] or not prime with ``div``, empty / duplicate / unknown ``ops``, bad ``loss_on`` / ``vocab`` / ``tail``,
    a non-bool ``knowledge_augment``, context < 1, seed < 0, colliding official ids (``task.L`` / ``task.mod``),
    and ``div`` with an L that would need more than 1000 expected attempts per expression (``task.L``).
    """

    group_name = "l"
    pad_id = 0

    def __init__(self, name: str, cfg: Mapping[str, Any]):
        c = merge_config(name, cfg, {"mano": DEFAULTS}, KEYS)
        self.name = name
        self.L = check_int("L", c["L"], 1, _MAX_L)
        self.mod = check_int("mod", c["mod"], 2, _MAX_MOD)
        ops = c["ops"]
        if (
            isinstance(ops, (str, bytes))
            or not isinstance(ops, Sequence)
            or len(ops) == 0
            or not all(isinstance(o, str) and o in OPS for o in ops)
            or len(set(ops)) != len(ops)
        ):
            raise ConfigError("task.ops", ops, f"a non-empty list of distinct operators from {list(OPS)}")
        self.ops = tuple(o for o in OPS if o in set(ops))
        if "div" in self.ops and not _is_prime(self.mod):
            raise ConfigError(
                "task.mod", self.mod, "a prime (ops include div: every non-zero divisor needs an inverse)"
            )
        self.knowledge_augment = check_bool("knowledge_augment", c["knowledge_augment"])
        self.loss_on = check_choice("loss_on", c["loss_on"], ("all", "answers"))
        self.vocab = check_choice("vocab", c["vocab"], ("compact", "official"))
        self.context = check_int("context", c["context"], 1)
        self.tail = check_choice("tail", c["tail"], ("drop", "carry"))
        self.seed = check_int("seed", c["seed"], 0)
        n_ops = len(self.ops)
        if "div" in self.ops:
            # P(a given operator is a division by zero) ~ 1/(n_ops * mod); expected attempts at ℓ = L
            per_op = -math.log1p(-1.0 / (n_ops * self.mod))
            if self.L * per_op > math.log(_MAX_EXPECTED_ATTEMPTS):
                l_max = int(math.log(_MAX_EXPECTED_ATTEMPTS) / per_op)
                raise ConfigError(
                    "task.L",
                    self.L,
                    f"an integer <= {l_max} when ops include div (an expression "
                    "with a zero divisor is redrawn; expected draws "
                    f"~(1 - 1/(n_ops*mod))**-L must stay below "
                    f"{_MAX_EXPECTED_ATTEMPTS:.0f})",
                )
        self.cfg = {**c, "ops": list(self.ops)}
        self._build_vocab()
        self.num_groups = self.L + 1
        self.chance = 1.0 / self.mod
        self._op_code = np.array([OPS.index(o) for o in self.ops], dtype=np.int64)
        inv = np.zeros(self.mod, dtype=np.int64)
        if "div" in self.ops:
            inv[1:] = [pow(v, -1, self.mod) for v in range(1, self.mod)]
        self._inv = inv
        self._ns_cache: dict[tuple[str, int], int] = {}

    # ------------------------------------------------------------------ vocabulary
    def _build_vocab(self) -> None:
        """Token tables (final ids; row s = synonym s): operand (mod,), op (2, n_ops), bos (2,), len (2, L+1),
        ans (2, L+1); the printable name of every id; official-id collision checks."""
        L, mod, n_ops, ka = self.L, self.mod, len(self.ops), self.knowledge_augment
        n_syn = 2 if ka else 1
        t_operand = np.zeros(mod, dtype=np.int64)
        t_op = np.zeros((2, n_ops), dtype=np.int64)
        t_bos = np.zeros(2, dtype=np.int64)
        t_len = np.zeros((2, L + 1), dtype=np.int64)
        t_ans = np.zeros((2, L + 1), dtype=np.int64)
        sym = [OP_SYMBOLS[OPS.index(o)] for o in self.ops]
        prime = ("", "'")
        entries: list[tuple[int, str]] = []  # (id, printable name)

        if self.vocab == "compact":
            t_operand[:] = 1 + np.arange(mod)
            nxt = 1 + mod
            for s in range(n_syn):
                t_op[s] = nxt + np.arange(n_ops)
                nxt += n_ops
            for s in range(n_syn):
                t_bos[s] = nxt
                nxt += 1
            if ka:
                for ell in range(1, L + 1):
                    t_len[:, ell] = (nxt, nxt + 1)
                    nxt += 2
                for ell in range(1, L + 1):
                    t_ans[:, ell] = (nxt, nxt + 1)
                    nxt += 2
            else:
                t_ans[0, 1:] = nxt
                nxt += 1
                t_len[0, 1:] = nxt + np.arange(L)
                nxt += L
            self.vocab_size = nxt
        else:
            t_operand[:] = _OFF_OPERAND + np.arange(mod)
            codes = np.array([OPS.index(o) for o in self.ops])
            t_op[0], t_op[1] = 1 + codes, 5 + codes
            t_bos[:] = _OFF_BOS
            ls = np.arange(1, L + 1)
            t_len[0, 1:], t_len[1, 1:] = 10 * ls, 10 * ls + 1
            t_ans[0, 1:], t_ans[1, 1:] = 10 * ls + 4, 10 * ls + 5
            self.vocab_size = _OFF_VOCAB

        entries += [(int(t_operand[v]), str(v)) for v in range(mod)]
        for s in range(n_syn):
            entries += [(int(t_op[s, k]), sym[k] + prime[s]) for k in range(n_ops)]
            entries.append((int(t_bos[s]), "<bos>" if s == 0 else "<bos'>"))
            entries += [(int(t_len[s, ell]), f"<len_{ell}{prime[s]}>") for ell in range(1, L + 1)]
        if self.vocab == "compact" and not ka:
            entries.append((int(t_ans[0, 1]), "<ans>"))
        else:
            for s in range(n_syn):
                entries += [(int(t_ans[s, ell]), f"<ans_{ell}{prime[s]}>") for ell in range(1, L + 1)]
        if self.vocab == "official":
            self._check_official(entries)
        names = [f"<unused_{i}>" for i in range(self.vocab_size)]
        names[0] = "<pad>"
        for tid, nm in entries:
            names[tid] = nm
        self._names = names
        self._t_operand, self._t_op, self._t_bos, self._t_len, self._t_ans = t_operand, t_op, t_bos, t_len, t_ans
        self.bos_id = int(t_bos[0])
        self.ans_id = int(t_ans[0, 1]) if (self.vocab == "compact" and not ka) else None

    def _check_official(self, entries: list[tuple[int, str]]) -> None:
        """ConfigError if two official ids coincide or an id leaves [1, 9999]: ``task.mod`` when the operands
        5000+v reach ``<bos>`` (9999, and 9998 with knowledge_augment), ``task.L`` otherwise (10ℓ.. ids reaching
        the operands, ``<bos>`` or 10000)."""
        bos = _OFF_BOS[: 2 if self.knowledge_augment else 1]
        if _OFF_OPERAND + self.mod - 1 >= min(bos):
            raise ConfigError(
                "task.mod",
                self.mod,
                f"an integer <= {min(bos) - _OFF_OPERAND} with vocab=official"
                f"{' and knowledge_augment' if self.knowledge_augment else ''}"
                f" (operands 5000+v stay below <bos> ids {list(bos)})",
            )
        seen: dict[int, str] = {}
        for tid, nm in entries:
            if not 1 <= tid < _OFF_VOCAB or tid in seen:
                # largest L without a collision, for the message (ids of ℓ: 10ℓ + offs; operators are < 10)
                used = set(range(_OFF_OPERAND, _OFF_OPERAND + self.mod)) | set(bos)
                offs = (0, 1, 4, 5) if self.knowledge_augment else (0, 4)
                ok_l = 0
                while not any(10 * (ok_l + 1) + o in used or 10 * (ok_l + 1) + o >= _OFF_VOCAB for o in offs):
                    ok_l += 1
                other = f"token {seen[tid]!r}" if tid in seen else "nothing: ids must lie in [1, 9999]"
                raise ConfigError(
                    "task.L",
                    self.L,
                    f"an integer <= {ok_l} with vocab=official and mod={self.mod} "
                    f"(official id {tid} of {nm} collides with {other})",
                )
            seen[tid] = nm

    def operand_id(self, v: int) -> int:
        """Token id of operand value v in [0, mod); ValueError otherwise."""
        if not is_int(v) or not 0 <= v < self.mod:
            raise ValueError(f"v={v!r} is not allowed; allowed: an integer in [0, {self.mod})")
        return int(self._t_operand[v])

    def op_id(self, op: str, synonym: int = 0) -> int:
        """Token id of operator ``op`` (one of ``self.ops``), synonym 0 or (with knowledge_augment) 1."""
        if op not in self.ops:
            raise ValueError(f"op={op!r} is not allowed; allowed: {' | '.join(self.ops)}")
        self._check_syn(synonym)
        return int(self._t_op[synonym, self.ops.index(op)])

    def len_id(self, ell: int, synonym: int = 0) -> int:
        """Token id of ``<len_ell>``, ell in [1, L]."""
        self._check_l(ell)
        self._check_syn(synonym)
        return int(self._t_len[synonym, ell])

    def ans_marker_id(self, ell: int, synonym: int = 0) -> int:
        """Token id of the answer marker of an instance with ell operators (``<ans>`` for compact without
        knowledge_augment, whatever ell)."""
        self._check_l(ell)
        self._check_syn(synonym)
        return int(self._t_ans[synonym, ell])

    def bos_marker_id(self, synonym: int = 0) -> int:
        """Token id of ``<bos>`` (synonym 0) or ``<bos'>`` (synonym 1, knowledge_augment only)."""
        self._check_syn(synonym)
        return int(self._t_bos[synonym])

    def _check_l(self, ell: Any) -> None:
        if not is_int(ell) or not 1 <= ell <= self.L:
            raise ValueError(f"ell={ell!r} is not allowed; allowed: an integer in [1, {self.L}]")

    def _check_syn(self, s: Any) -> None:
        if s not in ((0, 1) if self.knowledge_augment else (0,)):
            raise ValueError(
                f"synonym={s!r} is not allowed; allowed: 0"
                + (" | 1" if self.knowledge_augment else " (knowledge_augment is off)")
            )

    def token_names(self) -> list[str]:
        """Printable name of every id, index = id (length ``vocab_size``): ``<pad>``, operands ``0``..``22``,
        operators ``+ - * /`` (synonyms ``+'`` ...), ``<bos>`` (``<bos'>``), ``<len_ℓ>`` (``<len_ℓ'>``), ``<ans>``
        (compact without knowledge_augment) or ``<ans_ℓ>`` (``<ans_ℓ'>``); ids unused by the layout (official) are
        ``<unused_id>``."""
        return list(self._names)

    def decode(self, ids: Any) -> str:
        """Space-separated token names of a 1-D id sequence (list, numpy array or torch tensor); unknown ids print
        as ``<unk_id>``. Example: ``<bos> <len_2> + 4 * 5 6 <ans> 11``."""
        return decode_plain(ids, self._names)

    # ------------------------------------------------------------------ sizes
    def max_instance_len(self, split: str) -> int:
        """Longest instance of ``split`` in tokens: 2L + 5 (every split reaches ℓ = L)."""
        check_split(split)
        return 2 * self.L + 5

    def min_instance_len(self, split: str) -> int:
        """Shortest instance of ``split`` in tokens: 7 (ℓ = 1) for train, 2L + 5 otherwise."""
        check_split(split)
        return 7 if split == "train" else 2 * self.L + 5

    def estimate_lengths(self, split: str, w: Any, i: Any, seed: int | None = None) -> np.ndarray:
        """float64 (I,): the exact lengths 2ℓ + 5 of instances (w, i) (one random word each)."""
        check_split(split)
        w, i = check_indices(w, i)
        return (2 * self._ells(split, instance_keys(self._namespace(split, seed), w, i)) + 5).astype(np.float64)

    # ------------------------------------------------------------------ generation
    def _namespace(self, split: str, seed: int | None) -> int:
        return cached_namespace(
            self._ns_cache,
            split,
            seed,
            self.seed,
            lambda: ("canonlm.data", "mano", dict(L=self.L, ops=list(self.ops), mod=self.mod)),
        )

    def _ells(self, split: str, keys: np.ndarray) -> np.ndarray:
        if split == "train":
            return 1 + (words(keys, _P_ELL, 0) % np.uint64(self.L)).astype(np.int64)
        return np.full(keys.shape[0], self.L, dtype=np.int64)

    def generate(self, split: str, w: Any, i: Any, seed: int | None = None) -> InstanceBatch:
        """Generate instances ``(w[r], i[r])`` of ``split`` (one compiled pass over all of them).

        Args: split: train | val | test. w, i: non-negative integer arrays of equal length I (window index,
            instance index within the window). seed: data seed (default: the config's ``seed``).
        Returns: :class:`InstanceBatch` (instances in request order, 2ℓ+5 tokens each; one answer per instance: the
            last token, ans_len 1, group ℓ); meta: ``ell`` int64 (I,) operators per instance, ``value`` int64 (I,)
            the answer value in [0, mod), ``attempts`` int64 (I,) expressions drawn (> 1 only with div).
        Raises ValueError for a bad split, negative or mismatched indices.
        """
        check_split(split)
        w, i = check_indices(w, i)
        keys = instance_keys(self._namespace(split, seed), w, i)
        I = keys.shape[0]
        ell = self._ells(split, keys)
        lens = 2 * ell + 5
        offsets = np.zeros(I + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        S = int(offsets[-1])
        tokens = np.empty(S, dtype=np.int64)
        value = np.empty(I, dtype=np.int64)
        att = np.empty(I, dtype=np.int64)
        if I:
            _mano_kernel(
                keys,
                ell,
                offsets,
                self._op_code,
                self.mod,
                self._inv,
                self.knowledge_augment,
                self._t_operand,
                self._t_op,
                self._t_bos,
                self._t_len,
                self._t_ans,
                tokens,
                value,
                att,
            )
        if self.loss_on == "all":
            loss = np.ones(S, dtype=bool)
        else:
            loss = np.zeros(S, dtype=bool)
            loss[offsets[1:] - 1] = True
            loss[offsets[1:] - 2] = True
        return InstanceBatch(
            tokens=tokens,
            loss_mask=loss,
            offsets=offsets,
            ans_inst=np.arange(I, dtype=np.int64),
            ans_start=lens - 1,
            ans_len=np.ones(I, dtype=np.int64),
            ans_group=ell.astype(np.int32),
            ans_offsets=np.arange(I + 1, dtype=np.int64),
            meta={"ell": ell, "value": value, "attempts": att},
        )

    def instance(self, split: str, index: int | tuple[int, int], seed: int | None = None) -> Instance:
        """One instance. ``index`` = (w, i) (window w, i-th instance of it) or an int i, meaning (i, 0). Returns
        :class:`Instance` with meta ``ell``, ``value``, ``attempts`` (ints). ValueError on bad input."""
        w, i = parse_index(index)
        b = self.generate(split, [w], [i], seed)
        aid, grp = b.token_answers()
        return Instance(
            tokens=b.tokens,
            loss_mask=b.loss_mask,
            answer_id=aid,
            group=grp,
            meta={k: int(v[0]) for k, v in b.meta.items()},
        )

    def __repr__(self) -> str:
        return (
            f"ManoTask(L={self.L}, ops={list(self.ops)}, mod={self.mod}, knowledge_augment="
            f"{self.knowledge_augment}, vocab={self.vocab}, vocab_size={self.vocab_size})"
        )


__all__ = ["ManoTask", "DEFAULTS", "KEYS", "OPS"]
