"""FLCache checkpointing: the algorithm's state is committed to disk after every stage."""

from __future__ import annotations

from typing import Any

from fedshard_lightning.callbacks.base import FederatedCallback

__all__ = ["FLCacheCheckpoint"]


class FLCacheCheckpoint(FederatedCallback):
    """Commits the algorithm's cache after each stage (so ``fit --ckpt_path`` can resume).

    The trainer always includes one: without the cache, unlearning requests could not be honoured.
    """

    def on_stage_end(self, trainer: Any, stage: int, metrics: dict[str, float]) -> None:
        """Commit a new cache version labelled with the stage (rank zero only)."""
        if trainer.is_global_zero:
            trainer.algorithm.write_cache(trainer.cache, label=f"stage-{stage}")
        trainer.fabric.barrier()
