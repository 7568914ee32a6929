"""Documents packed in a window: the index tensors that document masking needs (torchtitan / OLMo-core "document
masking"; flash-attn's and fla's ``cu_seqlens`` convention).

A row of ``doc_ids`` (B, T) gives each token the index of its document; a **document is a maximal run of equal ids**
inside a row (a change of id starts a new document; every row starts one). Data loaders give non-decreasing ids;
other integer sequences are accepted and read the same way (``[0, 1, 0]`` is three documents), so every backend
derives the same documents from the same ids without a validity check (which would cost a device-host sync).

Functions (pure tensor code, no model or task knowledge):

* :func:`document_starts` -- (B, T) bool, True where a document starts.
* :func:`position_in_document` -- (B, T) int64, 0 at a document start (Canon's per-tap mask: tap at lag ``l`` is
  read iff ``position >= l``).
* :func:`block_causal_mask` -- (B, T, T) bool, True = query t may attend key s (``s <= t`` in t's document).
* :func:`block_causal_bias` -- the same as the (B, 1, T, T) additive mask (0 / -inf) attention takes.
* :func:`cu_seqlens_of` -- the documents of all rows, flattened row-major into one sequence of B·T tokens, as
  cumulative lengths ``(N + 1,)`` (int64 on the tensor's device and a CPU copy): the varlen form of flash-attn's
  ``flash_attn_varlen_func`` and fla's chunk kernels (``cu_seqlens`` with batch 1). One device-host sync.
* :func:`pack` / :func:`unpack` -- (1, total, ...) <-> (N, L_max, ...) zero-padded at each document's end: how the
  pure-PyTorch references run a ``cu_seqlens`` call as a batch of independent sequences (the padding comes after
  each document, so by causality it changes none of its outputs).
* :class:`Documents` / :func:`documents` -- the forms above that a forward needs, built once per forward and passed
  to every layer (Canon's ``causal_conv1d(docs=...)``: ``pos`` for the torch path, ``seq_idx`` for Dao's
  ``causal_conv1d_fn``, ``cu_seqlens`` for fla's ``causal_conv1d``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "Documents",
    "block_causal_bias",
    "block_causal_mask",
    "check_varlen_call",
    "cu_seqlens_from_pos",
    "cu_seqlens_of",
    "document_starts",
    "documents",
    "pack",
    "position_in_document",
    "segment_ids",
    "unpack",
]


@dataclass(frozen=True, eq=False)
class Documents:
    """The documents packed in the rows of a (B, T) window, in the index forms the sequence ops take.

    Fields:
        pos: (B, T) int64, each token's position in its document (0 at a document start): the mask of the
            shift-and-add Canon path (the tap at lag ``l`` reads the previous token only where ``pos >= l``).
        seq_idx: (B, T) int32, contiguous, each token's document index within its row (0, 1, ...): Dao's
            ``causal_conv1d_fn(seq_idx=...)`` (a tap is read only when its token has the same ``seq_idx``,
            ``causal_conv1d_channellast_fwd_kernel``) and mamba-ssm's ``mamba_chunk_scan_combined(seq_idx=...)``.
        cu_seqlens, cu_seqlens_cpu: (N + 1,) int64 cumulative document lengths of the B rows flattened row-major into
            one sequence of B·T tokens, on the device and on the CPU (fla's varlen kernels, flash-attn's
            ``flash_attn_varlen_func``), or None when not computed (they cost one device-host sync).
        max_seqlen: an upper bound on a document's length (T).
    Built by :func:`documents`; holds no model or task knowledge.
    """

    pos: Tensor
    seq_idx: Tensor
    cu_seqlens: Optional[Tensor] = None
    cu_seqlens_cpu: Optional[Tensor] = None
    max_seqlen: int = 0


def documents(doc_ids: Tensor, cu_seqlens: bool = False) -> Documents:
    """:class:`Documents` of ``doc_ids`` (B, T) integer ids (a change of id starts a document).

    ``pos`` and ``seq_idx`` always (no host sync); ``cu_seqlens`` / ``cu_seqlens_cpu`` when ``cu_seqlens`` is True
    (one device-host sync: :func:`cu_seqlens_of`)."""
    cu = cu_cpu = None
    if cu_seqlens:
        cu, cu_cpu = cu_seqlens_of(doc_ids)
    return Documents(
        pos=position_in_document(doc_ids),
        seq_idx=segment_ids(doc_ids).to(torch.int32).contiguous(),
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
        max_seqlen=int(doc_ids.shape[1]),
    )


def cu_seqlens_from_pos(pos: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`cu_seqlens_of` from ``pos`` (B, T) (:attr:`Documents.pos`): a document starts where ``pos == 0``.
    One device-host sync."""
    B, T = pos.shape
    starts = (pos.reshape(-1) == 0).nonzero().squeeze(1).cpu()
    cu_cpu = torch.cat([starts, torch.tensor([B * T])]).to(torch.int64)
    return cu_cpu.to(pos.device), cu_cpu


def document_starts(doc_ids: Tensor) -> Tensor:
    """(B, T) integer ids -> (B, T) bool, True at t = 0 and wherever ``doc_ids[:, t] != doc_ids[:, t - 1]``."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def segment_ids(doc_ids: Tensor) -> Tensor:
    """(B, T) -> (B, T) int64: the index of each token's document within its row (0, 1, ...; runs of equal ids)."""
    return document_starts(doc_ids).to(torch.int64).cumsum(1) - 1


