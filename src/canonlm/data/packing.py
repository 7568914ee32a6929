"""Left-aligned packing of task instances into fixed-length windows (paper App. A).

``tail="drop"`` (default, paper): window w is the concatenation of instances (w, 0), (w, 1), ... cut at ``window``
tokens. It starts at an instance start, the first instance is never truncated (``window`` must be at least the
longest instance), and the rest of the instance crossing the end is discarded.

``tail="carry"``: the cut rest of an instance starts the next window. To keep every window a pure function of its
index, carrying happens only inside fixed *blocks* of ``carry_group`` consecutive windows: block b is the
concatenation of instances (b, 0), (b, 1), ... cut at ``carry_group * window`` tokens (rest dropped) and split
into its windows; window w is part ``w % carry_group`` of block ``w // carry_group``. The first window of each
block starts at an instance start; the others may start inside an instance.

Per-token outputs (T = ``window``):
    tokens int64 (T,); loss_mask bool (T,) [token t is a loss target, predicted from position t-1; always False at
    t = 0]; answer_id int32 (T,) [-1 = not scored; the tokens of one answer share an id, dense 0..A-1 in order of
    appearance within the window]; group int32 (T,) [metric group (Depo: k) of scored tokens, 0 elsewhere].
An answer is scored only if it lies completely inside the window *and* its instance starts inside the window (with
``drop`` the second condition always holds; with ``carry`` it excludes answers whose edges are in the previous
window). Cut answers keep their loss targets (the context before them is intact) but are not scored. Pad (0, loss
False) never occurs: windows are always filled, since instances are generated until the window is covered.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from canonlm.data import ConfigError
from canonlm.data.tasks import check_split

TAILS = ("drop", "carry")
_MAX_EST = 512  # instances whose lengths are estimated per row and round


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.shape[0] + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def check_window(task: Any, split: str, window: Any) -> int:
    """Return ``window`` if it holds the longest instance of ``split``; raise ConfigError("task.context", ...) if
    not (naming the instance length), ValueError for a bad split."""
    check_split(split)
    need = task.max_instance_len(split)
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < need:
        raise ConfigError(
            "task.context",
            window,
            f"an integer >= {need}, the longest {split} instance of {task.name} in tokens "
            "(left-aligned packing never truncates a window's first instance)",
        )
    return int(window)


def _fill_rows(task: Any, split: str, rows: np.ndarray, length: int, seed: int):
    """Fill each row r with instances (rows[r], 0), (rows[r], 1), ... cut at ``length`` tokens.

    Returns (tokens (R, length) int64, loss_mask (R, length) bool, answers) where answers is a dict of (A,) arrays
    for the answers starting inside a row, sorted by (row, position): ``row``, ``pos`` (first token in the row),
    ``len``, ``group``, ``inst_pos`` (row position where the answer's instance starts)."""
    R = rows.shape[0]
    have = np.zeros(R, dtype=np.int64)
    covered = np.zeros(R, dtype=np.int64)
    min_len = max(1, task.min_instance_len(split))
    parts, inst_row, inst_i = [], [], []
    need = np.arange(R)
    while need.size:
        deficit = length - covered[need]
        c_max = np.minimum(deficit // min_len + 1, _MAX_EST)
        coff = _excl_cumsum(c_max)
        er = np.repeat(np.arange(need.size), c_max)
        ei = have[need][er] + np.arange(int(coff[-1])) - coff[er]
        est = task.estimate_lengths(split, rows[need][er], ei, seed)
        # per row: smallest count whose estimated total reaches the deficit
        cum = np.cumsum(est)
        cum_row = cum - np.concatenate([[0.0], cum])[coff[er]]
        short = cum_row < deficit[er]
        cnt = np.minimum(np.bincount(er, weights=short, minlength=need.size).astype(np.int64) + 1, c_max)
        gr = np.repeat(need, cnt)
        goff = _excl_cumsum(cnt)
        gi = have[gr] + np.arange(int(goff[-1])) - goff[np.repeat(np.arange(need.size), cnt)]
        batch = task.generate(split, rows[gr], gi, seed)
        parts.append(batch)
        inst_row.append(gr)
        inst_i.append(gi)
        covered += np.bincount(gr, weights=batch.lengths, minlength=R).astype(np.int64)
        have[need] += cnt
        need = need[covered[need] < length]

    if len(parts) == 1:
        b = parts[0]
        tokens_all, loss_all, starts, ln = b.tokens, b.loss_mask, b.offsets[:-1], b.lengths
        a_inst, a_start, a_len, a_grp = b.ans_inst, b.ans_start, b.ans_len, b.ans_group
    else:
        tok_off = np.cumsum([0] + [b.tokens.shape[0] for b in parts[:-1]])
        inst_off = np.cumsum([0] + [len(b) for b in parts[:-1]])
        tokens_all = np.concatenate([b.tokens for b in parts])
        loss_all = np.concatenate([b.loss_mask for b in parts])
        starts = np.concatenate([b.offsets[:-1] + o for b, o in zip(parts, tok_off)])
        ln = np.concatenate([b.lengths for b in parts])
        a_inst = np.concatenate([b.ans_inst + o for b, o in zip(parts, inst_off)])
        a_start = np.concatenate([b.ans_start for b in parts])
        a_len = np.concatenate([b.ans_len for b in parts])
        a_grp = np.concatenate([b.ans_group for b in parts])
    row = np.concatenate(inst_row)
    ii = np.concatenate(inst_i)

    # order instances by (row, i); position of each instance in its row
    order = np.lexsort((ii, row))
    s_row, s_len = row[order], ln[order]
    cum = np.cumsum(s_len)
    row_first = _excl_cumsum(np.bincount(s_row, minlength=R))[:-1]
    s_pos0 = cum - s_len - np.concatenate([[0], cum])[row_first][s_row]
    kept = s_pos0 < length
    take = np.minimum(s_len, length - s_pos0)[kept]
    toff = _excl_cumsum(take)
    tinst = np.repeat(np.arange(take.shape[0]), take)
    src = starts[order][kept][tinst] + np.arange(int(toff[-1])) - toff[tinst]  # rows exactly covered: row-major
    tokens = tokens_all[src].reshape(R, length)
    loss = loss_all[src].reshape(R, length)

    pos0 = np.empty_like(s_pos0)
    pos0[order] = s_pos0
    a_row = row[a_inst]
    a_ipos = pos0[a_inst]
    a_pos = a_ipos + a_start
    inside = a_pos < length
    a_order = np.lexsort((a_pos[inside], a_row[inside]))
    answers = {
        "row": a_row[inside][a_order],
        "pos": a_pos[inside][a_order],
        "len": a_len[inside][a_order],
        "group": a_grp[inside][a_order],
        "inst_pos": a_ipos[inside][a_order],
    }
    return tokens, loss, answers


def _finish(tokens: np.ndarray, loss: np.ndarray, ans: dict[str, np.ndarray], window: int) -> dict[str, np.ndarray]:
    """Split rows of length G*window into windows; apply the scoring rule; renumber answers densely per window."""
    R, Ls = tokens.shape
    G = Ls // window
    sub = ans["pos"] // window
    lo = sub * window
    sc = (ans["inst_pos"] >= lo) & (ans["pos"] + ans["len"] <= lo + window)
    win = (ans["row"] * G + sub)[sc]
    start = (ans["pos"] - lo)[sc]
    a_len = ans["len"][sc]
    n = win.shape[0]
    new = np.ones(n, dtype=bool)
    new[1:] = win[1:] != win[:-1]
    idx = np.arange(n)
    dense = idx - np.maximum.accumulate(np.where(new, idx, 0))  # rank of the answer within its window
    q = np.repeat(idx, a_len)
    aoff = _excl_cumsum(a_len)
    flat = (win * window + start)[q] + np.arange(q.shape[0]) - aoff[q]
    aid = np.full(R * G * window, -1, dtype=np.int32)
    grp = np.zeros(R * G * window, dtype=np.int32)
    aid[flat] = dense[q]
    grp[flat] = ans["group"][sc][q]
    loss = loss.reshape(R * G, window).copy() if G > 1 else loss
    loss[:, 0] = False
    return {
        "tokens": tokens.reshape(R * G, window),
        "loss_mask": loss,
        "answer_id": aid.reshape(R * G, window),
        "group": grp.reshape(R * G, window),
    }


def pack_windows(
    task: Any, split: str, window_indices: Any, window: int, seed: int, tail: str = "drop", carry_group: int = 8
) -> dict[str, np.ndarray]:
    """Pack several windows at once (vectorised); same result as stacking :func:`pack_window` for each index.

    Args: window_indices: non-negative ints (W,). Others as :func:`pack_window`.
    Returns: dict of (W, T) arrays: tokens int64, loss_mask bool, answer_id int32, group int32.
    Raises: ConfigError("task.context") if ``window`` is shorter than the longest instance; ConfigError("task.tail")
        for an unknown tail; ValueError for negative indices, a bad split or ``carry_group < 1``.
    """
    window = check_window(task, split, window)
    if tail not in TAILS:
        raise ConfigError("task.tail", tail, " | ".join(TAILS))
    w = np.asarray(window_indices, dtype=np.int64).reshape(-1)
    if w.size and w.min() < 0:
        raise ValueError(f"window indices must be >= 0, got {int(w.min())}")
    if w.size == 0:
        return {
            "tokens": np.zeros((0, window), np.int64),
            "loss_mask": np.zeros((0, window), bool),
            "answer_id": np.zeros((0, window), np.int32),
            "group": np.zeros((0, window), np.int32),
        }
    if tail == "drop":
        return _finish(*_fill_rows(task, split, w, window, seed), window=window)
    if isinstance(carry_group, bool) or not isinstance(carry_group, (int, np.integer)) or carry_group < 1:
        raise ValueError(f"carry_group={carry_group!r} is not allowed; allowed: an integer >= 1")
    G = int(carry_group)
    blocks, inv = np.unique(w // G, return_inverse=True)
    out = _finish(*_fill_rows(task, split, blocks, G * window, seed), window=window)
    sel = inv.reshape(-1) * G + w % G
    return {k: v[sel] for k, v in out.items()}


def pack_window(
    task: Any, split: str, window_index: int, window: int, seed: int, tail: str = "drop", carry_group: int = 8
) -> dict[str, np.ndarray]:
    """Window ``window_index`` of ``split``: a pure function of (seed, task.name, task params, split, index).

    Args:
        task: a task from :func:`canonlm.data.tasks.build_task`. split: train | val | test.
        window_index: int >= 0. window: T, tokens per window. seed: data seed (the config's ``task.seed``).
        tail: ``drop`` | ``carry`` (see the module docstring). carry_group: windows per carry block.
    Returns: dict of (T,) arrays: tokens int64, loss_mask bool, answer_id int32, group int32 (module docstring).
    Raises: ConfigError("task.context", window, ...) if ``window < task.max_instance_len(split)``;
        ConfigError("task.tail") for an unknown tail; ValueError for a negative index or a bad split.
    """
    out = pack_windows(task, split, [window_index], window, seed, tail=tail, carry_group=carry_group)
    return {k: v[0] for k, v in out.items()}


__all__ = ["pack_window", "pack_windows", "check_window", "TAILS"]
