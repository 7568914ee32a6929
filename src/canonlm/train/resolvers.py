"""OmegaConf resolvers used by the config tree (registered once, before Hydra composes)."""

from __future__ import annotations

from omegaconf import OmegaConf

# Paper training steps per (task, difficulty) (tasks.md §1.3).
PAPER_STEPS = {
    "depo1": {225: 87_500, 300: 100_000, 375: 112_500},
    "depo2": {75: 100_000, 100: 125_000, 125: 150_000},
}


def paper_steps(task: str, n: int) -> int:
    """Steps the paper trains ``task`` at difficulty ``n``; raises KeyError naming the known values."""
    table = PAPER_STEPS.get(str(task))
    if table is None or int(n) not in table:
        raise KeyError(f"no paper step count for task={task!r} N={n!r}; known: {PAPER_STEPS}")
    return table[int(n)]


def register_resolvers() -> None:
    """Register ``${canonlm_steps:<task>,<N>}`` (idempotent)."""
    if not OmegaConf.has_resolver("canonlm_steps"):
        OmegaConf.register_new_resolver("canonlm_steps", paper_steps)
