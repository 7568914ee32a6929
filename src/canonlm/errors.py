"""The one error type for bad configuration values (stdlib only, so every subpackage can import it)."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """Bad configuration value. The message names the key, the value given and what is allowed:
    ``invalid config: <key>=<value!r>; allowed: <allowed>``."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid config: {key}={value!r}; allowed: {allowed}")
