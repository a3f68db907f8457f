"""The trainer: :class:`FederatedTrainer` owns Fabric, the stage loop, every commit and check.

:mod:`~fedshard_lightning.trainer.trainer` (the class and its commands), its options
(:mod:`~fedshard_lightning.trainer.options`), Fabric's launch
(:mod:`~fedshard_lightning.trainer.fabric`), a planner's stage loop
(:mod:`~fedshard_lightning.trainer.stage_loop`), the checks and reports of unlearning requests
(:mod:`~fedshard_lightning.trainer.requests`) and ``fast_dev_run``
(:mod:`~fedshard_lightning.trainer.dev_run`). ``FederatedTrainer`` is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedshard_lightning.trainer.trainer import FederatedTrainer

__all__ = ["FederatedTrainer"]


def __getattr__(name: str) -> Any:
    if name == "FederatedTrainer":
        from fedshard_lightning.trainer.trainer import FederatedTrainer

        return FederatedTrainer
    raise AttributeError(f"module 'fedshard_lightning.trainer' has no attribute {name!r}")
