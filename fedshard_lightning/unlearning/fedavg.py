"""FedAvg and its unlearning by retraining from scratch ("FA" in the FedShard paper's section 6).

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, Algorithm 1. Unlearning by retraining: the remaining clients train from the same initial model with the
same keyed randomness, so the result equals FedAvg trained without the leaving clients from the
start.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.engine import Group, TrainResult, stack_params, unstack_params
from fedshard_lightning.flcache.cache import FLCache
from fedshard_lightning.limits import check_count
from fedshard_lightning.unlearning.base import Algorithm, UnlearnResult
from fedshard_lightning.unlearning.planner import Planner, PlanState, StagePlan
from fedshard_lightning.unlearning.reference import ReferenceReplay

__all__ = ["FedAvg", "FedAvgRounds"]


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


class FedAvgRounds(Algorithm):
    """FedAvg with its state as attributes: the base of the methods that drive each round themselves.

    FedEraser and FedRecover (through ``history.py``) keep histories round by round; they train
    and unlearn like :class:`FedAvg` unless they override it.

    Args:
        rounds: Communication rounds.
        **kwargs: Local training settings, see :class:`~fedshard_lightning.unlearning.base.Algorithm`.
    """

    local_bn_ok = True  # one engine call trains every round

    name = "fedavg"
    state_fields = (*Algorithm.state_fields, "params")

    def __init__(self, rounds: int = 20, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_count("algorithm.rounds", rounds)
        self.rounds = rounds
        self.params: dict[str, Tensor] | None = None

    def initial_state(self, theta0: dict[str, Tensor]) -> dict[str, Any]:
        """No model yet."""
        return {**super().initial_state(theta0), "params": None}

    def is_complete(self) -> bool:
        """Trained once the model exists."""
        return self.params is not None

    def _train_on(self, clients: Sequence[int], report: bool) -> tuple[dict[str, Tensor], int]:
        res = self.train(
            stack_params([self.theta0]), [Group(0, tuple(clients), self.rounds)], stage=0, report=report
        )
        return unstack_params(res.params, 0), res.client_steps

    def fit(self) -> dict[str, Tensor]:
        """Train all (active) clients for ``rounds`` rounds from theta^0."""
        self.events.stage_start(0, [Group(0, tuple(self.active_clients), self.rounds)])
        self.params, self.total_client_steps = self._train_on(self.active_clients, report=True)
        self.events.stage_end(0)
        return self.params

    def current_params(self) -> dict[str, Tensor]:
        """The current global model."""
        return self.params

    def _cost(self, clients: Sequence[int], latency: bool = False) -> int:
        group = Group(0, tuple(clients), self.rounds)
        per_round = self.engine.latency_of if latency else self.engine.client_steps_of
        return sum(per_round(self.engine.participants(0, group, r)) for r in range(self.rounds))

    def predict_cost(self, clients: Sequence[int]) -> int:
        """Retraining the remaining clients for every round."""
        return self._cost(self.remaining(clients))

    retrain_cost = predict_cost

    def predict_latency(self, clients: Sequence[int]) -> int:
        """Every round's slowest remaining participant, over every round."""
        return self._cost(self.remaining(clients), latency=True)

    def unlearn(self, clients: Sequence[int]) -> UnlearnResult:
        """Retrain from theta^0 without ``clients`` (and without every earlier unlearned client)."""
        remaining = self.remaining(clients)
        predicted = self._cost(remaining)
        t = time.perf_counter()
        params, steps = self._train_on(remaining, report=False)
        seconds = time.perf_counter() - t
        self.params = params
        self.unlearned = sorted({*self.unlearned, *clients})
        return UnlearnResult(params, steps, predicted, predicted, seconds)

    def reference_params(self) -> dict[str, Tensor]:
        """The independent reference: one group of the remaining clients, ``rounds`` rounds from theta^0."""
        group = Group(0, tuple(self.active_clients), self.rounds)
        return ReferenceReplay(self.engine).fedavg(self.theta0, group, stage=0)

    # -- cache ------------------------------------------------------------------------------------
    def cache_files(
        self, cache: FLCache
    ) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict[str, str]]:
        """The current model (once trained)."""
        return {}, ({"model.safetensors": self.params} if self.params is not None else {}), {}

    def restore_cache(self, cache: FLCache, manifest: dict[str, Any], device: torch.device) -> None:
        """Restore the model."""
        files = manifest.get("files", {})
        self.params = (
            cache.tensors("model.safetensors", device=device, manifest=manifest)
            if "model.safetensors" in files
            else None
        )
