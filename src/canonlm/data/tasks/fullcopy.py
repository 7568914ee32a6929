"""Full copy: reproduce a random permutation after a ``<query>`` token (paper Fig. 5).

One instance (2n + 2 tokens, n = ``n_tokens``):

    <bos> x1 x2 ... xn <query> x1 x2 ... xn

where x1..xn is a uniformly random permutation of the content tokens 1..n. Loss targets: the n copied tokens only
(not ``<bos>``, the first half or ``<query>``). Scored: the whole copy as one answer (metric group 1,
``num_groups = 2``, group name ``copy``), so the trainer's ``acc`` is whole-copy exact match and ``token_acc`` is
per-token copy accuracy.

``chance`` is None: guessing the whole copy has probability 1/n! (no meaningful floor); the per-token guessing rate
1/n is ``token_chance``.

Vocabulary (compact only; the release ships no generator and no ids for this task): 0 = pad, 1..n = content tokens,
n+1 = ``<bos>``, n+2 = ``<query>``; ``vocab_size = n + 3``. ``vocab: official`` is rejected.

Randomness (counter-based, :mod:`canonlm.data.seeding`): the permutation of instance (w, i) is the stable argsort
of the random words word(key, purpose 0, j), j = 0..n-1 (content token j+1 gets key j); the namespace depends on
(seed, n_tokens, split) only, so instance (w, i) never depends on what else is generated in the same call.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from canonlm.data import ConfigError
from canonlm.data.seeding import instance_keys, words
from canonlm.data.tasks import Instance, InstanceBatch, check_split
from canonlm.data.tasks._common import (
    cached_namespace,
    check_choice,
    check_indices,
    check_int,
    decode_plain,
    merge_config,
    parse_index,
)

DEFAULTS: dict[str, Any] = dict(name="fullcopy", n_tokens=500, vocab="compact", context=1024, tail="drop", seed=0)
KEYS = tuple(DEFAULTS)
_P_PERM = 0
_MAX_N = 2**20
_MAX_TOKENS_PER_CALL = 2**27  # generate() splits larger requests into chunks (memory of the (I, n) key matrix)


class FullCopyTask:
    """Full-copy task (paper Fig. 5). Build with :func:`canonlm.data.tasks.build_task` (``"fullcopy"``).

    Attributes:
        name: ``"fullcopy"``. cfg: the validated config. n_tokens, vocab, context, tail, seed: config.
        vocab_size: n_tokens + 3. pad_id: 0. bos_id: n_tokens + 1. query_id: n_tokens + 2.
        num_groups: 2 (group 1 = the copy; ``group_labels`` {1: "copy"}). group_name: ``"copy"``.
        chance: None (whole copy; see the module docstring). token_chance: 1 / n_tokens.
    Raises ConfigError (naming ``task.<key>``) for unknown keys, n_tokens outside [2, 2**20], vocab other than
    ``compact`` (``official`` is explicitly rejected: the release has no ids for this task), a bad tail,
    context < 1 or seed < 0.
    """

    group_name = "copy"
    pad_id = 0
    num_groups = 2
    group_labels = {1: "copy"}
    chance = None

    def __init__(self, name: str, cfg: Mapping[str, Any]):
        c = merge_config(name, cfg, {"fullcopy": DEFAULTS}, KEYS)
        self.name = name
        self.n_tokens = check_int("n_tokens", c["n_tokens"], 2, _MAX_N)
        if c["vocab"] == "official":
            raise ConfigError(
                "task.vocab",
                "official",
                "compact (the official release has no full-copy generator and no token ids for it)",
            )
        self.vocab = check_choice("vocab", c["vocab"], ("compact",))
        self.context = check_int("context", c["context"], 1)
        self.tail = check_choice("tail", c["tail"], ("drop", "carry"))
        self.seed = check_int("seed", c["seed"], 0)
        self.cfg = dict(c)
        n = self.n_tokens
        self.bos_id, self.query_id = n + 1, n + 2
        self.vocab_size = n + 3
        self.token_chance = 1.0 / n
        self._ns_cache: dict[tuple[str, int], int] = {}

    # ------------------------------------------------------------------ vocabulary
    def token_names(self) -> list[str]:
        """Printable name of every id (length ``vocab_size``): ``<pad>``, ``1``..``n``, ``<bos>``, ``<query>``."""
        return ["<pad>"] + [str(v) for v in range(1, self.n_tokens + 1)] + ["<bos>", "<query>"]

    def decode(self, ids: Any) -> str:
        """Space-separated token names of a 1-D id sequence (list, numpy array or torch tensor); unknown ids print
        as ``<unk_id>``. Example: ``<bos> 3 1 2 <query> 3 1 2``."""
        return decode_plain(ids, self.token_names())

    # ------------------------------------------------------------------ sizes
    def max_instance_len(self, split: str) -> int:
        """2 n_tokens + 2 (every instance has this length)."""
        check_split(split)
        return 2 * self.n_tokens + 2

    def min_instance_len(self, split: str) -> int:
        """2 n_tokens + 2 (every instance has this length)."""
        check_split(split)
        return 2 * self.n_tokens + 2

    def estimate_lengths(self, split: str, w: Any, i: Any, seed: int | None = None) -> np.ndarray:
        """float64 (I,): the exact length 2 n_tokens + 2 of every instance."""
        check_split(split)
        w, _ = check_indices(w, i)
        return np.full(w.shape[0], 2.0 * self.n_tokens + 2.0)

    # ------------------------------------------------------------------ generation
    def _namespace(self, split: str, seed: int | None) -> int:
        return cached_namespace(
            self._ns_cache, split, seed, self.seed, lambda: ("canonlm.data", "fullcopy", dict(n_tokens=self.n_tokens))
        )

    def permutations(self, split: str, w: Any, i: Any, seed: int | None = None) -> np.ndarray:
        """int64 (I, n_tokens): the permutation of 1..n_tokens of each instance (w[r], i[r])."""
        check_split(split)
        w, i = check_indices(w, i)
        keys = instance_keys(self._namespace(split, seed), w, i)
        n = self.n_tokens
        out = np.empty((keys.shape[0], n), dtype=np.int64)
        step = max(1, _MAX_TOKENS_PER_CALL // (2 * n + 2))
        j = np.arange(n, dtype=np.int64)[None, :]
        for s in range(0, keys.shape[0], step):
            rnd = words(keys[s : s + step, None], _P_PERM, j)  # (chunk, n)
            out[s : s + step] = np.argsort(rnd, axis=1, kind="stable") + 1
        return out

    def generate(self, split: str, w: Any, i: Any, seed: int | None = None) -> InstanceBatch:
        """Generate instances ``(w[r], i[r])`` of ``split`` (vectorised: one argsort of random keys per row).

        Args: split: train | val | test. w, i: non-negative integer arrays of equal length I. seed: data seed
            (default: the config's ``seed``).
        Returns: :class:`InstanceBatch` (2n+2 tokens per instance; one answer per instance: the copy, starting at
            n+2, ans_len n, group 1); meta: empty.
        Raises ValueError for a bad split, negative or mismatched indices.
        """
        perm = self.permutations(split, w, i, seed)
        I, n = perm.shape
        m = 2 * n + 2
        tok = np.empty((I, m), dtype=np.int64)
        tok[:, 0] = self.bos_id
        tok[:, 1 : n + 1] = perm
        tok[:, n + 1] = self.query_id
        tok[:, n + 2 :] = perm
        loss = np.zeros((I, m), dtype=bool)
        loss[:, n + 2 :] = True
        return InstanceBatch(
            tokens=tok.reshape(-1),
            loss_mask=loss.reshape(-1),
            offsets=np.arange(I + 1, dtype=np.int64) * m,
            ans_inst=np.arange(I, dtype=np.int64),
            ans_start=np.full(I, n + 2, dtype=np.int64),
            ans_len=np.full(I, n, dtype=np.int64),
            ans_group=np.ones(I, dtype=np.int32),
            ans_offsets=np.arange(I + 1, dtype=np.int64),
            meta={},
        )

    def instance(self, split: str, index: int | tuple[int, int], seed: int | None = None) -> Instance:
        """One instance. ``index`` = (w, i) or an int i, meaning (i, 0). Returns :class:`Instance` (meta empty).
        ValueError on bad input."""
        w, i = parse_index(index)
        b = self.generate(split, [w], [i], seed)
        aid, grp = b.token_answers()
        return Instance(tokens=b.tokens, loss_mask=b.loss_mask, answer_id=aid, group=grp, meta={})

    def __repr__(self) -> str:
        return f"FullCopyTask(n_tokens={self.n_tokens}, vocab_size={self.vocab_size})"


__all__ = ["FullCopyTask", "DEFAULTS", "KEYS"]
