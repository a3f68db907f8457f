"""FATS: federated averaging with per-round client sampling and rollback unlearning ("FT" in section 6).

Tao, Wang, Pan, Yu, Cheng and Wang, "Communication Efficient and Provable Federated Unlearning",
PVLDB 17(5), 2024 (VLDB 2024): the training algorithm FATS samples clients uniformly *with
replacement* in every round, and its client-level unlearning algorithm rewinds to the first round
in which the leaving client was sampled and recomputes every later round without it; a client
that was never sampled is unlearned for free. Sampling with replacement is what makes the rewind
exact in distribution (TV-stability): the paper couples the old and new samplers so that rounds
before the rewind point keep their samples.

Here the coupling is made exact, not only in distribution. The sampler of round r draws client ids
uniformly from ``0..K-1`` from a generator keyed by ``(seed, r)`` and *rejects* ids that are not in
the population (left earlier, or leaving now) until ``sample_size`` draws are accepted; duplicates
are then removed (SPEC section 9). Removing a client that was never drawn before round r leaves
every draw before r unchanged, so the rewound-and-recomputed model is *equal* to FATS trained
without the leaving clients from the start (every round's local shuffling is keyed too).

Each FATS round is one engine call whose engine "stage" is the round number (so that recomputation
can start at any round with the same keys); the trainer's callbacks still see stage 0, round r.

Departures from the paper: clients run the engine's local training (``local_epochs`` or
``local_steps`` of mini-batch SGD with the model's optimizer) instead of the paper's one-sample
local steps with a TV-stable step size; duplicates are removed and the server averages the
distinct participants weighted by their sample counts (the paper averages the draws uniformly);
client sampling only (no sample-level unlearning).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.engine import Group, RoundInfo, TrainResult, stack_params, unstack_params
from fedshard_lightning.engine.keys import SAMPLING, keyed_rng
from fedshard_lightning.errors import CacheError, ConfigError
from fedshard_lightning.flcache.cache import FLCache
from fedshard_lightning.unlearning.base import UnlearnResult
from fedshard_lightning.unlearning.context import AlgorithmContext
from fedshard_lightning.unlearning.fedavg import FedAvgRounds
from fedshard_lightning.unlearning.reference import ReferenceReplay

__all__ = ["FATS"]

_BLOCK = 64
"""Ids drawn per generator call; fixed, so the stream of draws never depends on the population."""


class FATS(FedAvgRounds):
    """FedAvg with keyed sampling with replacement; unlearning rewinds to the first participation.

    Args:
        rounds: Communication rounds.
        sample_size: Draws per round (with replacement, duplicates removed).
        **kwargs: Local training settings, see :class:`~fedshard_lightning.unlearning.base.Algorithm`
            (``client_fraction`` must stay 1.0: the sampler replaces it).
    """

    local_bn_ok = False  # one engine call per round

    name = "fats"
    state_fields = (*FedAvgRounds.state_fields, "models", "participants")

    def __init__(self, rounds: int = 20, sample_size: int = 8, **kwargs: Any) -> None:
        super().__init__(rounds=rounds, **kwargs)
        if isinstance(sample_size, bool) or not isinstance(sample_size, int) or sample_size < 1:
            raise ConfigError(f"algorithm.sample_size={sample_size!r}: must be a positive integer")
        if self.client_fraction != 1.0:
            raise ConfigError(
                f"algorithm.client_fraction={self.client_fraction}: FATS draws sample_size clients per round "
                "itself; leave client_fraction at 1.0"
            )
        self.sample_size = sample_size
        self.models: dict[str, Tensor] | None = None
        self.participants: list[list[int]] = []

    def initial_state(self, theta0: dict[str, Tensor]) -> dict[str, Any]:
        """No round trained yet."""
        return {**super().initial_state(theta0), "models": None, "participants": []}

    def setup(self, ctx: AlgorithmContext) -> None:
        """Build the engine and make it sample with :meth:`sample`."""
        super().setup(ctx)
        self.engine = self.engine.with_participants(self._participants)

    # -- sampling ---------------------------------------------------------------------------------
    def sample(self, round_: int, population: Sequence[int]) -> list[int]:
        """Sorted distinct clients of round ``round_`` drawn from ``population``.

        ``sample_size`` keyed uniform draws with replacement (rejection from all K ids, see the
        module docstring), duplicates removed.
        """
        allowed = set(int(c) for c in population)
        if not allowed:
            return []
        rng = keyed_rng(self.ctx.seed, round_, 0, 0, SAMPLING)
        drawn: list[int] = []
        while len(drawn) < self.sample_size:
            for c in rng.integers(0, self.num_clients, size=_BLOCK).tolist():
                if c in allowed:
                    drawn.append(c)
                    if len(drawn) == self.sample_size:
                        break
        return sorted(set(drawn))

    def _participants(self, stage: int, group: Group, round_: int) -> list[int]:
        # One engine call per FATS round: the engine's stage is the round number.
        return self.sample(stage, group.clients)

    # -- rounds -----------------------------------------------------------------------------------
    def _round(self, start: dict[str, Tensor], clients: Sequence[int], r: int, report: bool) -> TrainResult:
        group = Group(0, tuple(clients), 1)
        events = self.events

        def hook(info: RoundInfo, state: dict[str, Tensor]) -> None:
            events.round_end(replace(info, stage=0, round=r), state, [group])

        return self.train(
            stack_params([start]), [group], stage=r, on_round_end=hook if report else None, report=False
        )

    def _run(
        self, start: dict[str, Tensor], clients: Sequence[int], first: int, report: bool
    ) -> tuple[list[dict[str, Tensor]], list[list[int]], int]:
        """Rounds ``first..rounds-1`` from ``start``: the models after each round, the participants, steps."""
        models, parts, steps = [], [], 0
        for r in range(first, self.rounds):
            res = self._round(start, clients, r, report)
            parts.append(sorted(res.history[0].participants[0]) if res.history else [])
            start = unstack_params(res.params, 0)
            models.append(start)
            steps += res.client_steps
        return models, parts, steps

    def fit(self) -> dict[str, Tensor]:
        """``rounds`` FATS rounds over all (active) clients from theta^0."""
        clients = tuple(self.active_clients)
        self.events.stage_start(0, [Group(0, clients, self.rounds)])
        models, self.participants, self.total_client_steps = self._run(self.theta0, clients, 0, report=True)
        self.models = stack_params([self.theta0, *models])
        self.params = models[-1]
        self.events.stage_end(0, {"client_steps": float(self.total_client_steps)})
        return self.params

    # -- costs ------------------------------------------------------------------------------------
    def first_round(self, clients: Sequence[int]) -> int | None:
        """First round in which one of ``clients`` took part (None: never)."""
        leaving = set(clients)
        return next((r for r, p in enumerate(self.participants) if leaving & set(p)), None)

    def _cost_from(self, first: int, clients: Sequence[int], latency: bool = False) -> int:
        group = Group(0, tuple(clients), 1)
        per_round = self.engine.latency_of if latency else self.engine.client_steps_of
        return sum(per_round(self.engine.participants(r, group, 0)) for r in range(first, self.rounds))

    def predict_cost(self, clients: Sequence[int]) -> int:
        """Steps of the rounds from the first participation on, re-sampled without ``clients``."""
        first = self.first_round(clients)
        return 0 if first is None else self._cost_from(first, self.remaining(clients))

    def retrain_cost(self, clients: Sequence[int]) -> int:
        """Steps of FATS retrained from scratch without ``clients``."""
        return self._cost_from(0, self.remaining(clients))

    def predict_latency(self, clients: Sequence[int]) -> int:
        """The slowest re-sampled participant of every round from the first participation on."""
        first = self.first_round(clients)
        return 0 if first is None else self._cost_from(first, self.remaining(clients), latency=True)

    # -- unlearning -------------------------------------------------------------------------------
    def unlearn(self, clients: Sequence[int]) -> UnlearnResult:
        """Rewind to the first round a leaving client took part in; recompute the rest without them."""
        first = self.first_round(clients)
        firsts = {str(c): self.first_round([c]) for c in clients}
        remaining = self.remaining(clients)
        predicted = self.predict_cost(clients)
        retrain = self.retrain_cost(clients)
        t = time.perf_counter()
        steps = 0
        if first is not None:
            models, parts, steps = self._run(
                unstack_params(self.models, first), remaining, first, report=False
            )
            self.models = {
                k: torch.cat([v[: first + 1], torch.stack([m[k] for m in models])])
                for k, v in self.models.items()
            }
            self.participants = self.participants[:first] + parts
            self.params = models[-1]
        seconds = time.perf_counter() - t
        self.unlearned = sorted({*self.unlearned, *clients})
        return UnlearnResult(
            self.current_params(),
            steps,
            predicted,
            retrain,
            seconds,
            details={
                "rollback_round": first,
                "retrained_rounds": [] if first is None else list(range(first, self.rounds)),
                "first_participation": firsts,
            },
        )

    def reference_params(self) -> dict[str, Tensor]:
        """The independent reference: every round from theta^0 without the unlearned, its keyed sample."""
        return ReferenceReplay(self.engine).rounds_as_stages(self.theta0, self.active_clients, self.rounds)

    # -- cache ------------------------------------------------------------------------------------
    def cache_files(
        self, cache: FLCache
    ) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict[str, str]]:
        """The model after every round and every round's participants."""
        fields, tensors, reuse = super().cache_files(cache)
        if self.params is not None:
            tensors = {**tensors, "rounds.safetensors": self.models}
        return {**fields, "participants": self.participants}, tensors, reuse

    def restore_cache(self, cache: FLCache, manifest: dict[str, Any], device: torch.device) -> None:
        """Restore the per-round models and participants."""
        super().restore_cache(cache, manifest, device)
        if self.params is None:
            self.models, self.participants = None, []
            return
        self.models = cache.tensors("rounds.safetensors", device=device, manifest=manifest)
        self.participants = [[int(c) for c in p] for p in manifest["participants"]]
        if len(self.participants) != self.rounds:
            raise CacheError(
                f"{cache.root}: {len(self.participants)} rounds cached, {self.rounds} configured"
            )
