"""Hydra callbacks of a sweep (``hydra.callbacks`` in ``conf/hydra/default.yaml``).

``ReportCommand`` runs when a multirun ends (``Callback.on_multirun_end`` of ``hydra.experimental.callback``): it
prints the sweep's tables (``canonlm.train.report`` over the sweep directory, nothing written) and the command that
writes them with the figures, e.g.::

    report: python -m canonlm.train.report logs/mini_depth/multiruns/<time> --rows canon.set \\
        --cols pos.type --k 1,2 --out logs/mini_depth/multiruns/<time>/report

The ``experiment=mini/*`` presets set ``hydra.callbacks.report.rows / cols / k`` to the layout that answers their
question. A failing report never fails the sweep: its error is printed instead of the tables.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


class ReportCommand(Callback):
    """Print the sweep's report and the command that writes it with its figures when a multirun ends.

    Args:
        rows: config key of the table rows (``--rows`` of ``canonlm.train.report``); ``auto`` (default): the keys the
            sweep varied, so that ``-m canon=none,ABCD`` prints one table with the two Canon sets side by side
            (:func:`canonlm.train.cells.auto_axes`).
        cols: config key of the columns (``--cols``); ``auto`` as for ``rows``.
        k: Depo hop counts shown in a cell, e.g. ``"1,2"`` (``--k``); null = the report's default (K, K/2).
        run: also print the tables at the end of the sweep (False: only the command).
    """

    def __init__(self, rows: str = "auto", cols: str = "auto", k: str | None = None, run: bool = True):
        self.rows, self.cols, self.k, self.run = rows, cols, (None if k in (None, "") else str(k)), run

    def args(self, sweep_dir: str | Path) -> list[str]:
        """The report's arguments for ``sweep_dir`` (without ``--out``)."""
        a = [str(sweep_dir), "--rows", self.rows, "--cols", self.cols]
        return a + (["--k", self.k] if self.k else [])

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        if not sweep.is_dir():  # no job ran (e.g. every job refused its config)
            return
        if self.run:
            from canonlm.train import report

            print(f"\n== report of {sweep}", flush=True)
            try:
                report.main(self.args(sweep))
            except Exception as e:  # noqa: BLE001 -- the sweep's runs are done; never fail it here
                print(f"report: failed: {type(e).__name__}: {e}", file=sys.stderr)
        cmd = ["python", "-m", "canonlm.train.report", *self.args(sweep), "--out", str(sweep / "report")]
        print("\nreport (tables, heat maps, learning curves): " + shlex.join(cmd), flush=True)
