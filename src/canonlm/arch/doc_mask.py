"""Document masking (opt-in): several documents packed in one training window, and no token sees another document.

``CanonLM.forward(input_ids, doc_ids=...)`` takes ``doc_ids`` (B, T), the index of each token's document within its
row (a change of id starts a document; see :mod:`canonlm.ops.varlen`). Without it (the default, and the setting of
the paper's real-life runs: random windows of concatenated text) a window is one sequence and attention / Canon / the recurrences run across document
boundaries. With it, every sequence op restarts at each document start, so the logits of a document equal those of
the document run alone as its own sequence (tests/test_doc_mask.py checks exactly that):

* attention (Llama): block-causal mask -- query t sees key s iff ``s <= t`` and both are in one document. ``sdpa``
  and ``reference`` take the (B, T, T) boolean mask (built once per forward, shared by all layers); ``flash`` runs
  ``flash_attn_varlen_func`` with the documents' ``cu_seqlens``.
* Canon (A/B/C/D, residual or not, any K) and the mixers' own short convs (``b``): a tap that would read the previous
  document reads zero (the conv restarts per document); this runs the shift-and-add ``torch`` Canon path on every
  backend (:func:`canonlm.ops.canon.causal_conv1d` ``doc_pos``).
* GLA / GDN: the recurrent state restarts from zero at every document start: fla's chunk kernels with ``cu_seqlens``
  (batch 1, the B rows flattened) on CUDA, the references on one zero-padded batch of documents elsewhere.
* positions (RoPE): the window's positions 0..T-1 are kept (not restarted per document). RoPE makes a score depend
  only on the distance ``t - s`` between query and key, so inside a document the scores are those of the document
  run alone, up to the rounding of the cos/sin tables at other angles (~1e-7 relative in fp32).
* Mamba2: the SSD state restarts at every document (mamba-ssm's ``mamba_chunk_scan_combined(seq_idx=...)`` on
  CUDA, the reference on one zero-padded batch of documents elsewhere); the fused conv + scan kernel is not used.
* Decoding with a :class:`~canonlm.arch.cache.DecodeCache`: refused (a cache continues one sequence per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from canonlm.arch.config import ModelConfig
from canonlm.ops import varlen

#: why each architecture cannot run document-masked (absent: it can); every arch of canonlm.arch.config.ARCHS can
_ARCH_PROBLEMS: dict[str, str] = {}


def doc_mask_problem(cfg: ModelConfig) -> str | None:
    """Why a model of ``cfg`` cannot run document-masked (``CanonLM.forward(doc_ids=...)``), or None when it can.

    For the pre-run check of ``task.doc_mask=true``. Every architecture (Llama, GLA, GDN, Mamba2), Canon set, kernel
    size, residual mode and backend request can today (Canon then runs its ``torch`` path); an architecture added
    without document masking must be listed in ``_ARCH_PROBLEMS``, which also makes ``forward(doc_ids=...)`` refuse.
    """
    return _ARCH_PROBLEMS.get(cfg.arch)


@dataclass(frozen=True)
class DocMask:
    """What the layers of one document-masked forward need, built once per forward by :func:`build_doc_mask`.

    Fields: ``pos`` (B, T) int64 position of each token in its document (Canon's per-tap mask); ``attn_mask``
    (B, T, T) bool block-causal mask (Llama with ``sdpa`` / ``reference`` attention) or None; ``cu_seqlens`` /
    ``cu_seqlens_cpu`` (N + 1,) int64 cumulative document lengths of the B·T flattened tokens (GLA / GDN, and
    ``flash`` attention) or None, on the device and on the CPU; ``max_seqlen`` an upper bound on a document's length
    (T); ``seq_idx`` (B, T) int64 document index within the row (Mamba2) or None."""

    pos: torch.Tensor
    attn_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    max_seqlen: int = 0
    seq_idx: torch.Tensor | None = None


def check_doc_ids(doc_ids: torch.Tensor, lead: torch.Tensor) -> None:
    """ValueError unless ``doc_ids`` is an integer (B, T) tensor on ``lead``'s device with ``lead``'s first two
    sizes (``lead``: the (B, T) input ids or (B, T, d) embeddings)."""
    ok = (isinstance(doc_ids, torch.Tensor) and doc_ids.dim() == 2 and tuple(doc_ids.shape) == tuple(lead.shape[:2])
          and not doc_ids.is_floating_point() and not doc_ids.is_complex() and doc_ids.dtype != torch.bool
          and doc_ids.device == lead.device)
    if not ok:
        got = (f"{tuple(doc_ids.shape)} {doc_ids.dtype} on {doc_ids.device}" if isinstance(doc_ids, torch.Tensor)
               else type(doc_ids).__name__)
        raise ValueError(f"doc_ids: {got}; allowed: an integer tensor (B, T) = {tuple(lead.shape[:2])} on "
                         f"{lead.device}, the index of each token's document within its row")


def build_doc_mask(doc_ids: torch.Tensor, arch: str, attention_backend: str | None = None) -> DocMask:
    """The :class:`DocMask` of ``doc_ids`` (B, T) for a model of ``arch``: ``pos`` always; the block mask for Llama
    unless its attention backend is ``flash``; ``cu_seqlens`` for GLA / GDN and for ``flash`` (one device-host sync);
    ``seq_idx`` for Mamba2.
    Raises ValueError for an architecture :func:`doc_mask_problem` refuses."""
    if arch in _ARCH_PROBLEMS:
        raise ValueError(_ARCH_PROBLEMS[arch])
    pos = varlen.position_in_document(doc_ids)
    mask = cu = cu_cpu = seq = None
    if arch == "llama" and attention_backend != "flash":
        mask = varlen.block_causal_mask(doc_ids)
    elif arch == "mamba2":
        seq = varlen.segment_ids(doc_ids)
    else:
        cu, cu_cpu = varlen.cu_seqlens_of(doc_ids)
    return DocMask(pos=pos, attn_mask=mask, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, max_seqlen=int(doc_ids.shape[1]),
                   seq_idx=seq)
