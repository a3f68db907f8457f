"""Sends per-round, per-stage and per-request metrics to the Fabric loggers (CSV, W&B, ...).

The global step runs through all stages and continues after a resumed fit (the run's
``log_step_start``), so one run's curves line up in every logger; an unlearning request is one row
after the run's last step, prefixed ``unlearn/``.

Every round is one row, but the loggers write their files (``save``) only at every stage end, at
most every ``flush_every_s`` seconds in between, and when the fit ends or stops: a row costs a dict
in memory, not a file open per round inside the timed training loop. A fit that stops on an
exception still writes its rows (``fedshard_lightning.trainer.trainer``).
"""

from __future__ import annotations

import time
from typing import Any

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.view import RunView

__all__ = ["MetricsLogger", "request_row"]


class MetricsLogger(FederatedCallback):
    """Logs every round's metrics with a global step that runs through all stages.

    Args:
        flush_every_s: Longest time between two writes of the loggers' files within a stage.
    """

    def __init__(self, flush_every_s: float = 2.0) -> None:
        self.step = 0
        self.flush_every_s = float(flush_every_s)
        self._flushed = time.perf_counter()

    def on_fit_start(self, run: RunView) -> None:
        """Start the global round counter (after the rounds a resumed fit kept)."""
        self.step = run.log_step_start
        self._flushed = time.perf_counter()

    def on_round_end(self, run: RunView, info: Any, metrics: dict[str, float]) -> None:
        """One logger row per round; the files are written at most every ``flush_every_s``."""
        run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=self.step)
        self.step += 1
        if time.perf_counter() - self._flushed >= self.flush_every_s:
            run.writer.flush()
            self._flushed = time.perf_counter()

    def on_stage_end(self, run: RunView, stage: int, metrics: dict[str, float]) -> None:
        """Stage summary, prefixed ``stage/``."""
        row = {f"stage/{k}": v for k, v in metrics.items()}
        row["stage/stage"] = float(stage)  # marks a committed stage (a resumed fit keeps rows up to it)
        run.log(row, step=max(self.step - 1, 0))
        run.writer.flush()
        self._flushed = time.perf_counter()

    def on_fit_end(self, run: RunView, metrics: dict[str, float]) -> None:
        """Final metrics, prefixed ``final/``."""
        run.log({f"final/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=self.step)

    def on_unlearn_end(self, run: RunView, report: dict[str, Any]) -> None:
        """The request's costs and accuracies, prefixed ``unlearn/``, one step after the run's last."""
        run.log(request_row(report), step=run.log_step_start)


def request_row(report: dict[str, Any]) -> dict[str, float]:
    """One request's row (``unlearn/...``): its numbers, the clients removed, the shards retrained."""
    row = {f"unlearn/{k}": float(v) for k, v in report.items() if isinstance(v, (int, float))}
    row["unlearn/num_clients_removed"] = float(len(report.get("clients", [])))
    for key in ("retrained_shards",):
        if isinstance(report.get(key), (list, tuple)):
            row[f"unlearn/{key}_count"] = float(len(report[key]))
    return row
