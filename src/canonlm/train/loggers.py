"""A Lightning logger that always writes ``metrics.jsonl`` in the run directory (offline-first metrics)."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Mapping

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only


class JSONLLogger(Logger):
    """Append one JSON object per ``log_metrics`` call to ``<save_dir>/metrics.jsonl``.

    Each line: ``{"step": int, "time": unix seconds, <metric>: float, ...}``. Hyper-parameters go to
    ``<save_dir>/hparams.json``. Only rank 0 writes. Lines are flushed immediately, so a killed run keeps
    every metric logged so far; a resumed run appends to the same file.
    """

    def __init__(self, save_dir: str, filename: str = "metrics.jsonl"):
        super().__init__()
        self._save_dir = save_dir
        self._path = os.path.join(save_dir, filename)
        self._fh = None

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def path(self) -> str:
        return self._path

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._fh is None:
            os.makedirs(self._save_dir, exist_ok=True)
            self._fh = open(self._path, "a", buffering=1)
        return self._fh

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if not params:  # Lightning logs the module's (empty) hparams too; keep the run config
            return
        os.makedirs(self._save_dir, exist_ok=True)
        try:
            from omegaconf import OmegaConf

            if not isinstance(params, Mapping):
                params = vars(params)
            params = OmegaConf.to_container(OmegaConf.create(dict(params)), resolve=True)
        except Exception:  # noqa: BLE001 -- what OmegaConf cannot convert is logged as a plain dict
            params = dict(params) if isinstance(params, Mapping) else {}
        with open(os.path.join(self._save_dir, "hparams.json"), "w") as f:
            json.dump(params, f, indent=1, default=str)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        row: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        for k, v in metrics.items():
            v = float(v)
            row[k] = v if math.isfinite(v) else str(v)
        self.experiment.write(json.dumps(row) + "\n")

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
