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

FATS is a :class:`~fedshard_lightning.unlearning.planner.Planner`: each round is one plan, one
engine call whose stage is the round number (so that recomputation can start at any round with
the same keys). The trainer's loop runs and commits the rounds one by one, so its callbacks see
round r as stage r (one round) and a killed fit resumes after its last round. The state is the
model after every round (row 0: theta^0) and each round's participants (ids padded with -1 to
``sample_size``: a tensor, so the checks around every planner call and each commit do not walk
a list that grows with the rounds); a request is the plans of the rounds from the rollback round
on, each from the model the one before it retrained.

Departures from the paper: clients run the engine's local training (``local_epochs`` or
``local_steps`` of mini-batch SGD with the model's optimizer) instead of the paper's one-sample
local steps with a TV-stable step size; duplicates are removed and the server averages the
distinct participants weighted by their sample counts (the paper averages the draws uniformly);
client sampling only (no sample-level unlearning).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.engine import Group, TrainResult, stack_params, unstack_params
from fedshard_lightning.engine.keys import SAMPLING, keyed_rng
from fedshard_lightning.errors import CacheError, ConfigError
from fedshard_lightning.flcache.cache import FLCache, StackWrite
from fedshard_lightning.limits import check_count
from fedshard_lightning.unlearning.context import AlgorithmContext
from fedshard_lightning.unlearning.plan_state import InitRows
from fedshard_lightning.unlearning.planner import Planner, PlanState, StagePlan
from fedshard_lightning.unlearning.reference import ReferenceReplay

__all__ = ["FATS"]

_BLOCK = 64
"""Ids drawn per generator call; fixed, so the stream of draws never depends on the population."""


def _previous_model(results: Sequence[TrainResult]) -> dict[str, Tensor]:
    """A recomputed round starts from the model the round before it recomputed."""
    return results[-1].params