def position_in_document(doc_ids: Tensor) -> Tensor:
    """(B, T) -> (B, T) int64: ``t - (start of t's document)`` (0 at every document start). No host sync."""
    T = doc_ids.shape[1]
    t = torch.arange(T, device=doc_ids.device, dtype=torch.int64).expand(doc_ids.shape)
    start = torch.where(document_starts(doc_ids), t, torch.zeros_like(t)).cummax(dim=1).values
    return t - start


def block_causal_mask(doc_ids: Tensor) -> Tensor:
    """(B, T) -> (B, T, T) bool: ``mask[b, t, s]`` = key s is visible to query t (``s <= t`` and same document).
    The diagonal is always True, so no query row is empty (no NaN from a softmax over nothing)."""
    seg = segment_ids(doc_ids)
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril_()
    return (seg.unsqueeze(2) == seg.unsqueeze(1)) & causal


def block_causal_bias(doc_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, T) -> (B, 1, T, T) additive mask in ``dtype``: 0 where key s is visible to query t (:func:`block_causal_mask`),
    -inf elsewhere. The form ``F.scaled_dot_product_attention`` takes as it is (a floating ``attn_mask`` of the query's
    dtype, broadcast over heads), so one tensor built per forward serves every layer (``canonlm.ops.attention``)."""
    allowed = block_causal_mask(doc_ids).unsqueeze(1)
    return torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device).masked_fill_(~allowed, float("-inf"))


def cu_seqlens_of(doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Cumulative document lengths of the B rows flattened row-major (row b's tokens at ``b·T .. b·T + T - 1``).

    Returns:
        ``(cu_seqlens, cu_seqlens_cpu)``: int64 ``(N + 1,)`` with ``cu[0] = 0``, ``cu[N] = B·T``, document n at
        ``cu[n] .. cu[n+1] - 1``; on ``doc_ids``' device and on the CPU. A row boundary is always a document
        boundary. (flash-attn wants int32: ``cu.to(torch.int32)``; fla takes int64.)
    """
    B, T = doc_ids.shape
    starts = document_starts(doc_ids).reshape(-1).nonzero().squeeze(1).cpu()
    cu_cpu = torch.cat([starts, torch.tensor([B * T])]).to(torch.int64)
    return cu_cpu.to(doc_ids.device), cu_cpu


def pack(x: Tensor, cu_seqlens_cpu: Tensor) -> tuple[Tensor, Tensor]:
    """(1, total, ...) -> ``(padded (N, L_max, ...), valid (N, L_max) bool)``: document n's tokens at
    ``padded[n, :len_n]``, zeros after them. Differentiable (a gather; padded places get no gradient)."""
    if x.shape[0] != 1:
        raise ValueError(f"pack: x.shape={tuple(x.shape)}; allowed: (1, total, ...) (varlen inputs have batch 1)")
    lens = cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]
    L = int(lens.max())
    ar = torch.arange(L)
    valid = ar.unsqueeze(0) < lens.unsqueeze(1)  # (N, L)
    idx = torch.where(valid, cu_seqlens_cpu[:-1].unsqueeze(1) + ar.unsqueeze(0), 0)  # (N, L) flat token index
    valid, idx = valid.to(x.device), idx.to(x.device)
    g = x[0][idx]  # (N, L, ...)
    v = valid.view(*valid.shape, *([1] * (g.dim() - 2)))
    return torch.where(v, g, torch.zeros((), dtype=g.dtype, device=g.device)), valid


def unpack(y: Tensor, valid: Tensor) -> Tensor:
    """(N, L_max, ...) and the ``valid`` mask of :func:`pack` -> (1, total, ...) in the original token order."""
    return y[valid].unsqueeze(0)


def check_varlen_call(
    where: str,
    q: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_cpu: Tensor | None,
    initial_state: Tensor | None,
    output_final_state: bool,
) -> None:
    """Check the arguments of a varlen op call (``where``: the op's name): ValueError unless q (B, T, ...) has B == 1,
    ``cu_seqlens`` and its CPU copy ``cu_seqlens_cpu`` are (N + 1,) from 0 to T, and there is no initial state and no
    final state requested (document masking starts every sequence from zero and keeps no state)."""
    T = q.shape[1]
    ok = (
        q.shape[0] == 1
        and cu_seqlens_cpu is not None
        and cu_seqlens.dim() == 1
        and cu_seqlens.numel() >= 2
        and tuple(cu_seqlens_cpu.shape) == tuple(cu_seqlens.shape)
        and int(cu_seqlens_cpu[0]) == 0
        and int(cu_seqlens_cpu[-1]) == T
        and initial_state is None
        and not output_final_state
    )
    if not ok:
        ends = (
            None
            if cu_seqlens_cpu is None or cu_seqlens_cpu.numel() == 0
            else (int(cu_seqlens_cpu[0]), int(cu_seqlens_cpu[-1]))
        )
        raise ValueError(
            f"{where}: cu_seqlens {tuple(cu_seqlens.shape)} (cpu copy first/last {ends}) with q "
            f"{tuple(q.shape)}, "
            f"initial_state {'given' if initial_state is not None else 'None'}, output_final_state="
            f"{output_final_state}; allowed: batch 1, cu_seqlens and cu_seqlens_cpu (N + 1,) from 0 to "
            f"T={T}, no initial_state, output_final_state=False"
        )
