"""The statistic form of the built-in round policies gives the rounds ``RoundPolicy.rounds`` gives."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.sharding import StageCosts, refine_by_swaps
from fedshard_lightning.sharding.round_rules import a2_rounds_array, round_rule
from fedshard_lightning.sharding.rounds import A2Rounds, AutoRounds, FixedRounds, a2_rounds

_variances = st.lists(
    st.one_of(st.floats(0.0, 10.0), st.sampled_from([0.0, 0.5, 1.0])), min_size=1, max_size=40
)


@settings(max_examples=200, deadline=None)
@given(variances=_variances, t0=st.integers(1, 6), span=st.integers(0, 10))
def test_a2_array_equals_a2_rounds(variances, t0, span):
    want = a2_rounds(variances, t0, t0 + span)
    got = a2_rounds_array(np.asarray(variances, dtype=np.float64), t0, t0 + span)
    assert got.tolist() == [float(r) for r in want]


def _policies():
    auto = AutoRounds(calibration_stages=1, max_rounds=12)
    auto.observe(1, [3, 9, 5])
    return [A2Rounds(2, 8), A2Rounds(3, 3), FixedRounds(4), auto]


@pytest.mark.parametrize("index", range(4))
def test_rule_gives_the_policy_rounds(index):
    policy = _policies()[index]
    stat, combine = round_rule(policy, 2)
    rng = np.random.default_rng(index)
    for _ in range(50):
        groups = [rng.normal(size=int(rng.integers(1, 5))).tolist() for _ in range(int(rng.integers(1, 9)))]
        want = policy.rounds(2, groups)
        got = combine(np.asarray([stat(g) for g in groups], dtype=np.float64))
        assert got.tolist() == [float(r) for r in want]


def test_subclasses_and_calibrating_stages_have_no_rule():
    class Mine(A2Rounds):
        def rounds(self, stage, children_alphas):
            return [1] * len(children_alphas)

    assert round_rule(Mine(), 2) is None
    assert round_rule(AutoRounds(calibration_stages=2), 1) is None


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(3, 40), seed=st.integers(0, 2**32 - 1), evals=st.integers(1, 500), index=st.integers(0, 3)
)
def test_swap_search_with_the_rule_equals_the_search_asking_the_policy(n, seed, evals, index):
    """Same accepted swaps, so the same grouping, whether the rounds come from the rule or ``rounds``."""
    policy = _policies()[index]
    rng = np.random.default_rng(seed)
    rate = int(rng.integers(2, 4))
    alphas = rng.normal(size=n)
    steps = rng.integers(1, 6, size=n).astype(float)
    costs = StageCosts([[c] for c in range(n)], steps, rng.uniform(0, 20, n), 5.0, rng.uniform(0, 20, n))
    costs.weights = rng.uniform(0.5, 2.0, size=n)
    costs.rounds_fn = lambda children: policy.rounds(2, children)
    labels = rng.integers(0, 2, size=n).tolist()
    order = rng.permutation(n).tolist()
    start = [order[i : i + rate] for i in range(0, n, rate)]
    plain = refine_by_swaps(start, labels, alphas, costs, seed, max_evals=evals)
    costs.rounds_rule = round_rule(policy, 2)
    assert refine_by_swaps(start, labels, alphas, costs, seed, max_evals=evals) == plain
