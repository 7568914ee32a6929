"""Errors shared across subpackages (stdlib only, so every subpackage can import them): bad configuration values,
and a training run that stopped early with its checkpoint saved."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """Bad configuration value. The message names the key, the value given and what is allowed:
    ``invalid config: <key>=<value!r>; allowed: <allowed>``."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid config: {key}={value!r}; allowed: {allowed}")


class RunStopped(Exception):
    """Training stopped before ``trainer.max_steps`` with ``last.ckpt`` saved: a preemption (``exit_code`` 0 when the
    job requeued itself on SLURM's warning signal, 143 on SIGTERM) or too many non-finite steps in a row
    (``exit_code`` 3). Raised at a step boundary from inside ``Trainer.fit`` (so Lightning runs no validation or
    test after it); ``train.py`` prints the message and exits with the code; nothing else is written."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
