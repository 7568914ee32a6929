"""The plain-loop oracles live in the package (``canonlm.ops.<op>.naive``); this module only re-exports the Canon
loop for test files that still import it from here (tests/test_placement.py)."""

from canonlm.ops.canon.naive import canon_loop  # noqa: F401
