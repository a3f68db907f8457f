"""Federated (un)learning algorithms behind one interface: policies over explicit state.

:class:`Algorithm` (``base.py``) is the interface and :class:`AlgorithmContext` (``context.py``)
all an algorithm sees of a run; one file per method: FedShard (the default), FedAvg retraining,
FATS, FedEraser, RapidRetrain and FedRecover (the last two on ``history.py``).
"""

from fedshard_lightning.unlearning.base import Algorithm, UnlearnResult
from fedshard_lightning.unlearning.context import AlgorithmContext, LoopEvents
from fedshard_lightning.unlearning.fats import FATS
from fedshard_lightning.unlearning.fedavg import FedAvg
from fedshard_lightning.unlearning.federaser import FedEraser
from fedshard_lightning.unlearning.fedrecover import FedRecover
from fedshard_lightning.unlearning.fedshard import FedShard
from fedshard_lightning.unlearning.rapid_retrain import FisherPreconditionedSGD, RapidRetrain

__all__ = [
    "FATS",
    "Algorithm",
    "AlgorithmContext",
    "FedAvg",
    "FedEraser",
    "FedRecover",
    "FedShard",
    "FisherPreconditionedSGD",
    "LoopEvents",
    "RapidRetrain",
    "UnlearnResult",
    "default_algorithm",
]


def default_algorithm() -> Algorithm:
    """The algorithm a trainer uses when none is configured."""
    return FedShard()
