"""Federated (un)learning algorithms behind one interface."""

from fedshard_lightning.unlearning.base import Algorithm, UnlearnResult
from fedshard_lightning.unlearning.fats import FATS
from fedshard_lightning.unlearning.fedavg import FedAvg
from fedshard_lightning.unlearning.federaser import FedEraser
from fedshard_lightning.unlearning.fedrecover import FedRecover
from fedshard_lightning.unlearning.fedshard import FedShard
from fedshard_lightning.unlearning.rapid_retrain import FisherPreconditionedSGD, RapidRetrain

__all__ = [
    "FATS",
    "Algorithm",
    "FedAvg",
    "FedEraser",
    "FedRecover",
    "FedShard",
    "FisherPreconditionedSGD",
    "RapidRetrain",
    "UnlearnResult",
    "default_algorithm",
]


def default_algorithm() -> Algorithm:
    """The algorithm a trainer uses when none is configured."""
    return FedShard()
