"""Task registry and the data types every synthetic task returns.

    from canonlm.data.tasks import build_task, TASKS
    task = build_task("depo1", cfg)          # cfg: the Hydra ``task`` node as a mapping
    inst = task.instance("train", (w, i))    # Instance; pure function of (seed, task, params, split, w, i)

Registered tasks (``TASKS``, paper App. A): ``depo1``, ``depo2`` (A.1), ``brevo1``, ``brevo2`` (A.2), ``capo`` (A.3),
``mano`` (A.4), ``lano`` (A.5), ``fullcopy`` (Fig. 5), ``text`` (real-text pretraining from prepared token shards).

The task protocol (what packing, the stream, the trainer and the preview CLI rely on):

* attributes: ``name``, ``cfg`` (validated dict), ``vocab_size`` (pad id 0 included), ``pad_id = 0``,
  ``num_groups`` G (metric groups 0..G-1 of scored tokens/samples), ``group_name`` (str, e.g. ``"k"``),
  ``chance`` (float accuracy of guessing, or None), ``context`` (window T), ``tail`` (``drop`` | ``carry``), ``seed``;
  optional ``group_labels: dict[int, str]`` (printable names of groups).
* ``max_instance_len(split)``, ``min_instance_len(split)`` -> int tokens; ``estimate_lengths(split, w, i, seed)`` ->
  float64 (I,) (cheap; only sizes packing rounds); ``generate(split, w, i, seed)`` -> :class:`InstanceBatch` (instance
  (w, i) a pure function of (seed, task parameters, split, w, i)); ``instance(split, index, seed)`` ->
  :class:`Instance`;
  ``token_names()`` -> list[str] (index = id); ``decode(ids)`` -> str.
* ``eval_mode``: ``"teacher_forced"`` (default: scored answer tokens of the packed val/test windows) or ``"generate"``
  (Brevo, Lano: the model generates from prompts; see :meth:`evaluate`). Teacher-forced tasks may still define
  ``evaluate`` for extra metrics (Lano's KL is computed there too).
* optional ``evaluate(lm, split, idx)`` -> dict of per-sample numpy arrays of length n = len(idx), always ``correct``
  bool and ``group`` int64 (metric group); any other key (float) is averaged over samples and reported as
  ``{split}/<key>``. ``lm`` is a :class:`canonlm.data.lm.LanguageModel`. Sample ``idx[r]`` must be a pure function of
  (seed, task parameters, split, idx[r]). ``eval_samples(split)`` -> int: default number of samples per evaluation.
* optional ``finalize_metrics(split, table, model_info)`` -> dict[str, float] of extra metrics computed from the
  teacher-forced table (Capo: bits and bits per parameter); ``model_info``: ``num_params``, ``embedding_params``,
  ``d_model``, ``tie_embeddings``.
* optional ``make_stream(split, *, window, batch_size, seed, rank, world_size, start_step, num_steps, tail)`` ->
  an IterableDataset with the interface of :class:`canonlm.data.stream.SyntheticStream` (the ``text`` task; tasks
  without it are packed from ``generate``).
* optional ``model_overrides()`` -> dict of model config keys the task requires (Capo: ``tie_embeddings: true``).
* optional ``eval_windows(split, window)`` -> int: windows of a val/test pass (Capo: every evaluated person once;
  replaces ``data.val_windows`` / ``data.test_windows``).
* optional ``steps_for_exposures(global_batch_size)`` -> int: the run length for ``trainer.max_steps: auto`` (Capo:
  every person seen ``exposures`` times).
* NaN in an extra per-sample metric of ``evaluate`` means "not measured" and is left out of its mean (Lano's KL is
  computed on the first ``kl_samples`` prompts only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from canonlm.data import ConfigError

# registry key -> "module:Class" (imported lazily, so a task's heavy imports cost nothing unless it is used)
_REGISTRY: dict[str, str] = {
    "depo1": "canonlm.data.tasks.depo:DepoTask",
    "depo2": "canonlm.data.tasks.depo:DepoTask",
    "brevo1": "canonlm.data.tasks.brevo:BrevoTask",
    "brevo2": "canonlm.data.tasks.brevo:BrevoTask",
    "capo": "canonlm.data.tasks.capo:CapoTask",
    "mano": "canonlm.data.tasks.mano:ManoTask",
    "lano": "canonlm.data.tasks.lano:LanoTask",
    "fullcopy": "canonlm.data.tasks.fullcopy:FullCopyTask",
    "text": "canonlm.data.text:TextTask",
}
TASKS: tuple[str, ...] = tuple(_REGISTRY)
SPLITS: tuple[str, ...] = ("train", "val", "test")


@dataclass
class Instance:
    """One generated instance (sequence) of a task. All arrays have shape (L,), L = instance length in tokens.

    tokens: int64 token ids (task vocabulary; pad id 0 never occurs).
    loss_mask: bool, True where the token is a loss target (predicted from the previous position).
    answer_id: int32, index of the answer (query) the token belongs to, 0..n_answers-1; -1 for tokens that are not
        scored (everything but the answer tokens themselves; Depo: ``<ans>`` is a loss target but not scored).
    group: int32 metric group of scored tokens (Depo: the query's k); 0 where answer_id == -1.
    meta: task-specific facts (Depo: ``n`` nodes, ``k`` int32 (t,) depth per query).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    answer_id: np.ndarray
    group: np.ndarray
    meta: dict[str, Any]

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class Prompts:
    """Prompts for generative evaluation (Brevo, Lano). n = number of prompts.

    prompts: list of n int64 arrays (token ids, starting at the instance's ``<bos>``).
    max_new_tokens: int, generation cap. stop_ids: tokens that end a generation (kept as its last token).
    temperature: 0.0 = greedy argmax; > 0 = sampling from softmax(logits / temperature).
    keys: uint64 (n,), per-prompt random keys (sampling noise is a pure function of key and step, whatever the batch).
    group: int64 (n,), metric group per prompt. meta: task-specific per-prompt facts used by the scorer.
    """

    prompts: list
    max_new_tokens: int
    stop_ids: tuple
    temperature: float
    keys: np.ndarray
    group: np.ndarray
    meta: dict[str, Any]


@dataclass
class InstanceBatch:
    """Many instances, concatenated (ragged layout). S = total tokens, I = instances, Q = answers.

    tokens int64 (S,); loss_mask bool (S,); offsets int64 (I+1,) [instance r occupies ``offsets[r]:offsets[r+1]``].
    Answers (the scored spans; Depo: one per query, ``<ans>`` excluded), in instance order and in order within
    their instance: ans_inst int64 (Q,) [instance index], ans_start int64 (Q,) [first token, counted from the start
    of the instance], ans_len int64 (Q,) [tokens], ans_group int32 (Q,) [metric group, e.g. k], ans_offsets int64
    (I+1,) [answers of instance r: ``ans_offsets[r]:ans_offsets[r+1]``]. meta: task-specific per-instance arrays.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    ans_inst: np.ndarray
    ans_start: np.ndarray
    ans_len: np.ndarray
    ans_group: np.ndarray
    ans_offsets: np.ndarray
    meta: dict[str, np.ndarray]

    @property
    def lengths(self) -> np.ndarray:
        """int64 (I,): tokens per instance."""
        return np.diff(self.offsets)

    def token_answers(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-token (answer_id, group), both int32 (S,): answer index local to its instance (-1 = not scored) and
        the answer's group (0 elsewhere) -- the layout of :class:`Instance`."""
        aid = np.full(self.tokens.shape[0], -1, dtype=np.int32)
        grp = np.zeros(self.tokens.shape[0], dtype=np.int32)
        q = np.repeat(np.arange(self.ans_len.shape[0]), self.ans_len)
        aoff = np.zeros(self.ans_len.shape[0] + 1, dtype=np.int64)
        np.cumsum(self.ans_len, out=aoff[1:])
        pos = self.offsets[self.ans_inst[q]] + self.ans_start[q] + np.arange(q.shape[0]) - aoff[q]
        aid[pos] = (np.arange(self.ans_len.shape[0]) - self.ans_offsets[self.ans_inst])[q]
        grp[pos] = self.ans_group[q]
        return aid, grp

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)


def check_split(split: Any) -> str:
    """Return ``split`` if it is one of ``SPLITS``; raise ValueError naming it otherwise."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed; allowed: {' | '.join(SPLITS)}")
    return split


def build_task(name: str, cfg: Mapping[str, Any] | None = None):
    """Build and validate a task from its config node.

    Args:
        name: registry key, one of ``TASKS``.
        cfg: the Hydra ``task`` node as a mapping (a ``DictConfig`` works too); missing keys take the task's
            defaults; ``cfg["name"]``, if present, must equal ``name``.
    Returns: the task object (see :class:`canonlm.data.tasks.depo.DepoTask` for the attributes).
    Raises: ConfigError("task.name", ...) for an unknown name; the task's own ConfigErrors for bad keys/values.
    """
    if name not in TASKS:
        raise ConfigError("task.name", name, " | ".join(TASKS))
    import importlib

    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(name, cfg or {})


__all__ = ["TASKS", "SPLITS", "Instance", "InstanceBatch", "Prompts", "build_task", "check_split", "ConfigError"]
