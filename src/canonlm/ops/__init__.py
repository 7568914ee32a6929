"""Sequence ops behind one dispatch point each.

Every op has a pure-PyTorch ``reference`` (runs anywhere, the test oracle) and fast paths picked at run time.
Backend names accepted by every op: ``"auto"`` (fastest available for the tensors' device), ``"reference"``
(force the oracle), or an op-specific fast path name (see each op's module).
"""
