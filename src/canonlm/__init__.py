"""canonlm: controlled architecture science on language models (Canon layers, synthetic pretraining tasks).

Subpackages and what they may import:

* ``canonlm.ops``   -- sequence ops (Canon causal depthwise conv, attention): pure-PyTorch references and fast paths.
* ``canonlm.arch``  -- models (imports ``ops``; never ``train`` or ``data``).
* ``canonlm.data``  -- task generators, packing, streams, evaluators (imports neither ``arch`` nor ``train``).
* ``canonlm.train`` -- Lightning module, data module, run entry point (imports everything above).
"""

__version__ = "0.1.0"
