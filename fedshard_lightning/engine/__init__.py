"""Vectorized FedAvg engine: stacked clients, keyed randomness, per-client loop reference.

Importing it puts MKL in its reproducible mode (:mod:`.blas`): stacked results depend on it.
"""

from fedshard_lightning.engine.blas import reproducible_blas

reproducible_blas()

# ruff: noqa: E402  (the mode is set before the kernels are imported)

from fedshard_lightning.engine.engine import (
    FederatedEngine,
    Group,
    RoundInfo,
    TrainResult,
    stack_params,
    unstack_params,
)
from fedshard_lightning.engine.evaluate import evaluate, predict_logits
from fedshard_lightning.engine.schedule import LocalSchedule

__all__ = [
    "FederatedEngine",
    "Group",
    "LocalSchedule",
    "RoundInfo",
    "TrainResult",
    "evaluate",
    "predict_logits",
    "stack_params",
    "unstack_params",
]
