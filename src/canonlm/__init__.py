"""canonlm: controlled architecture science on language models (Canon layers, synthetic pretraining tasks).

Parts, bottom to top: ``errors`` and ``utils``; ``ops`` (sequence ops) and ``data`` (tasks, streams, evaluators);
``arch`` (models); ``config`` (composed config or run directory -> task, model config, tokenizer); ``hf``; ``eval``
and ``train``; the commands ``generate``, ``export``, ``selfcheck``. What each may import is the table in the
README's "Layout" section, enforced by ``tests/test_layers.py``.
"""

__version__ = "0.1.0"
