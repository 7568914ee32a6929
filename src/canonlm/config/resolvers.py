"""OmegaConf resolvers and in-memory config options used by the config tree (registered once, before Hydra composes)."""

from __future__ import annotations

from omegaconf import OmegaConf

# Paper training steps per (task, difficulty) (paper App. A).
PAPER_STEPS = {
    "depo1": {225: 87_500, 300: 100_000, 375: 112_500},
    "depo2": {75: 100_000, 100: 125_000, 125: 150_000},
    "brevo1": {70: 100_000, 90: 125_000, 110: 150_000},
    "brevo2": {30: 200_000, 40: 225_000, 50: 250_000},
    "mano": {10: 80_000, 13: 95_000, 16: 110_000},
}
# Paper context windows per (task, variant) where they depend on the variant (paper App. A).
PAPER_CONTEXT = {"lano": {"cfg3f": 512, "cfg3j": 1536, "cfg3k": 1536}}


def paper_steps(task: str, n: int) -> int:
    """Steps the paper trains ``task`` at difficulty ``n``; raises KeyError naming the known values."""
    table = PAPER_STEPS.get(str(task))
    if table is None or int(n) not in table:
        raise KeyError(f"no paper step count for task={task!r} N={n!r}; known: {PAPER_STEPS}")
    return table[int(n)]


def paper_context(task: str, variant: str) -> int:
    """The paper's context window for ``task`` variant ``variant`` (Lano: cfg3f 512, cfg3j/k 1536); other Lano
    grammars get 1536. Raises KeyError for a task without a table."""
    table = PAPER_CONTEXT[str(task)]
    return table.get(str(variant), 1536)


def launch_cwd() -> str:
    """The directory ``train.py`` was started from (``${canonlm_cwd:}``; the default ``paths.root_dir``).

    Hydra's own ``${hydra:runtime.cwd}`` is set only once a job runs, but a multirun resolves ``hydra.sweep.dir``
    (which lives under ``paths.log_dir``) before any job, where it raises "HydraConfig was not set". The process
    working directory is the same value in both places: Hydra runs with ``hydra.job.chdir=false``, and a SLURM job
    (sbatch, submitit) starts in the directory it was submitted from.
    """
    import os

    return os.getcwd()


def register_value_resolvers() -> None:
    """Register ``${canonlm_steps:<task>,<N>}``, ``${canonlm_context:<task>,<variant>}`` and ``${canonlm_cwd:}``
    only (idempotent; imports nothing but OmegaConf: what reading a saved ``.hydra/config.yaml`` needs)."""
    if not OmegaConf.has_resolver("canonlm_cwd"):
        OmegaConf.register_new_resolver("canonlm_cwd", launch_cwd)
    if not OmegaConf.has_resolver("canonlm_steps"):
        OmegaConf.register_new_resolver("canonlm_steps", paper_steps)
    if not OmegaConf.has_resolver("canonlm_context"):
        OmegaConf.register_new_resolver("canonlm_context", paper_context)


def register_resolvers() -> None:
    """Register the value resolvers (:func:`register_value_resolvers`) and the in-memory ``canon`` options
    (:func:`register_linear_canon_sets`); idempotent."""
    register_value_resolvers()
    register_linear_canon_sets()


#: ``canonlm.arch.config.LINEAR_CANON_LETTERS``, restated so that registering the ``canon`` options imports no torch
#: (``train.py`` composes and checks the command line before torch loads; tests/test_refusals.py checks they agree).
LINEAR_CANON_LETTERS = "AbBCD"


def linear_canon_sets() -> list[str]:
    """Names of the ``canon`` group options that contain the lowercase ``b`` of linear models (the paper's Canon-b):
    every subset of ``A b B C D`` (in that order) with ``b``, plus the official spellings ``AbbCD`` and ``bb``."""
    import itertools

    names = []
    for n in range(1, len(LINEAR_CANON_LETTERS) + 1):
        for combo in itertools.combinations(LINEAR_CANON_LETTERS, n):
            if "b" in combo:
                names.append("".join(combo))
    return names + ["AbbCD", "bb"]


def register_linear_canon_sets() -> None:
    """Register the ``canon`` options with lowercase ``b`` (``canon=AbCD``, ``canon=b``, ...) in Hydra's ConfigStore.

    They live in memory, not as ``conf/canon/*.yaml`` files, because ``AbCD.yaml`` and ``ABCD.yaml`` would be the
    same file on case-insensitive file systems (the reason the release spells it "AbbCD"). Each option is
    ``conf/canon/_base.yaml`` with ``set`` replaced. Idempotent."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name in linear_canon_sets():
        cs.store(group="canon", name=name, node={"defaults": ["_base", "_self_"], "set": name})
