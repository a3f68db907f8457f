"""The checks around every call of a planner's methods: a mistake stops where it is made.

The loop never calls ``next_stage``, ``absorb``, ``plan_unlearn`` or ``current_params`` directly;
it calls them through :class:`CheckedPlanner`, which

* watches the version counter of every tensor of the state it hands over: a method that writes
  one in place (``state.models["w"][2] = ...``, ``add_``, ``copy_``) stops when it returns, named;
* watches the planner's own attributes: state kept on ``self`` instead of in the returned state
  stops when the method returns (it would be lost at the next resume or what-if);
* checks what comes back: a :class:`~.plan_state.StagePlan` of integer stages, keys, clients and
  rounds whose initial rows match the groups and the model; a state with the same fields whose
  new values the cache can store; the model's parameters, shaped like ``theta0``.

Each check raises one :class:`~fedshard_lightning.errors.ContractError` line naming the class and
the method. The checks cost a walk over the state's tensors and attributes (microseconds),
nothing per round.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from fedshard_lightning.engine import Group, TrainResult
from fedshard_lightning.errors import ContractError
from fedshard_lightning.unlearning.base import Algorithm
from fedshard_lightning.unlearning.contract import check_params
from fedshard_lightning.unlearning.plan_state import BASE_FIELDS, PlanState, StagePlan, field_problem

__all__ = ["PLANNER_FORBIDS", "PLANNER_REQUIRES", "CheckedPlanner", "check_field_values", "check_plan"]

PLANNER_REQUIRES = ("next_stage", "absorb", "plan_unlearn", "current_params")
"""What a planner defines (``initial_state`` too when it keeps state besides the loop's)."""

PLANNER_FORBIDS = ("fit", "unlearn", "what_if", "predict_cost", "retrain_cost", "predict_latency", "audit")
"""What the loop derives for a planner; a planner that defines one would bypass the loop's bookkeeping."""

_MISSING = object()


def _version(t: Tensor) -> int | None:
    """The tensor's in-place write counter (None for an inference tensor, which has none and cannot be written)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _int(value: Any) -> bool:
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def check_plan(alg: Algorithm, plan: Any, where: str) -> StagePlan:
    """``plan`` if it is a well-formed :class:`StagePlan` for this run, else a one-line error."""
    if not isinstance(plan, StagePlan):
        raise ContractError(
            f"{where} must return StagePlan(stage, groups, init) objects, got {type(plan).__name__}"
        )
    if not _int(plan.stage) or plan.stage < 0:
        raise ContractError(
            f"{where}: StagePlan.stage must be an int >= 0 (it keys the randomness), got {plan.stage!r}"
        )
    groups = plan.groups
    if not isinstance(groups, (tuple, list)) or not groups or not all(isinstance(g, Group) for g in groups):
        raise ContractError(
            f"{where}: StagePlan.groups must be a non-empty tuple of Group(key, clients, rounds)"
        )
    k = alg.num_clients
    for g in groups:
        if not _int(g.key) or not _int(g.rounds) or g.rounds < 0:
            raise ContractError(
                f"{where}: {g!r}: key and rounds must be ints (rounds >= 0); the loop derives every cost from them"
            )
        if not isinstance(g.clients, tuple) or not all(_int(c) and 0 <= c < k for c in g.clients):
            raise ContractError(f"{where}: {g!r}: clients must be a tuple of client ids in 0..{k - 1}")
    if len({g.key for g in groups}) != len(groups):
        raise ContractError(
            f"{where}: two groups of one plan share a key (the key names a group's randomness)"
        )
    if not callable(plan.init):
        check_rows(alg, plan.init, len(groups), where)
    if plan.stop is not None and not callable(plan.stop):
        raise ContractError(f"{where}: StagePlan.stop must be a factory of a round hook, or None")
    return plan


def check_rows(alg: Algorithm, init: Any, rows: int, where: str) -> Mapping[str, Tensor]:
    """Initial models: the model's names, one row per group, each shaped like ``theta0``."""
    theta0 = alg.theta0
    if not isinstance(init, Mapping) or set(init) != set(theta0):
        raise ContractError(
            f"{where}: StagePlan.init must map every name of the model to stacked rows [groups, ...] "
            f"(e.g. stack_params([state.theta0] * len(groups)))"
        )
    for name, v in init.items():
        if not isinstance(v, Tensor) or tuple(v.shape) != (rows, *theta0[name].shape):
            got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ContractError(
                f"{where}: StagePlan.init[{name!r}] is {got}; {rows} group(s) need {(rows, *theta0[name].shape)}"
            )
    return init


def check_field_values(alg: Algorithm, fields: Mapping[str, Any], where: str) -> None:
    """Refuse a state value that the cache cannot store (a dict of tensors, JSON or None)."""
    stores_itself = getattr(alg, "stores_own_state", False)
    for name, value in fields.items():
        problem = field_problem(value, stores_itself)
        if problem is not None:
            raise ContractError(
                f"{where}: the state field {name!r} is a {type(value).__name__}, neither a dict of tensors nor JSON "
                f"({problem}); store lists, numbers, strings (str keys) or dicts of tensors"
            )


class CheckedPlanner:
    """A planner's methods, each called with the checks of the module docstring."""

    def __init__(self, alg: Algorithm) -> None:
        self.alg = alg
        self.name = type(alg).__name__

    def _call(self, method: str, state: PlanState, *args: Any) -> Any:
        where = f"trainer.algorithm: {self.name}.{method}()"
        if not isinstance(state, PlanState):
            raise ContractError(f"{where} was handed a {type(state).__name__}, not a PlanState")
        watched = [(n, t, _version(t)) for n, t in state.tensors()]
        attrs = dict(vars(self.alg))
        out = getattr(type(self.alg), _IMPL.get(method, method))(self.alg, state, *args)
        for name, t, version in watched:
            if _version(t) != version:
                raise ContractError(
                    f"{where} wrote the state's tensor {name} in place; the state is read-only (every what-if and "
                    "the cache share it): build new tensors (clone, torch.index_copy) and return state.replace(...)"
                )
        now = vars(self.alg)
        changed = sorted(k for k in {*attrs, *now} if attrs.get(k, _MISSING) is not now.get(k, _MISSING))
        if changed:
            raise ContractError(
                f"{where} set self.{changed[0]}; a planner keeps what it learns in the state: declare "
                f"{changed[0]!r} in initial_state and return state.replace({changed[0]}=...) from absorb"
            )
        return out

    def next_stage(self, state: PlanState) -> StagePlan | None:
        """The next fit plan, checked (None: the fit is complete)."""
        plan = self._call("next_stage", state)
        return (
            None
            if plan is None
            else check_plan(self.alg, plan, f"trainer.algorithm: {self.name}.next_stage()")
        )

    def plan_unlearn(self, state: PlanState, clients: Sequence[int]) -> list[StagePlan]:
        """The plans that remove ``clients``, checked."""
        plans = self._call("plan_unlearn", state, clients)
        where = f"trainer.algorithm: {self.name}.plan_unlearn()"
        if not isinstance(plans, (list, tuple)):
            raise ContractError(f"{where} must return a list of StagePlan, got {type(plans).__name__}")
        return [check_plan(self.alg, p, where) for p in plans]

    def plan_retrain(self, state: PlanState, clients: Sequence[int]) -> list[StagePlan]:
        """The plans of retraining from scratch without ``clients``, checked."""
        plans = self._call("plan_retrain", state, clients)
        return [check_plan(self.alg, p, f"trainer.algorithm: {self.name}.plan_retrain()") for p in plans]

    def unlearn_details(
        self, state: PlanState, new: PlanState, clients: Sequence[int], plans: Sequence[StagePlan]
    ) -> dict[str, Any]:
        """The request's details for its report, checked: a dict with str keys."""
        details = self._call("unlearn_details", state, new, clients, plans)
        if not isinstance(details, dict) or not all(isinstance(k, str) for k in details):
            raise ContractError(
                f"trainer.algorithm: {self.name}.unlearn_details() must return a dict with str keys, "
                f"got {type(details).__name__}"
            )
        return details

    def absorb(self, state: PlanState, plan: StagePlan, result: TrainResult) -> PlanState:
        """The state after ``plan`` ran, checked: same fields, the loop's untouched, new values storable."""
        new = self._call("absorb", state, plan, result)
        where = f"trainer.algorithm: {self.name}.absorb()"
        if not isinstance(new, PlanState):
            raise ContractError(
                f"{where} must return the new state (state.replace(...)), got {type(new).__name__}"
            )
        if set(new) != set(state):
            raise ContractError(
                f"{where} returned a state with other fields ({sorted(set(new) ^ set(state))}); "
                "return state.replace(...) with the fields of initial_state"
            )
        for f in BASE_FIELDS:
            if new[f] is not state[f]:
                raise ContractError(
                    f"{where} changed the loop's field {f}; return state.replace(...) of your own fields"
                )
        check_field_values(self.alg, {f: new[f] for f in new if new[f] is not state[f]}, where)
        return new

    def current_params(self, state: PlanState) -> dict[str, Tensor]:
        """The model of ``state``, checked against ``theta0``'s names and shapes."""
        params = self._call("current_params", state)
        return check_params(
            self.alg, dict(params) if isinstance(params, Mapping) else params, "current_params"
        )


_IMPL = {"current_params": "params_of"}
"""Methods stored under another name (a planner's ``current_params(state)`` is kept as ``params_of``)."""
