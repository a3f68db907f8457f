"""Round policies: A2 (SPEC section 5), fixed rounds, the auto range protocol, early stopping."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.errors import ConfigError
from fedshard_lightning.sharding import (
    A2Rounds,
    AutoRounds,
    ConvergenceTracker,
    FixedRounds,
    RoundPolicy,
    a2_rounds,
)

# ---------------------------------------------------------------------- a2_rounds


def test_a2_examples() -> None:
    assert a2_rounds([0.0, 0.5, 1.0], 2, 8) == [8, 5, 2]
    assert a2_rounds([0.3, 0.3], 2, 8) == [8, 8]  # all equal -> T1
    assert a2_rounds([0.7], 4, 7) == [7]
    assert a2_rounds([], 2, 8) == []
    assert a2_rounds([0.0, 0.25, 1.0], 2, 8) == [8, 7, 2]  # 6.5 rounds half up
    assert a2_rounds([1.0, 0.0, 2.0], 3, 3) == [3, 3, 3]


@settings(max_examples=120, deadline=None)
@given(
    variances=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=30),
    t0=st.integers(1, 20),
    extra=st.integers(0, 20),
)
def test_a2_in_range_and_monotone(variances: list[float], t0: int, extra: int) -> None:
    t1 = t0 + extra
    rounds = a2_rounds(variances, t0, t1)
    assert len(rounds) == len(variances)
    assert all(t0 <= t <= t1 and type(t) is int for t in rounds)
    order = sorted(range(len(variances)), key=lambda i: variances[i])
    ordered = [rounds[i] for i in order]
    assert ordered == sorted(ordered, reverse=True)  # non-increasing in variance
    assert rounds[order[0]] == t1
    if max(variances) > min(variances):
        assert rounds[order[-1]] == t0


@pytest.mark.parametrize(
    ("t0", "t1", "field"),
    [(0, 5, "t0=0"), (-1, 5, "t0=-1"), (6, 5, "t1=5 must be >= t0=6"), (2, 0, "t1=0"), (2.5, 4, "t0=2.5")],
)
def test_a2_validates_range(t0, t1, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        a2_rounds([0.0], t0, t1)
    with pytest.raises(ConfigError, match=field):
        A2Rounds(t0=t0, t1=t1)


def test_a2_rejects_bad_variances() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        a2_rounds([0.1, -0.2], 2, 8)
    with pytest.raises(ValueError, match="finite"):
        a2_rounds([0.1, math.inf], 2, 8)


# ---------------------------------------------------------------------- policies


def test_fixed_rounds() -> None:
    policy = FixedRounds(rounds=4)
    assert policy.rounds(1, [[0.0], [0.0, 0.0]]) == [4, 4]
    assert not policy.calibrating(1)
    policy.observe(1, [4, 4])  # no-op
    assert repr(policy) == "FixedRounds(rounds=4)"
    assert FixedRounds().rounds(3, [[1.0]]) == [5]
    with pytest.raises(ConfigError, match="rounds=0"):
        FixedRounds(rounds=0)
    with pytest.raises(NotImplementedError):
        policy.make_tracker(2)


def test_a2_policy_uses_population_variance() -> None:
    policy = A2Rounds(t0=2, t1=8)
    children = [[0.0, 0.0], [1.0, -1.0], [0.5, -0.5], [0.3]]
    # population variances 0, 1, 0.25, 0 -> 8, 2, 6.5 -> 7, 8
    assert policy.rounds(2, children) == [8, 2, 7, 8]
    assert policy.rounds(1, [[0.0, 0.0], [0.0]]) == [8, 8]  # stage 1: leaves, all alpha 0
    assert np.var([1.0, -1.0]) == 1.0
    with pytest.raises(ValueError, match="at least one child"):
        policy.rounds(2, [[0.1], []])
    assert isinstance(policy, RoundPolicy)
    assert repr(policy) == "A2Rounds(t0=2, t1=8)"


def test_auto_rounds_protocol() -> None:
    policy = AutoRounds(tolerance=0.0, patience=1, max_rounds=10, calibration_stages=2)
    children = [[0.0, 0.1], [1.0, -1.0], [0.2, 0.2]]
    assert policy.calibrating(1) and policy.calibrating(2) and not policy.calibrating(3)
    assert policy.rounds(1, children) == [10, 10, 10]
    with pytest.raises(RuntimeError, match="observe"):
        policy.rounds(3, children)
    policy.observe(1, [4, 6])
    policy.observe(2, [7])
    policy.observe(3, [1, 10])  # not a calibration stage: ignored
    assert policy.observed_range == (4, 7)
    # variances 0.0025, 1, 0 -> nu ~ 0.0025, 1, 0 -> 7, 4, 7
    assert policy.rounds(3, children) == [7, 4, 7]
    tracker = policy.make_tracker(2)
    assert (tracker.tolerance, tracker.patience, tracker.max_rounds) == (0.0, 1, 10)


def test_auto_rounds_with_tracker_end_to_end() -> None:
    policy = AutoRounds(tolerance=1e-3, patience=2, max_rounds=30, calibration_stages=1)
    caps = policy.rounds(1, [[0.0], [0.0]])
    tracker = policy.make_tracker(2)
    losses = [[1 / (r + 1) if r < 5 else 1 / 6 for r in range(30)], [1 / (r + 1) for r in range(30)]]
    for r in range(max(caps)):
        if all(tracker.update([losses[0][r], losses[1][r]])):
            break
    assert tracker.rounds_used == [8, 30]  # group 0: best at round 6, stale in rounds 7 and 8
    policy.observe(1, tracker.rounds_used)
    assert policy.observed_range == (8, 30)
    assert policy.rounds(2, [[0.0, 1.0], [0.0, 0.0]]) == [8, 30]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tolerance": -0.1}, "tolerance=-0.1"),
        ({"tolerance": math.nan}, "tolerance=nan"),
        ({"patience": 0}, "patience=0"),
        ({"max_rounds": 0}, "max_rounds=0"),
        ({"calibration_stages": 0}, "calibration_stages=0"),
        ({"patience": 1.5}, "patience=1.5"),
    ],
)
def test_auto_rounds_validates_arguments(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        AutoRounds(**kwargs)


def test_auto_rounds_state_round_trip() -> None:
    policy = AutoRounds(max_rounds=9)
    policy.observe(1, [3, 5])
    policy.observe(2, [9])
    state = policy.state_dict()
    assert state == {"observed": [3, 5, 9]}
    fresh = AutoRounds(max_rounds=9)
    fresh.load_state_dict(state)
    assert fresh.observed_range == (3, 9)
    assert fresh.rounds(3, [[0.0], [1.0, -1.0]]) == policy.rounds(3, [[0.0], [1.0, -1.0]]) == [9, 3]
    with pytest.raises(ValueError, match="rounds_used"):
        fresh.load_state_dict({"observed": [10]})
    assert FixedRounds().state_dict() == {}
    FixedRounds().load_state_dict({})


def test_auto_rounds_rejects_bad_observations() -> None:
    policy = AutoRounds(max_rounds=5)
    with pytest.raises(ValueError, match="rounds_used"):
        policy.observe(1, [0])
    with pytest.raises(ValueError, match="rounds_used"):
        policy.observe(1, [6])
    policy.observe(1, [np.int64(3)])
    assert policy.observed_range == (3, 3)


# ---------------------------------------------------------------------- ConvergenceTracker


def test_tracker_constant_loss_stops_after_patience() -> None:
    tracker = ConvergenceTracker(2, tolerance=0.01, patience=2, max_rounds=100)
    assert tracker.update([1.0, 1.0]) == [False, False]
    assert tracker.update([1.0, 0.5]) == [False, False]
    assert tracker.update([0.995, 0.25]) == [True, False]  # 0.5% < 1% relative: stale twice
    assert tracker.update([float("nan"), 0.2]) == [True, False]  # stopped: loss ignored
    assert tracker.rounds_used == [3, 4]
    assert tracker.stopped == [True, False]
    assert not tracker.done


def test_tracker_max_rounds_and_errors() -> None:
    tracker = ConvergenceTracker(1, tolerance=0.0, patience=5, max_rounds=3)
    assert [tracker.update([3.0 - r])[0] for r in range(3)] == [False, False, True]
    assert tracker.done and tracker.rounds_used == [3]
    with pytest.raises(ValueError, match="expected 1 losses"):
        tracker.update([1.0, 2.0])
    active = ConvergenceTracker(1, tolerance=0.0, patience=1, max_rounds=3)
    with pytest.raises(ValueError, match="not finite"):
        active.update([math.inf])
    with pytest.raises(ConfigError, match="max_rounds=0"):
        ConvergenceTracker(1, 0.0, 1, 0)


def reference_rounds(losses: list[float], tolerance: float, patience: int, max_rounds: int) -> int:
    best, stale = math.inf, 0
    for r, loss in enumerate(losses[:max_rounds], start=1):
        if r == 1 or best - loss > tolerance * abs(best):
            best, stale = loss, 0
        else:
            stale += 1
        if stale >= patience or r == max_rounds:
            return r
    raise AssertionError("ran out of losses")


@settings(max_examples=60, deadline=None)
@given(
    curves=st.lists(st.lists(st.floats(0.01, 10), min_size=20, max_size=20), min_size=1, max_size=5),
    tolerance=st.floats(0, 0.2),
    patience=st.integers(1, 4),
    max_rounds=st.integers(1, 20),
)
def test_tracker_matches_reference(curves, tolerance: float, patience: int, max_rounds: int) -> None:
    tracker = ConvergenceTracker(len(curves), tolerance, patience, max_rounds)
    for r in range(max_rounds):
        flags = tracker.update([c[r] for c in curves])
        if all(flags):
            break
    assert tracker.done
    assert tracker.rounds_used == [reference_rounds(c, tolerance, patience, max_rounds) for c in curves]
    assert all(1 <= r <= max_rounds for r in tracker.rounds_used)
