"""A federated (un)learning method as a planner over explicit, immutable state.

A :class:`Planner` answers four questions and keeps nothing else:

* ``next_stage(state) -> StagePlan | None``: what the fit trains next (groups of clients, the
  initial model of each, its rounds, an optional early-stop rule), or ``None`` once it is done;
* ``absorb(state, plan, result) -> state``: the new state after the engine ran the plan (pure);
* ``plan_unlearn(state, clients) -> [StagePlan]``: what removing ``clients`` retrains;
* ``current_params(state)``: the global model of a state.

Everything else is derived, the same way for every planner: the trainer's loop
(``fedshard_lightning.trainer.stage_loop``) runs the fit plans on the engine, fires the
callbacks and commits FLCache after each stage; the cost of a plan is counted from its groups
and rounds by the engine's participant policy (:meth:`Planner.cost`), so ``predict_cost``,
``retrain_cost`` and ``predict_latency`` need no code of the method's; :meth:`Planner.what_if` is a fold of
``absorb`` over the ``plan_unlearn`` plans that records the unlearned clients itself; ``audit``
compares the state with :meth:`Planner.replay_state` (by default a fresh fit of ``next_stage``
plans without the unlearned clients; FedShard replays its frozen tree). Optional hooks
(``stage_report``, ``unlearn_details``, ``audit_compare``) add what a method reports.
The state is a :class:`~.plan_state.PlanState`; every call is checked
(:mod:`~fedshard_lightning.unlearning.plan_contract`). A planner is also an
:class:`~fedshard_lightning.unlearning.base.Algorithm`, so commands, callbacks and comparisons
use it as they use the others.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.engine import FederatedEngine, Group, TrainResult
from fedshard_lightning.errors import CacheError, ConfigError, ContractError
from fedshard_lightning.unlearning.base import Algorithm, UnlearnResult, retrain_audit
from fedshard_lightning.unlearning.context import LoopEvents
from fedshard_lightning.unlearning.plan_contract import (
    PLANNER_FORBIDS,
    PLANNER_REQUIRES,
    CheckedPlanner,
    check_field_values,
    check_rows,
)
from fedshard_lightning.unlearning.plan_state import BASE_FIELDS, PlanState, StagePlan, is_tensor_map, thaw

__all__ = ["PlanState", "Planner", "StagePlan"]


class Planner(Algorithm):
    """Base class of methods written as planners (see the module docstring); subclasses define the four methods."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("current_params")
        if own is not None and own is not Planner.__dict__["current_params"]:
            # the method's ``current_params(state)``; the public one takes an optional state, checked
            cls.params_of = own
            cls.current_params = Planner.__dict__["current_params"]

    # -- the four methods --------------------------------------------------------------------------
    def initial_state(self, theta0: dict[str, Tensor]) -> dict[str, Any]:
        """The method's fields of a state that has not trained (the loop adds ``theta0``, ``unlearned``...)."""
        return {}

    def next_stage(self, state: PlanState) -> StagePlan | None:
        """The next plan of the fit, or ``None`` when ``state`` is that of a finished fit."""
        raise NotImplementedError

    def absorb(self, state: PlanState, plan: StagePlan, result: TrainResult) -> PlanState:
        """The state after the engine ran ``plan`` (``result``: its models ``[groups, ...]``); pure."""
        raise NotImplementedError

    def plan_unlearn(self, state: PlanState, clients: Sequence[int]) -> list[StagePlan]:
        """The plans that remove ``clients`` from ``state``, in order (later ``init`` may read earlier results)."""
        raise NotImplementedError

    def params_of(self, state: PlanState) -> dict[str, Tensor]:
        """The global model of ``state`` (a subclass writes it as ``current_params(self, state)``)."""
        raise NotImplementedError

    def current_params(self, state: PlanState | None = None) -> dict[str, Tensor]:
        """The global model of ``state`` (default: the current state), checked."""
        return self.checked.current_params(self.state if state is None else state)

    def plan_retrain(self, state: PlanState, clients: Sequence[int]) -> list[StagePlan]:
        """The plans of a fit from ``theta0`` without ``clients`` (and the unlearned), for its cost.

        Default: ``next_stage`` folded with untrained results (each plan's initial rows stand for
        its models), which lists the exact plans of a method whose plans do not depend on what
        training produced (a fixed number of stages, groups and rounds). A method whose plans
        do (a grouping chosen from trained models) overrides it with the plans it would replay.
        """
        dry = self.fresh_state(state.theta0, (*state.unlearned, *clients))
        plans, check = [], self.checked
        while (plan := check.next_stage(dry)) is not None:
            plans.append(plan)
            if len(plans) > 100_000:
                raise ContractError(
                    f"trainer.algorithm: {type(self).__name__}.next_stage() plans without end when nothing is "
                    "trained (its plans depend on the models): define plan_retrain(state, clients)"
                )
            init = self.init_rows(plan, [])
            result = TrainResult(
                dict(init), 0, [0] * len(plan.groups), [g.rounds for g in plan.groups], 0.0, []
            )
            dry = check.absorb(dry, plan, result)
        return plans

    # -- optional hooks (defaults fit most methods) ------------------------------------------------
    def stage_report(
        self, state: PlanState, plan: StagePlan, result: TrainResult
    ) -> tuple[dict[str, float], dict[str, Tensor] | None]:
        """A fit stage's own metrics and the model the loop evaluates for it (``state``: after absorb).

        Default: nothing of the method's, and no evaluation.
        """
        return {}, None

    def unlearn_details(
        self, state: PlanState, new: PlanState, clients: Sequence[int], plans: Sequence[StagePlan]
    ) -> dict[str, Any]:
        """What the request's report says besides its costs (``state`` before, ``new`` after); default none."""
        return {}

    def replay_state(self, state: PlanState) -> tuple[PlanState, int]:
        """``state`` retrained from theta^0 without its unlearned clients, and the client-steps it took.

        What ``audit`` compares with. Default: a fresh fit of ``next_stage`` plans without them, with
        the loop's events silenced. A method whose retraining replays a frozen record (FedShard's
        tree) overrides it with that record's plans.
        """
        ctx = self.ctx
        self.ctx = replace(ctx, events=LoopEvents())
        try:
            reference = self.fit_silently(self.fresh_state(state.theta0, state.unlearned))
        finally:
            self.ctx = ctx
        return reference, int(reference.total_client_steps)

    def audit_compare(
        self, state: PlanState, reference: PlanState, tolerance: float, steps: int
    ) -> dict[str, Any]:
        """``audit``'s verdict: the models of ``state`` and of its replay ``reference`` compared.

        Default: the global models (:func:`~.base.retrain_audit`); a method with more models to
        compare (FedShard's shards) lists them too.
        """
        return retrain_audit(
            self.current_params(state),
            self.current_params(reference),
            list(state.unlearned),
            tolerance,
            steps,
        )

    # -- helpers for methods -----------------------------------------------------------------------
    def active(self, state: PlanState, leaving: Sequence[int] = ()) -> list[int]:
        """Clients of ``state`` that are not unlearned, without ``leaving``."""
        gone = {*state.unlearned, *(int(c) for c in leaving)}
        return [c for c in range(self.num_clients) if c not in gone]

    @property
    def stores_own_state(self) -> bool:
        """The method writes its own cache files (``cache_files``), so its state fields may be any value it writes."""
        return type(self).cache_files is not Planner.cache_files

    # -- state (the loop's) ------------------------------------------------------------------------
    @property
    def checked(self) -> CheckedPlanner:
        """This planner's methods called with the contract's checks (all the loop ever calls)."""
        return CheckedPlanner(self)

    @property
    def state(self) -> PlanState:
        """The current state (the last one the loop committed or loaded)."""
        state = self.__dict__.get("_state")
        if state is None:
            raise ConfigError(
                f"trainer.algorithm: {type(self).__name__} has no state before fit or a loaded run"
            )
        return state

    def _base(self, name: str, value: Any) -> None:
        """The trainer sets the loop's fields (restoring a run); a theta0 before any state starts one."""
        state = self.__dict__.get("_state")
        if state is not None:
            self.__dict__["_state"] = state._with({name: value})
        elif name == "theta0" and value is not None:
            self.__dict__["_state"] = self.fresh_state(value)

    @property
    def theta0(self) -> dict[str, Tensor] | None:
        """The initial model of the current state."""
        state = self.__dict__.get("_state")
        return None if state is None else dict(state.theta0)

    @theta0.setter
    def theta0(self, value: dict[str, Tensor] | None) -> None:
        self._base("theta0", value)

    @property
    def unlearned(self) -> list[int]:
        """Clients unlearned in the current state (the loop records them)."""
        state = self.__dict__.get("_state")
        return [] if state is None else list(state.unlearned)

    @unlearned.setter
    def unlearned(self, value: Sequence[int]) -> None:
        self._base("unlearned", tuple(sorted(int(c) for c in value)))

    @property
    def total_client_steps(self) -> int:
        """Client-steps of the fit (the loop counts them)."""
        state = self.__dict__.get("_state")
        return 0 if state is None else int(state.total_client_steps)

    @total_client_steps.setter
    def total_client_steps(self, value: int) -> None:
        self._base("total_client_steps", int(value))

    def fresh_state(self, theta0: dict[str, Tensor], exclude: Sequence[int] = ()) -> PlanState:
        """The state of a fit that has not trained, as if ``exclude`` had left before it."""
        own = self.initial_state(theta0)
        where = f"trainer.algorithm: {type(self).__name__}.initial_state()"
        if not isinstance(own, dict):
            raise ContractError(
                f"{where} must return a dict of the method's fields, got {type(own).__name__}"
            )
        clash = sorted(set(own) & set(BASE_FIELDS))
        if clash:
            raise ContractError(
                f"{where} returned the loop's field(s) {clash}; return only the method's own fields"
            )
        check_field_values(self, own, where)
        base = {"theta0": theta0, "unlearned": sorted({int(c) for c in exclude}), "total_client_steps": 0}
        return PlanState({**base, **own})

    def reset(self, theta0: dict[str, Tensor], exclude: Sequence[int] = ()) -> None:
        """Start a fresh fit from ``theta0``, as if ``exclude`` had left before training."""
        self.__dict__["_state"] = self.fresh_state(theta0, exclude)

    def state_dict(self) -> PlanState:
        """The current state (immutable: safe to keep and hand to :meth:`what_if`)."""
        return self.state

    def load_state_dict(self, state: PlanState | dict[str, Any]) -> None:
        """Make ``state`` the current one."""
        self.__dict__["_state"] = state if isinstance(state, PlanState) else PlanState(state)

    def is_complete(self) -> bool:
        """Finished when there is no next stage."""
        return self.__dict__.get("_state") is not None and self.checked.next_stage(self.state) is None

    # -- running plans -------------------------------------------------------------------------------
    def init_rows(self, plan: StagePlan, results: Sequence[TrainResult]) -> dict[str, Tensor]:
        """The plan's initial models (evaluated from ``results`` of the plans before it when it is a function)."""
        if not callable(plan.init):
            return dict(plan.init)
        where = f"trainer.algorithm: {type(self).__name__}: StagePlan.init(results)"
        return dict(check_rows(self, plan.init(results), len(plan.groups), where))

    def run_plan(
        self, plan: StagePlan, results: Sequence[TrainResult] = (), report: bool = False
    ) -> TrainResult:
        """Train ``plan`` on the engine (its rounds reported to the loop events when ``report``).

        A plan whose groups train no round is its initial models, without an engine call: e.g. a
        request's last plan, which holds the model that the server computed from the plans before it.
        """
        init = self.init_rows(plan, results)
        if all(g.rounds == 0 for g in plan.groups):
            groups = len(plan.groups)
            return TrainResult(init, 0, [0] * groups, [0] * groups, 0.0, [])
        hook = plan.stop() if plan.stop is not None else None
        return self.train(
            init,
            list(plan.groups),
            plan.stage,
            on_round_end=hook,
            keep_client_params=plan.keep_client_params,
            report=report,
            engine=plan.engine,
        )

    def run_plans(self, plans: Sequence[StagePlan]) -> list[TrainResult]:
        """Train a request's plans in order, unreported; later plans may start from earlier results.

        Plans that all train (some round) plainly, without a stop rule, an engine of their own or
        client models kept, train as one engine call (:meth:`~.base.Algorithm.train_stages`: every
        stage's batches planned at once); others one by one.
        """
        plain = all(
            p.stop is None
            and p.engine is None
            and not p.keep_client_params
            and any(g.rounds for g in p.groups)
            for p in plans
        )
        if plans and plain:
            return self.train_stages(
                [(p.stage, list(p.groups)) for p in plans], lambda j, done: self.init_rows(plans[j], done)
            )
        results: list[TrainResult] = []
        for plan in plans:
            results.append(self.run_plan(plan, results))
        return results

    def cost(self, plan: StagePlan, latency: bool = False) -> int:
        """Client-steps of ``plan`` (every planned round, with the engine's participants of each).

        With ``latency``: groups train side by side, so the plan takes its slowest group's
        latency (a round: its slowest participant's steps).
        """
        costs = [self.group_cost(plan.stage, g, latency, plan.engine) for g in plan.groups]
        return max(costs, default=0) if latency else sum(costs)

    def group_cost(
        self, stage: int, group: Group, latency: bool = False, engine: FederatedEngine | None = None
    ) -> int:
        """Client-steps of one group's rounds (``latency``: each round's slowest participant)."""
        eng = self.engine if engine is None else engine
        per_round = eng.latency_of if latency else eng.client_steps_of
        if not group.clients:
            return 0
        if eng.samples_everyone:  # every client in every round: no per-round draw
            return group.rounds * per_round(group.clients)
        return sum(per_round(eng.participants(stage, group, r)) for r in range(group.rounds))

    def predict_cost(self, clients: Sequence[int]) -> int:
        """Client-steps of unlearning ``clients`` now: the cost of the ``plan_unlearn`` plans."""
        return sum(self.cost(p) for p in self.checked.plan_unlearn(self.state, clients))

    def retrain_cost(self, clients: Sequence[int]) -> int:
        """Client-steps of retraining from scratch without ``clients``: the cost of :meth:`plan_retrain`."""
        return sum(self.cost(p) for p in self.checked.plan_retrain(self.state, clients))

    def predict_latency(self, clients: Sequence[int]) -> int:
        """Latency in steps of unlearning ``clients``: plan after plan, each its slowest group."""
        return sum(self.cost(p, latency=True) for p in self.checked.plan_unlearn(self.state, clients))

    def what_if(
        self, state: PlanState | dict[str, Any], clients: Sequence[int]
    ) -> tuple[PlanState, UnlearnResult]:
        """The state after removing ``clients``, and the result: a fold of ``absorb`` over ``plan_unlearn``.

        Nothing is swapped or written: ``state`` stays as it was (it is immutable), so what-if
        analyses keep the new state and the trainer's ``unlearn`` commits it. The result's
        ``server_seconds`` are the request's time outside the engine's training (the plans' init
        functions and ``absorb``); its ``details`` are :meth:`unlearn_details`.
        """
        state = state if isinstance(state, PlanState) else PlanState(state)
        check = self.checked
        plans = check.plan_unlearn(state, clients)
        predicted = sum(self.cost(p) for p in plans)
        retrain = sum(self.cost(p) for p in check.plan_retrain(state, clients))
        t = time.perf_counter()
        new = state._with({"unlearned": tuple(sorted({*state.unlearned, *(int(c) for c in clients)}))})
        results = self.run_plans(plans)
        for plan, result in zip(plans, results):
            new = check.absorb(new, plan, result)
        seconds = time.perf_counter() - t
        steps = sum(r.client_steps for r in results)
        return new, UnlearnResult(
            check.current_params(new),
            steps,
            predicted,
            retrain,
            seconds,
            server_seconds=max(seconds - sum(r.seconds for r in results), 0.0),  # inits and absorbs
            details=check.unlearn_details(state, new, clients, plans),
        )

    def unlearn(self, clients: Sequence[int]) -> UnlearnResult:
        """:meth:`what_if` from the current state, which the result's state then replaces."""
        self.__dict__["_state"], result = self.what_if(self.state, clients)
        return result

    def fit_silently(self, state: PlanState) -> PlanState:
        """The fit from ``state`` without events or commits (what :meth:`audit` compares against)."""
        check = self.checked
        while (plan := check.next_stage(state)) is not None:
            result = self.run_plan(plan)
            state = check.absorb(state, plan, result)
            state = state._with({"total_client_steps": state.total_client_steps + result.client_steps})
        return state

    def audit(self, tolerance: float) -> dict[str, Any]:
        """Certify exact unlearning: :meth:`replay_state` (retraining without every unlearned client), then :meth:`audit_compare`."""
        if not self.exact:
            raise ConfigError(f"trainer.algorithm: {self.name} does not support audit (it is not exact)")
        state = self.state
        reference, steps = self.replay_state(state)
        return self.audit_compare(state, reference, tolerance, steps)

    def fit(self) -> dict[str, Tensor]:
        """Not a planner's: the trainer's loop (``fedshard_lightning.trainer.stage_loop``) runs the plans."""
        raise ContractError(f"{type(self).__name__} is a Planner: the trainer runs its loop (StageLoop.fit)")

    # -- cache ---------------------------------------------------------------------------------------
    def cache_files(self, cache: Any) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict[str, str]]:
        """Tensor fields as ``<field>.safetensors``, the rest as JSON under ``manifest["state"]``."""
        tensors, fields = {}, {}
        for name, value in self.state.items():
            if name in BASE_FIELDS:
                continue
            if is_tensor_map(value):
                tensors[f"{name}.safetensors"] = dict(value)
            else:
                fields[name] = thaw(value)
        return {"state": fields}, tensors, {}

    def restore_cache(self, cache: Any, manifest: dict[str, Any], device: torch.device) -> None:
        """The state from the files :meth:`cache_files` wrote (the loop's fields are set by the trainer)."""
        files, stored = manifest.get("files", {}), manifest.get("state", {})
        fields = {}
        for name in self.initial_state(self.theta0):
            if f"{name}.safetensors" in files:
                fields[name] = cache.tensors(f"{name}.safetensors", device=device, manifest=manifest)
            elif name in stored:
                fields[name] = stored[name]
            else:
                raise CacheError(f"{cache.root}: the cache holds no state field {name!r} of {self.name}")
        self.__dict__["_state"] = self.state._with(fields)


def check_planner(alg: Algorithm) -> None:
    """Refuse, before training, a planner that misses a method or defines one the loop derives."""
    cls = type(alg)
    missing = [
        m
        for m in PLANNER_REQUIRES
        if getattr(cls, "params_of" if m == "current_params" else m)
        is getattr(Planner, "params_of" if m == "current_params" else m)
    ]
    if missing:
        raise ContractError(
            f"trainer.algorithm: {cls.__name__} does not define {', '.join(m + '()' for m in missing)}; a Planner "
            f"defines {', '.join(m + '()' for m in PLANNER_REQUIRES)} (docs/extending.md)"
        )
    bypass = [m for m in PLANNER_FORBIDS if getattr(cls, m) is not getattr(Planner, m)]
    if bypass:
        raise ContractError(
            f"trainer.algorithm: {cls.__name__} defines {', '.join(m + '()' for m in bypass)}; a Planner leaves the "
            "loop, the costs and unlearning's bookkeeping to the trainer, which derives them from its plans"
        )
