"""Independent oracles shared by several test files (plain loops written from the spec's formulas)."""

import torch

from canonlm.ops.canon.naive import canon_loop  # noqa: F401 -- the plain-loop oracle, shared with selfcheck
