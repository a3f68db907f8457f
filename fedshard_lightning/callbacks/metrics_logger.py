"""Sends per-round, per-stage and per-request metrics to the Fabric loggers (CSV, W&B, ...).

The global step runs through all stages and continues after a resumed fit (the trainer's
``log_step_start``), so one run's curves line up in every logger; an unlearning request is one row
after the run's last step, prefixed ``unlearn/``.

Every round is one row, but the loggers write their files (``save``) only at every stage end, at
most every ``flush_every_s`` seconds in between, and when the fit ends or stops: a row costs a dict
in memory, not a file open per round inside the timed training loop. A fit that stops on an
exception still writes its rows (``fedshard_lightning.trainer.loop``).
"""

from __future__ import annotations

import time
from typing import Any

from fedshard_lightning.callbacks.base import FederatedCallback

__all__ = ["MetricsLogger", "log_request"]


class MetricsLogger(FederatedCallback):
    """Logs every round's metrics with a global step that runs through all stages.

    Args:
        flush_every_s: Longest time between two writes of the loggers' files within a stage.
    """

    def __init__(self, flush_every_s: float = 2.0) -> None:
        self.step = 0
        self.flush_every_s = float(flush_every_s)
        self._flushed = time.perf_counter()

    @staticmethod
    def flush(trainer: Any) -> None:
        """Write what the loggers hold (the CSV file's new rows)."""
        for logger in trainer.fabric.loggers:
            logger.save()

    def on_fit_start(self, trainer: Any) -> None:
        """Start the global round counter (after the rounds a resumed fit kept)."""
        self.step = int(getattr(trainer, "log_step_start", 0))
        self._flushed = time.perf_counter()

    def on_round_end(self, trainer: Any, info: Any, metrics: dict[str, float]) -> None:
        """One logger row per round; the files are written at most every ``flush_every_s``."""
        trainer.fabric.log_dict(
            {k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=self.step
        )
        self.step += 1
        if time.perf_counter() - self._flushed >= self.flush_every_s:
            self.flush(trainer)
            self._flushed = time.perf_counter()

    def on_stage_end(self, trainer: Any, stage: int, metrics: dict[str, float]) -> None:
        """Stage summary, prefixed ``stage/``."""
        row = {f"stage/{k}": v for k, v in metrics.items()}
        row["stage/stage"] = float(stage)  # marks a committed stage (a resumed fit keeps rows up to it)
        trainer.fabric.log_dict(row, step=max(self.step - 1, 0))
        self.flush(trainer)
        self._flushed = time.perf_counter()

    def on_fit_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        """Final metrics, prefixed ``final/``."""
        trainer.fabric.log_dict(
            {f"final/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=self.step
        )

    def on_unlearn_end(self, trainer: Any, report: dict[str, Any]) -> None:
        """The request's costs and accuracies, prefixed ``unlearn/``, one step after the run's last."""
        log_request(trainer, report)


def log_request(trainer: Any, report: dict[str, Any]) -> None:
    """One request's row (``unlearn/...``) at the trainer's ``log_step_start``."""
    row = {f"unlearn/{k}": float(v) for k, v in report.items() if isinstance(v, (int, float))}
    row["unlearn/num_clients_removed"] = float(len(report.get("clients", [])))
    for key in ("retrained_shards",):
        if isinstance(report.get(key), (list, tuple)):
            row[f"unlearn/{key}_count"] = float(len(report[key]))
    trainer.fabric.log_dict(row, step=int(getattr(trainer, "log_step_start", 0)))
