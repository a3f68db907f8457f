"""Federated (un)learning algorithms behind one interface."""

from fedshard_lightning.unlearning.base import Algorithm, UnlearnResult
from fedshard_lightning.unlearning.fedavg import FedAvg
from fedshard_lightning.unlearning.fedshard import FedShard

__all__ = ["Algorithm", "FedAvg", "FedShard", "UnlearnResult", "default_algorithm"]


def default_algorithm() -> Algorithm:
    """The algorithm a trainer uses when none is configured."""
    return FedShard()
