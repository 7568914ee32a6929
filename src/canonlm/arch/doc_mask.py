"""Document masking (opt-in): several documents packed in one training window, and no token sees another document.

``CanonLM.forward(input_ids, doc_ids=...)`` takes ``doc_ids`` (B, T), the index of each token's document within its
row (a change of id starts a document; see :mod:`canonlm.ops.varlen`). Without it (the default, and the setting of
the paper's real-life runs: random windows of concatenated text) a window is one sequence and attention / Canon / the recurrences run across document
boundaries. With it, every sequence op restarts at each document start, so the logits of a document equal those of
the document run alone as its own sequence (tests/test_doc_mask.py checks exactly that):

* attention (Llama): block-causal mask -- query t sees key s iff ``s <= t`` and both are in one document. ``sdpa``
  and ``reference`` take one additive (B, 1, T, T) mask in the compute dtype, built once per forward and shared by
  all layers (B·T²·itemsize bytes per forward; :mod:`canonlm.ops.attention`); ``flash`` runs
  ``flash_attn_varlen_func`` with the documents' ``cu_seqlens`` (no mask).
* Canon (A/B/C/D, residual or not, any K) and the mixers' own short convs (``b``): a tap that would read the previous
  document reads zero (the conv restarts per document), on each layer's own backend
  (:func:`canonlm.ops.canon.causal_conv1d` ``docs``): Dao's ``causal_conv1d_fn(seq_idx=...)``, fla's
  ``causal_conv1d(cu_seqlens=...)``, or the shift-and-add path with per-tap masks on CPU and under compile.
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


@dataclass(frozen=True, eq=False)
class DocMask(varlen.Documents):
    """What the layers of one document-masked forward need, built once per forward by :func:`build_doc_mask`: the
    index forms of :class:`canonlm.ops.varlen.Documents` (``pos`` (B, T) int64, ``seq_idx`` (B, T) int32,
    ``cu_seqlens`` / ``cu_seqlens_cpu`` or None, ``max_seqlen``), which the Canon layers take as they are, and
    ``attn_mask``: the additive block-causal mask (B, 1, T, T) in the compute dtype (Llama with ``sdpa`` /
    ``reference`` attention; :func:`canonlm.ops.varlen.block_causal_bias`) or None."""

    attn_mask: torch.Tensor | None = None


def check_doc_ids(doc_ids: torch.Tensor, lead: torch.Tensor) -> None:
    """ValueError unless ``doc_ids`` is an integer (B, T) tensor on ``lead``'s device with ``lead``'s first two
    sizes (``lead``: the (B, T) input ids or (B, T, d) embeddings)."""
    ok = (
        isinstance(doc_ids, torch.Tensor)
        and doc_ids.dim() == 2
        and tuple(doc_ids.shape) == tuple(lead.shape[:2])
        and not doc_ids.is_floating_point()
        and not doc_ids.is_complex()
        and doc_ids.dtype != torch.bool
        and doc_ids.device == lead.device
    )
    if not ok:
        got = (
            f"{tuple(doc_ids.shape)} {doc_ids.dtype} on {doc_ids.device}"
            if isinstance(doc_ids, torch.Tensor)
            else type(doc_ids).__name__
        )
        raise ValueError(
            f"doc_ids: {got}; allowed: an integer tensor (B, T) = {tuple(lead.shape[:2])} on "
            f"{lead.device}, the index of each token's document within its row"
        )


def build_doc_mask(
    doc_ids: torch.Tensor,
    arch: str,
    attention_backend: str | None = None,
    cu_seqlens: bool = False,
    dtype: torch.dtype | None = None,
) -> DocMask:
    """The :class:`DocMask` of ``doc_ids`` (B, T) for a model of ``arch``: ``pos`` and ``seq_idx`` always; the
    additive block mask in ``dtype`` (the dtype attention's q has: the autocast dtype, else the parameters') for Llama
    unless its attention backend is ``flash``; ``cu_seqlens`` (one device-host sync) for GLA / GDN, for ``flash``, and
    when ``cu_seqlens`` is True (some Canon layer runs fla's kernel).
    Raises ValueError for an architecture :func:`doc_mask_problem` refuses."""
    if arch in _ARCH_PROBLEMS:
        raise ValueError(_ARCH_PROBLEMS[arch])
    need_cu = cu_seqlens or arch in ("gla", "gdn") or (arch == "llama" and attention_backend == "flash")
    d = varlen.documents(doc_ids, cu_seqlens=need_cu)
    mask = None
    if arch == "llama" and attention_backend != "flash":
        mask = varlen.block_causal_bias(d.seq_idx, torch.float32 if dtype is None else dtype)
    return DocMask(
        pos=d.pos,
        seq_idx=d.seq_idx,
        cu_seqlens=d.cu_seqlens,
        cu_seqlens_cpu=d.cu_seqlens_cpu,
        max_seqlen=d.max_seqlen,
        attn_mask=mask,
    )
