"""Sequence ops behind one dispatch point each.

Every op has a pure-PyTorch ``reference`` (runs anywhere) and fast paths picked at run time. Backend names accepted by
every op: ``"auto"`` (fastest available for the tensors' device), ``"reference"`` (force the reference), or an
op-specific fast path name (see each op's module).

Oracles: each op's ``naive`` module holds its definition written as a plain loop over tokens
(``canon.naive.canon_loop``, ``gla.naive.gla_loop``, ``gdn.naive.gdn_loop``, ``ssd.naive.ssd_loop``,
``attention.naive.attention_loop``), sharing no code with the op; the tests, ``bench/`` and ``python -m
canonlm.selfcheck`` check the references against them. fla's own ``naive.py`` files are a second, external oracle
(:mod:`canonlm.ops._fla_naive`).

Document masking (several documents packed in a window): :mod:`canonlm.ops.varlen` builds the index tensors
(positions in a document, segment indices, the additive block-causal mask, ``cu_seqlens``); every op takes them
(Canon ``docs``, attention ``doc_mask`` / ``cu_seqlens``, GLA / GDN ``cu_seqlens``, SSD ``seq_idx``) and restarts at
each document.

What ran: :func:`backend_calls` counts the calls of every backend's entry point (:mod:`canonlm.ops.calls`);
:func:`forget_backend_choices` empties the memoised backend choices.

This package imports nothing of canonlm but :mod:`canonlm.errors` (no model, data or task).
"""

from canonlm.ops._dispatch import forget_backend_choices
from canonlm.ops.calls import backend_calls

__all__ = ["backend_calls", "forget_backend_choices"]
