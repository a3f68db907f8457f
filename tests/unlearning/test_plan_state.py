"""PlanState is immutable all the way down except for tensors, which the loop watches instead."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from fedshard_lightning.errors import ContractError
from fedshard_lightning.unlearning.plan_state import PlanState


def _state() -> PlanState:
    return PlanState(
        {
            "theta0": {"w": torch.zeros(2)},
            "unlearned": [],
            "total_client_steps": 0,
            "log": [1],
            "m": {"w": torch.ones(2)},
        }
    )


def test_containers_are_frozen_and_replace_gives_a_new_state():
    state = _state()
    assert state.log == (1,) and state["m"]["w"].sum() == 2
    with pytest.raises(TypeError):
        state.m["w"] = torch.zeros(2)
    with pytest.raises(ContractError, match=r"state\.log = \.\.\.: the state is immutable"):
        state.log = (2,)
    new = state.replace(log=[1, 2])
    assert new.log == (1, 2) and state.log == (1,) and new.m is state.m  # unchanged fields are shared


def test_replace_refuses_the_loops_fields_and_undeclared_ones():
    with pytest.raises(ContractError, match="total_client_steps is the loop's record"):
        _state().replace(total_client_steps=3)
    with pytest.raises(ContractError, match="'extra' is not a field of the state"):
        _state().replace(extra=1)


def test_tensors_are_listed_for_the_version_check_and_the_state_copies_and_pickles():
    state = _state()
    assert sorted(name for name, _ in state.tensors()) == ["m.w", "theta0.w"]
    for other in (copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
        assert other.log == (1,) and torch.equal(other.m["w"], state.m["w"])
