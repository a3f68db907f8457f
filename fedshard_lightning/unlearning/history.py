"""FedAvg that keeps per-round history in FLCache: the shared base of FedEraser and FedRecover.

A :class:`~fedshard_lightning.unlearning.planner.Planner`. The fit is one plan per round: round r
is the engine's stage r (round 0 of a one-round group), so any retained round can be replayed
later, alone, with the keys it was trained with. ``absorb`` keeps the round's model and, for a
retained round, its start model and its participants' updates. A request (the subclass's
``plan_unlearn``) replays rounds from theta^0: each of its plans starts from the model that the
server computed from the results of the plans before it (the plan's ``init`` function does that
server work), and its last plan trains no round: it holds the recovered model, which ``absorb``
keeps.

Where the history lives: the state holds which rounds were retained and who took part in each
(``history``, JSON) and the tensors of the newest retained round only (``recorded``, until the
loop commits them). The trainer's loop commits FLCache after every round; each retained round
becomes its own file ``round_NNNN.safetensors``, one blob that every later version shares, and
older rounds are read back from the cache one at a time when a request needs them
(:class:`UpdateHistory`). Memory therefore holds one round of client updates, not
rounds x clients x parameters (FedRecover keeps every round), and a commit writes only the new
round. A killed fit resumes after its last committed round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.engine import Group, TrainResult, stack_params, unstack_params
from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.cache import FLCache
from fedshard_lightning.limits import check_count
from fedshard_lightning.unlearning.plan_state import thaw
from fedshard_lightning.unlearning.planner import Planner, PlanState, StagePlan

__all__ = ["HistoryFedAvg", "UpdateHistory", "round_file"]


def round_file(r: int) -> str:
    """The cache file of retained round ``r``."""
    return f"round_{r:04d}.safetensors"


class UpdateHistory:
    """The retained rounds of a state, read one round at a time (a view: it keeps no tensors).

    Args:
        state: A :class:`HistoryFedAvg` state: ``history`` (participants by round) and
            ``recorded`` (the newest retained round's tensors, until the loop commits them).
        cache: The run's FLCache, which holds every committed round (None before the first commit).
    """

    def __init__(self, state: PlanState, cache: FLCache | None) -> None:
        self.state, self.cache = state, cache

    @property
    def participants(self) -> dict[int, list[int]]:
        """Participants of every retained round."""
        return {int(r): [int(c) for c in clients] for r, clients in self.state.history.items()}

    @property
    def rounds(self) -> list[int]:
        """Retained rounds, in order."""
        return sorted(int(r) for r in self.state.history)

    def held(self) -> int | None:
        """The round whose tensors the state holds (``recorded``), if any."""
        recorded = self.state.recorded
        return None if recorded is None else int(next(iter(recorded)).split("/", 1)[0][1:])

    def load(self, r: int, device: torch.device | str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(start model, updates ``[participants, ...]``) of round ``r`` on ``device``."""
        if r == self.held():
            flat = {k.split("/", 1)[1]: v.to(device) for k, v in self.state.recorded.items()}
        elif self.cache is not None:
            flat = self.cache.tensors(round_file(r), device=device)
        else:
            raise CacheError(
                f"round {r} of the history is not in the state and no cache holds it: unlearning reads the "
                "rounds from the run's FLCache, which the trainer's fit commits (or loads)"
            )
        start = {k[7:]: v for k, v in flat.items() if k.startswith("global/")}
        updates = {k[7:]: v for k, v in flat.items() if k.startswith("update/")}
        return start, updates


class HistoryFedAvg(Planner):
    """FedAvg trained one plan per round, retaining the updates of every ``keep_every``-th round.

    Round r is the engine's stage r. Subclasses define ``plan_unlearn``: plans whose ``init``
    functions compute, from the results before them and the retained rounds (:meth:`history_of`),
    the model each replayed round starts from, ending with :meth:`closing_plan`.

    Args:
        rounds: Communication rounds.
        keep_every: Retain rounds ``0, keep_every, 2 keep_every, ...``.
        **kwargs: Local training settings, see :class:`~fedshard_lightning.unlearning.base.Algorithm`.
    """

    local_bn_ok = False  # one engine call per round

    def __init__(self, rounds: int = 20, keep_every: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_count("algorithm.rounds", rounds)
        self.rounds = rounds
        self.keep_every = int(keep_every)
        self._history_cache: FLCache | None = None  # where committed rounds are read back from

    # -- the planner -----------------------------------------------------------------------------
    def initial_state(self, theta0: dict[str, Tensor]) -> dict[str, Any]:
        """No model, no round trained, none retained."""
        return {"model": None, "rounds_trained": 0, "history": {}, "recorded": None}

    def next_stage(self, state: PlanState) -> StagePlan | None:
        """The next round: the active clients, one round from the current model (client updates kept if retained)."""
        r = state.rounds_trained
        if r >= self.rounds:
            return None
        start = state.theta0 if state.model is None else state.model
        group = Group(0, tuple(self.active(state)), 1)
        return StagePlan(r, (group,), stack_params([start]), keep_client_params=r % self.keep_every == 0)

    def absorb(self, state: PlanState, plan: StagePlan, result: TrainResult) -> PlanState:
        """A fit round: its model, and its updates if retained. A request: its closing plan's model."""
        if state.rounds_trained < self.rounds:
            return self._absorb_round(state, plan, result)
        if any(g.rounds for g in plan.groups):  # a replayed round: the plans after it read its result
            return state
        return state.replace(model=unstack_params(result.params, 0), recorded=None)

    def _absorb_round(self, state: PlanState, plan: StagePlan, result: TrainResult) -> PlanState:
        r = plan.stage
        model = unstack_params(result.params, 0)
        if not (plan.keep_client_params and result.history):
            return state.replace(model=model, rounds_trained=r + 1, recorded=None)
        ids, start, updates = self.client_updates(result)
        key = f"r{r:04d}/"  # the round, then the file's own keys
        recorded = {
            **{f"{key}global/{k}": v.detach().cpu() for k, v in start.items()},
            **{f"{key}update/{k}": v.detach().cpu() for k, v in updates.items()},
        }
        history = {**state.history, str(r): [int(c) for c in ids]}
        return state.replace(model=model, rounds_trained=r + 1, history=history, recorded=recorded)

    def current_params(self, state: PlanState) -> dict[str, Tensor]:
        """The global model (after every applied request)."""
        return state.model

    # -- helpers for the subclasses ---------------------------------------------------------------
    def history_of(self, state: PlanState) -> UpdateHistory:
        """The retained rounds of ``state`` (tensors read from the state or the run's cache)."""
        return UpdateHistory(state, self._history_cache)

    @property
    def history(self) -> UpdateHistory:
        """The retained rounds of the current state."""
        return self.history_of(self.state)

    def closing_plan(self, init: Callable[[Sequence[TrainResult]], dict[str, Tensor]]) -> StagePlan:
        """A request's last plan: no client trains; ``init`` (from the results before it) is the recovered model."""
        return StagePlan(self.rounds, (Group(0, (), 0),), init)

    @staticmethod
    def client_updates(res: TrainResult) -> tuple[list[int], dict[str, Tensor], dict[str, Tensor]]:
        """(client ids, start model, updates ``[clients, ...]``) of a one-round ``keep_client_params`` result."""
        info = res.history[0]
        start = unstack_params(info.start_params, 0)
        return info.client_ids, start, {k: v - start[k] for k, v in info.client_params.items()}

    # -- cache ------------------------------------------------------------------------------------
    def cache_files(
        self, cache: FLCache
    ) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict[str, str]]:
        """The model, the history's index, and one file per retained round (written once, then shared)."""
        state = self.state
        fields = {"rounds_trained": state.rounds_trained, "history": thaw(state.history), "recorded": None}
        tensors: dict[str, dict[str, Tensor]] = {}
        if state.model is None:
            fields["model"] = None
        else:
            tensors["model.safetensors"] = dict(state.model)
        history = self.history_of(state)
        held = history.held()
        files = cache.manifest()["files"] if cache.exists() else {}
        reuse = {}
        for r in history.rounds:
            name = round_file(r)
            if r == held:
                tensors[name] = {k.split("/", 1)[1]: v for k, v in state.recorded.items()}
            elif name in files:
                reuse[name] = name
            else:
                raise CacheError(
                    f"{cache.root}: round {r} of the history is neither in the state nor in the current cache "
                    "version (the loop commits every round as it is trained)"
                )
        return {"state": fields}, tensors, reuse

    def committed(self, cache: FLCache, version: str) -> None:
        """The retained rounds are in ``cache`` now: read them from there."""
        self._history_cache = cache

    def restore_cache(self, cache: FLCache, manifest: dict[str, Any], device: torch.device) -> None:
        """The state's fields; the retained rounds stay in the cache, read when a request needs them."""
        super().restore_cache(cache, manifest, device)
        files = manifest.get("files", {})
        missing = [r for r in self.history_of(self.state).rounds if round_file(r) not in files]
        if missing:
            raise CacheError(f"{cache.root}: the history file of round {missing[0]} is missing")
        self._history_cache = cache
