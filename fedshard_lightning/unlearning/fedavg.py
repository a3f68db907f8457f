"""FedAvg and its unlearning by retraining from scratch ("FA" in the FedShard paper's section 6).

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, Algorithm 1. Unlearning by retraining: the remaining clients train from the same initial model with the
same keyed randomness, so the result equals FedAvg trained without the leaving clients from the
start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from fedshard_lightning.engine import Group, TrainResult, stack_params, unstack_params
from fedshard_lightning.limits import check_count
from fedshard_lightning.unlearning.planner import Planner, PlanState, StagePlan
from fedshard_lightning.unlearning.reference import ReferenceReplay

__all__ = ["FedAvg"]


class FedAvg(Planner):
    """Plain FedAvg over all clients; unlearning retrains from scratch.

    One plan: every active client, ``rounds`` rounds from theta^0, as the fit and as the request
    (without the leaving clients); stage 0 and group 0 key the randomness of both alike.

    Args:
        rounds: Communication rounds.
        **kwargs: Local training settings, see :class:`~fedshard_lightning.unlearning.base.Algorithm`.
    """

    local_bn_ok = True  # one engine call trains every round
    name = "fedavg"

    def __init__(self, rounds: int = 20, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_count("algorithm.rounds", rounds)
        self.rounds = rounds

    def initial_state(self, theta0: dict[str, Tensor]) -> dict[str, Any]:
        """The model, once trained (stored as ``model.safetensors``)."""
        return {"model": None}

    def _all_rounds(self, state: PlanState, leaving: Sequence[int] = ()) -> StagePlan:
        group = Group(0, tuple(self.active(state, leaving)), self.rounds)
        return StagePlan(0, (group,), stack_params([state.theta0]))

    def next_stage(self, state: PlanState) -> StagePlan | None:
        """All rounds at once, until the model exists."""
        return self._all_rounds(state) if state.model is None else None

    def absorb(self, state: PlanState, plan: StagePlan, result: TrainResult) -> PlanState:
        """The group's model is the model."""
        return state.replace(model=unstack_params(result.params, 0))

    def plan_unlearn(self, state: PlanState, clients: Sequence[int]) -> list[StagePlan]:
        """Retrain from theta^0 without ``clients`` (and without every earlier unlearned client)."""
        return [self._all_rounds(state, clients)]

    def current_params(self, state: PlanState) -> dict[str, Tensor]:
        """The trained model."""
        return state.model

    def reference_params(self) -> dict[str, Tensor]:
        """The independent reference: one group of the remaining clients, ``rounds`` rounds from theta^0."""
        group = Group(0, tuple(self.active_clients), self.rounds)
        return ReferenceReplay(self.engine).fedavg(self.theta0, group, stage=0)
