"""A planner's state and its stage plans: immutable values that methods read and the loop replaces.

:class:`PlanState` holds everything a :class:`~fedshard_lightning.unlearning.planner.Planner`
knows: the base fields that the loop owns (``theta0``, ``unlearned``, ``total_client_steps``) and
the fields that the method's ``initial_state`` declares. It is frozen all the way down: lists
become tuples and dicts read-only mappings, so ``state.x = ...`` or ``state.shards["w"] = ...``
fails where it is written; ``state.replace(x=...)`` gives a new state. A field the method did not
declare, or one of the loop's, cannot be replaced. Tensors cannot be frozen without a copy; the
loop checks their version counters around every planner call instead
(:mod:`~fedshard_lightning.unlearning.plan_contract`).

:class:`StagePlan` is what a planner asks the engine to do: one engine call over groups of
clients, each FedAvg from its row of the initial models for its number of rounds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from torch import Tensor

from fedshard_lightning.engine import FederatedEngine, Group, RoundInfo, TrainResult
from fedshard_lightning.errors import ContractError

__all__ = ["BASE_FIELDS", "PlanState", "StageMerge", "StagePlan", "freeze", "thaw"]

BASE_FIELDS = ("theta0", "unlearned", "total_client_steps")
"""The loop's fields: the initial model, who was unlearned, what the fit cost. Methods read them."""

StopRule = Callable[[], Callable[[RoundInfo, dict[str, Tensor]], Sequence[bool] | None]]
InitRows = Mapping[str, Tensor] | Callable[[Sequence[TrainResult]], Mapping[str, Tensor]]


@dataclass(frozen=True)
class StageMerge:
    """How a fit plan's groups merge the groups of the stage before (fired as ``on_stage_merge``).

    Attributes:
        groups: Per new group, the indices of the earlier groups it merges.
        alphas: The earlier groups' statistic the merge was chosen by (FedShard: signed alpha).
        rounds: The rounds given to each new group.
    """

    groups: Sequence[Sequence[int]]
    alphas: Sequence[float]
    rounds: Sequence[int]


@dataclass(frozen=True)
class StagePlan:
    """One engine call: ``groups`` train together, group i FedAvg from row i of ``init``.

    Attributes:
        stage: The stage number: part of every client's randomness key, so a plan that repeats a
            fit's stage and group keys without some clients replays that fit without them.
        groups: The groups (key, clients, rounds); their rounds are the plan's cost.
        init: Initial models stacked ``[len(groups), ...]``; or, in a sequence of unlearning plans,
            a function of the results of the plans before it in the sequence (a stage that starts
            from what the previous plan retrained).
        stop: A factory of a fresh round hook ``(info, models) -> one bool per group`` (True stops
            that group early); ``None`` trains every round. The rounds actually run are in the
            result's ``rounds_run``; the cost of a plan counts every planned round.
        engine: The engine that trains the plan, when it is not the method's own: one built at
            ``setup`` with another local schedule (``ctx.make_engine``), optimizer
            (``with_optimizer``) or participant policy (``with_participants``). Its schedule and
            participants also count the plan's cost.
        merge: For a fit plan that merges earlier groups: how (the loop fires ``on_stage_merge``).
        meta: What the method computed while planning and needs again in ``absorb`` (e.g. the
            grouping's tree); the loop passes it through untouched. Treat it as immutable.
        keep_client_params: Record each round's start model and its participants' models in the
            result's ``history`` (for an ``absorb`` that reads client updates, e.g. to keep them).
    """

    stage: int
    groups: tuple[Group, ...]
    init: InitRows
    stop: StopRule | None = None
    engine: FederatedEngine | None = None
    merge: StageMerge | None = None
    meta: Any = None
    keep_client_params: bool = False


def freeze(value: Any) -> Any:
    """A read-only copy of the containers (tensors are shared): lists to tuples, dicts to mappings.

    A tuple that holds only frozen values is returned as it is (immutable already), so a field
    handed back unchanged keeps its identity.
    """
    if isinstance(value, (list, tuple)):
        items = tuple(freeze(v) for v in value)
        same = type(value) is tuple and all(a is b for a, b in zip(items, value))
        return value if same else items
    if isinstance(value, (dict, MappingProxyType)):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    return value


