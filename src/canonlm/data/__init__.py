"""Synthetic task data: generators, left-aligned packing, deterministic streams and answer scoring.

Imports only numpy and torch (never ``canonlm.arch``, ``canonlm.train`` or lightning), so it is cheap to import.

    from canonlm.data.tasks import build_task, TASKS
    from canonlm.data.packing import pack_window
    from canonlm.data.stream import SyntheticStream
    from canonlm.data.metrics import score_answers

Every sample is a pure function of (seed, task name, generative parameters, split, window index, instance index)
through the counter-based generator of :mod:`canonlm.data.seeding`.
"""

from __future__ import annotations


from canonlm.errors import ConfigError  # the one shared error type (stdlib-only module)

__all__ = ["ConfigError"]
