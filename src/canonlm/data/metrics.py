"""Teacher-forced answer scoring, grouped by metric group (Depo: k) (paper App. A).

``answer_exact`` (the paper's headline metric, default): an answer is correct iff the argmax prediction is right at
every one of its tokens (``<ans>`` itself is never scored). ``answer_token``: per-token accuracy over answer tokens
(for debugging). Both are returned as counts so they can be summed over batches and ranks before dividing.
"""

from __future__ import annotations

from typing import Mapping

import torch


def score_answers(
    pred: torch.Tensor, batch: Mapping[str, torch.Tensor], num_groups: int, nll: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Count correct answers and answer tokens per group (vectorised; any device; no Python loop over answers).

    Args:
        pred: (B, T) integer tensor; ``pred[b, t]`` is the model's argmax guess for token t (made at position t-1);
            ``pred[:, 0]`` is ignored.
        batch: dict with (B, T) tensors ``tokens`` (int), ``answer_id`` (int; -1 = not scored; the tokens of one
            answer share an id in [0, T) unique within the row) and ``group`` (int; the answer's group, constant
            over the answer's tokens, in [0, num_groups)), as produced by :mod:`canonlm.data.packing`.
        num_groups: number of groups G (Depo: K + 1).
        nll: optional (B, T) float tensor, ``nll[b, t]`` = cross-entropy in nats of token t (predicted at t-1);
            ``nll[:, 0]`` is ignored.
    Returns: dict of int64 tensors of shape (G,) on ``pred``'s device: ``answers_correct``, ``answers_total``
        (whole-answer exact match), ``tokens_correct``, ``tokens_total`` (per scored token), indexed by group; with
        ``nll`` also ``nll_sum`` (float64 (G,), nats summed over each group's scored tokens; Capo's p1/p2).
    Raises: ValueError for mismatched shapes, num_groups < 1, answer ids >= T or groups outside [0, num_groups)
        on scored tokens.
    """
    tokens, aid, grp = batch["tokens"], batch["answer_id"], batch["group"]
    if pred.dim() != 2 or pred.shape != tokens.shape or aid.shape != tokens.shape or grp.shape != tokens.shape:
        raise ValueError(
            f"pred {tuple(pred.shape)}, tokens {tuple(tokens.shape)}, answer_id {tuple(aid.shape)}, "
            f"group {tuple(grp.shape)}: all must be the same (B, T)"
        )
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups={num_groups!r} is not allowed; allowed: an integer >= 1")
    dev = pred.device
    B, T = pred.shape
    aid = aid.to(dev, torch.long)
    grp = grp.to(dev, torch.long)
    scored = aid >= 0
    scored[:, 0] = False
    g = torch.where(scored, grp, torch.zeros_like(grp))
    a = torch.where(scored, aid, torch.zeros_like(aid))
    if bool(((g < 0) | (g >= num_groups)).any()):
        raise ValueError(f"group values on scored tokens must lie in [0, num_groups={num_groups})")
    if bool((a >= T).any()):
        raise ValueError(f"answer_id values must lie in [-1, T={T})")
    right = (pred == tokens.to(dev)) & scored
    zeros = torch.zeros(num_groups, dtype=torch.long, device=dev)
    tokens_total = zeros.scatter_add(0, g.reshape(-1), scored.reshape(-1).long())
    tokens_correct = zeros.scatter_add(0, g.reshape(-1), right.reshape(-1).long())

    # one slot per (row, answer id); unscored tokens go to a dump slot B*T
    slot = torch.where(scored, torch.arange(B, device=dev)[:, None] * T + a, torch.full_like(a, B * T)).reshape(-1)
    per = torch.zeros(B * T + 1, dtype=torch.long, device=dev)
    n_tok = per.scatter_add(0, slot, scored.reshape(-1).long())[:-1]
    n_wrong = per.scatter_add(0, slot, (scored & ~right).reshape(-1).long())[:-1]
    a_grp = per.scatter_reduce(0, slot, g.reshape(-1), reduce="amax", include_self=True)[:-1]
    present = n_tok > 0
    correct = present & (n_wrong == 0)
    out = {}
    if nll is not None:
        if nll.shape != tokens.shape:
            raise ValueError(f"nll {tuple(nll.shape)} must be the same (B, T) as tokens {tuple(tokens.shape)}")
        z = torch.zeros(num_groups, dtype=torch.float64, device=dev)
        out["nll_sum"] = z.scatter_add(0, g.reshape(-1), torch.where(scored, nll.to(dev).double(), 0.0).reshape(-1))
    return {
        **out,
        "answers_correct": zeros.scatter_add(0, a_grp, correct.long()),
        "answers_total": zeros.scatter_add(0, a_grp, present.long()),
        "tokens_correct": tokens_correct,
        "tokens_total": tokens_total,
    }


__all__ = ["score_answers"]
