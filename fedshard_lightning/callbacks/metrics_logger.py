"""Sends per-round and per-stage metrics to the Fabric loggers (CSV, W&B, ...)."""

from __future__ import annotations

from typing import Any

from fedshard_lightning.callbacks.base import FederatedCallback

__all__ = ["MetricsLogger"]


class MetricsLogger(FederatedCallback):
    """Logs every round's metrics with a global step that runs through all stages."""

    def __init__(self) -> None:
        self.step = 0

    def on_fit_start(self, trainer: Any) -> None:
        """Restart the global round counter."""
        self.step = 0

    def on_round_end(self, trainer: Any, info: Any, metrics: dict[str, float]) -> None:
        """One logger row per round."""
        trainer.fabric.log_dict(
            {k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=self.step
        )
        self.step += 1

    def on_stage_end(self, trainer: Any, stage: int, metrics: dict[str, float]) -> None:
        """Stage summary, prefixed ``stage/``."""
        trainer.fabric.log_dict({f"stage/{k}": v for k, v in metrics.items()}, step=max(self.step - 1, 0))

    def on_fit_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        """Final metrics, prefixed ``final/``."""
        trainer.fabric.log_dict(
            {f"final/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=self.step
        )