def thaw(value: Any) -> Any:
    """The plain form of :func:`freeze`'s output (lists and dicts), e.g. for JSON."""
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    return value


def is_tensor_map(value: Any) -> bool:
    """A non-empty mapping of tensors (stored as safetensors)."""
    return isinstance(value, Mapping) and bool(value) and all(isinstance(v, Tensor) for v in value.values())


def field_problem(value: Any, stores_itself: bool = False) -> str | None:
    """Why a state field cannot be stored (None: a tensor mapping or JSON with str keys).

    ``stores_itself``: the planner writes its own cache files, so any value it can write is fine.
    """
    if stores_itself or value is None or is_tensor_map(value):
        return None
    plain = thaw(value)
    try:
        json.dumps(plain)
    except (TypeError, ValueError) as e:
        return str(e)
    stack = [plain]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            bad = [k for k in v if not isinstance(k, str)]
            if bad:
                return f"the key {bad[0]!r} would come back from the cache as {json.dumps(bad[0])!r}"
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


class PlanState(Mapping[str, Any]):
    """Immutable state of a planner: ``state["x"]`` or ``state.x``; :meth:`replace` for a new one."""

    __slots__ = ("_fields", "_walked")

    def __init__(self, fields: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_fields", {k: freeze(v) for k, v in fields.items()})
        object.__setattr__(self, "_walked", {})

    def __getitem__(self, name: str) -> Any:
        return self._fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_fields", "_walked"):  # copy and pickle probe before they exist
            raise AttributeError(name)
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(
                f"the state has no field {name!r}; its fields are {sorted(self._fields)} "
                "(declare a field in initial_state)"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise ContractError(
            f"state.{name} = ...: the state is immutable; return state.replace({name}=...) from absorb"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return PlanState, (thaw(self._fields),)

    def __repr__(self) -> str:
        return f"PlanState({sorted(self._fields)})"

    def replace(self, **changes: Any) -> PlanState:
        """A new state with ``changes``; only fields that ``initial_state`` declared can change."""
        for name in changes:
            if name in BASE_FIELDS:
                raise ContractError(
                    f"state.replace({name}=...): {name} is the loop's record (it counts costs and records "
                    "unlearned clients itself); a method changes only the fields of its initial_state"
                )
            if name not in self._fields:
                raise ContractError(
                    f"state.replace({name}=...): {name!r} is not a field of the state; declare it in "
                    f"initial_state (fields: {sorted(f for f in self._fields if f not in BASE_FIELDS)})"
                )
        return self._with(changes)

    def _with(self, changes: Mapping[str, Any]) -> PlanState:
        """:meth:`replace` without the checks: the loop's own updates of its base fields."""
        new = PlanState.__new__(PlanState)
        object.__setattr__(new, "_fields", {**self._fields, **{k: freeze(v) for k, v in changes.items()}})
        object.__setattr__(new, "_walked", dict(self._walked))  # each entry checked by identity
        return new

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every tensor of the state, named ``field`` or ``field.key`` (what version checks watch).

        A field's value is immutable, so its tensors are found once and kept for the states that
        share the field (a fold replaces one or two fields per step; FedShard's records are ~K).
        """
        for field, value in self._fields.items():
            hit = self._walked.get(field)
            if hit is None or hit[0] is not value:
                hit = self._walked[field] = (value, _tensors_in(field, value))
            yield from hit[1]


def _tensors_in(name: str, value: Any) -> list[tuple[str, Tensor]]:
    """The tensors inside ``value`` (frozen containers), named by their path."""
    out, stack = [], [(name, value)]
    while stack:
        name, v = stack.pop()
        if isinstance(v, Tensor):
            out.append((name, v))
        elif isinstance(v, Mapping):
            stack.extend((f"{name}.{k}", x) for k, x in v.items())
        elif isinstance(v, tuple):
            stack.extend((f"{name}[{i}]", x) for i, x in enumerate(v))
    return out
