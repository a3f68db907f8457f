"""Federated (un)learning algorithms behind one interface: policies over explicit state.

:class:`Planner` (``planner.py``) is how a method is written: it plans stages over an immutable
:class:`PlanState` and the trainer runs the loop: FedShard, FedAvg retraining, FATS, FedEraser,
RapidRetrain and FedRecover are planners (FedEraser and FedRecover on ``history.py``).
:class:`Algorithm` (``base.py``) is the interface the trainer calls, which a planner implements
from its plans. :class:`AlgorithmContext` (``context.py``) is all a method sees of a run.
"""

from fedshard_lightning.unlearning.base import Algorithm, UnlearnResult
from fedshard_lightning.unlearning.context import AlgorithmContext, LoopEvents
from fedshard_lightning.unlearning.fats import FATS
from fedshard_lightning.unlearning.fedavg import FedAvg
from fedshard_lightning.unlearning.federaser import FedEraser
from fedshard_lightning.unlearning.fedrecover import FedRecover
from fedshard_lightning.unlearning.fedshard import FedShard
from fedshard_lightning.unlearning.planner import Planner, PlanState, StagePlan
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
    "PlanState",
    "Planner",
    "RapidRetrain",
    "StagePlan",
    "UnlearnResult",
    "default_algorithm",
]


def default_algorithm() -> Algorithm:
    """The algorithm a trainer uses when none is configured."""
    return FedShard()
