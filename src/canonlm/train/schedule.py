"""Learning-rate schedules as multipliers of the peak lr (paper App. A).

All schedules take the total number of optimizer steps from the config (``trainer.max_steps``), never from
Lightning's ``estimated_stepping_batches`` (Lightning #20550).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from canonlm.config.rules import check_value


def lr_multiplier(cfg: Mapping[str, Any], total_steps: int) -> Callable[[int], float]:
    """Return ``f(step) -> multiplier`` of the peak lr for the optimizer step ``step`` (0-based).

    cfg keys: ``name`` (cosine | linear | constant | wsd), ``warmup_steps`` (linear warm-up from 0 over this many
    steps), ``min_lr_ratio`` (final multiplier), ``decay_fraction`` (wsd only: last fraction of steps that decays).
    cosine: ``r + (1 - r) * (1 + cos(pi * p)) / 2`` with p the post-warm-up progress in [0, 1]; linear:
    ``1 - (1 - r) * p``. Raises ConfigError for a value the rules of ``sched.*``
    (:data:`canonlm.config.rules.TRAINING_RULES`) refuse.
    """
    name = check_value("sched.name", cfg.get("name"))
    warmup = int(check_value("sched.warmup_steps", cfg.get("warmup_steps", 0)) or 0)
    r = float(check_value("sched.min_lr_ratio", cfg.get("min_lr_ratio", 0.0)))
    decay_fraction = float(check_value("sched.decay_fraction", cfg.get("decay_fraction", 0.2)))
    total = max(int(total_steps), 1)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if name == "constant":
            return 1.0
        if name == "wsd":
            start = total - decay_fraction * total
            if step < start:
                return 1.0
            p = min(1.0, (step - start) / max(total - start, 1.0))
            return 1.0 - (1.0 - r) * p
        p = min(1.0, (step - warmup) / max(total - warmup, 1))
        if name == "cosine":
            return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))
        return 1.0 - (1.0 - r) * p

    return f