class FATS(Planner):
    """FedAvg with keyed sampling with replacement; unlearning rewinds to the first participation.

    Args:
        rounds: Communication rounds.
        sample_size: Draws per round (with replacement, duplicates removed).
        **kwargs: Local training settings, see :class:`~fedshard_lightning.unlearning.base.Algorithm`
            (``client_fraction`` must stay 1.0: the sampler replaces it).
    """

    local_bn_ok = False  # one engine call per round

    name = "fats"

    def __init__(self, rounds: int = 20, sample_size: int = 8, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_count("algorithm.rounds", rounds)
        self.rounds = rounds
        if isinstance(sample_size, bool) or not isinstance(sample_size, int) or sample_size < 1:
            raise ConfigError(f"algorithm.sample_size={sample_size!r}: must be a positive integer")
        if self.client_fraction != 1.0:
            raise ConfigError(
                f"algorithm.client_fraction={self.client_fraction}: FATS draws sample_size clients per round "
                "itself; leave client_fraction at 1.0"
            )
        self.sample_size = sample_size

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

    # -- plans ------------------------------------------------------------------------------------
    def initial_state(self, theta0: dict[str, Tensor]) -> dict[str, Any]:
        """The model after every round so far (row 0: theta^0), and each round's participants."""
        ids = torch.empty((0, self.sample_size), dtype=torch.int64)
        return {"models": stack_params([theta0]), "participants": {"ids": ids}}

    def participants_of(self, state: PlanState | None = None) -> list[list[int]]:
        """Each trained round's participants (sorted ids); default: the current state."""
        ids = (self.state if state is None else state).participants["ids"]
        return [[c for c in row if c >= 0] for row in ids.tolist()]

    def _round(self, state: PlanState, r: int, init: InitRows, leaving: Sequence[int] = ()) -> StagePlan:
        """Round ``r`` (engine stage r, one round) of the active clients without ``leaving``, from ``init``."""
        return StagePlan(r, (Group(0, tuple(self.active(state, leaving)), 1),), init)

    def next_stage(self, state: PlanState) -> StagePlan | None:
        """The round after the last one trained, from its model; None after ``rounds`` rounds."""
        r = len(state.participants["ids"])
        if r >= self.rounds:
            return None
        return self._round(state, r, stack_params([unstack_params(state.models, r)]))

    def absorb(self, state: PlanState, plan: StagePlan, result: TrainResult) -> PlanState:
        """Round r's model and participants replace those of round r and later (a rewind drops them)."""
        r = plan.stage
        parts = sorted(int(c) for c in result.history[0].participants[0]) if result.history else []
        row = torch.tensor([parts + [-1] * (self.sample_size - len(parts))], dtype=torch.int64)
        models = {k: torch.cat([v[: r + 1], result.params[k]]) for k, v in state.models.items()}
        ids = torch.cat([state.participants["ids"][:r], row])
        return state.replace(models=models, participants={"ids": ids})

    def first_round(self, clients: Sequence[int], state: PlanState | None = None) -> int | None:
        """First round in which one of ``clients`` took part (None: never); default: the current state."""
        ids = (self.state if state is None else state).participants["ids"]
        hit = torch.isin(ids, torch.tensor([int(c) for c in clients], dtype=torch.int64)).any(dim=1)
        return int(hit.nonzero()[0, 0]) if bool(hit.any()) else None

    def plan_unlearn(self, state: PlanState, clients: Sequence[int]) -> list[StagePlan]:
        """Rewind to the first round a leaving client took part in; recompute every later round without them.

        Nothing to do for clients never sampled: no round saw them.
        """
        first = self.first_round(clients, state)
        if first is None:
            return []
        start = stack_params([unstack_params(state.models, first)])
        later = [self._round(state, r, _previous_model, clients) for r in range(first + 1, self.rounds)]
        return [self._round(state, first, start, clients), *later]

    def plan_retrain(self, state: PlanState, clients: Sequence[int]) -> list[StagePlan]:
        """Every round without ``clients``, for its cost.

        The fit's plans do not depend on the models, so they are listed directly rather than by
        the default's dry fold (which would copy the stack of models once per round).
        """
        start = stack_params([state.theta0])
        return [self._round(state, r, start, clients) for r in range(self.rounds)]

    def unlearn_details(
        self, state: PlanState, new: PlanState, clients: Sequence[int], plans: Sequence[StagePlan]
    ) -> dict[str, Any]:
        """The rollback round, the rounds recomputed and each leaving client's first round."""
        first = self.first_round(clients, state)
        return {
            "rollback_round": first,
            "retrained_rounds": [] if first is None else list(range(first, self.rounds)),
            "first_participation": {str(c): self.first_round([c], state) for c in clients},
        }

    def current_params(self, state: PlanState) -> dict[str, Tensor]:
        """The model after the last round."""
        return unstack_params(state.models, len(state.participants["ids"]))

    def progress(self) -> str:
        """Rounds trained so far (a killed fit resumes after the last one)."""
        return f"training stopped after round {len(self.participants_of())} of {self.rounds}"

    def reference_params(self) -> dict[str, Tensor]:
        """The independent reference: every round from theta^0 without the unlearned, its keyed sample."""
        return ReferenceReplay(self.engine).rounds_as_stages(self.theta0, self.active_clients, self.rounds)

    # -- cache ---------------------------------------------------------------------------------------
    def cache_files(
        self, cache: FLCache
    ) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict[str, str]]:
        """The participants (``participants.safetensors``); the models go to :meth:`cache_stacks`."""
        fields, tensors, reuse = super().cache_files(cache)
        tensors = {k: v for k, v in tensors.items() if k != "models.safetensors"}
        return fields, tensors, reuse

    def cache_stacks(self, cache: FLCache) -> dict[str, StackWrite]:
        """The models as stack ``rounds``: one blob per round, so a commit writes only new rounds' blobs."""
        return {"rounds": StackWrite(dict(self.state.models))}

    def restore_cache(self, cache: FLCache, manifest: dict[str, Any], device: torch.device) -> None:
        """The models and participants of every trained round."""
        if "participants.safetensors" not in manifest.get("files", {}) or "rounds" not in manifest.get(
            "stacks", {}
        ):
            raise CacheError(f"{cache.root}: the cache holds no FATS rounds (stack 'rounds', participants)")
        ids = cache.tensors("participants.safetensors", manifest=manifest).get("ids")
        models = cache.stack("rounds", device=device, manifest=manifest)
        n = next(iter(models.values())).shape[0]
        if ids is None or tuple(ids.shape) != (n - 1, self.sample_size) or n - 1 > self.rounds:
            got = None if ids is None else tuple(ids.shape)
            raise CacheError(
                f"{cache.root}: {n} models and participants {got} cached; {self.rounds} rounds of "
                f"{self.sample_size} draws configured"
            )
        self.load_state_dict(self.state.replace(models=models, participants={"ids": ids.to(torch.int64)}))
