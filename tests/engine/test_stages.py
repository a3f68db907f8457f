"""A sequence of engine calls planned together against one general-path call per job, bit for bit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lean_rounds import _engine, _general, _same

from fedshard_lightning.engine import Group, stack_params
from fedshard_lightning.engine.lean_rounds import lean_eligible
from fedshard_lightning.errors import NonFiniteLossError


def _stages(jobs):
    return [
        (2 * j + 1, [Group(g, tuple(c for c, s in enumerate(split) if s == g), rounds[g]) for g in range(3)])
        for j, (split, rounds) in enumerate(jobs)
    ]


def _init_of(base):
    def init_of(j, results):
        if not j:
            return {k: v.clone() for k, v in base.items()}
        return {k: v.flip(0) * 0.5 + v * 0.5 for k, v in results[-1].params.items()}  # a children's mix, say

    return init_of


@settings(max_examples=20, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(
            st.lists(st.integers(0, 2), min_size=10, max_size=10),
            st.lists(st.integers(0, 3), min_size=3, max_size=3),
        ),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 50),
    fraction=st.sampled_from([1.0, 0.5]),
)
def test_train_stages_equals_one_general_call_per_job(jobs, seed, fraction):
    """A replay-like sequence: job j starts from a mix of job j-1's results.

    Full participation takes the lean path with every batch planned up front; sampled participants
    take one ``train_groups`` call per job.
    """
    eng = _engine(seed=seed, batch=3, fraction=fraction)
    stages = _stages(jobs)
    assert all(lean_eligible(eng, g) for _, g in stages) == (fraction == 1.0)
    init_of = _init_of(stack_params([eng.module_params()] * 3))
    got = eng.train_stages(stages, init_of)
    assert not eng.local.plans._ahead  # every prepared plan was taken
    want: list = []
    for j, (stage, groups) in enumerate(stages):
        want.append(_general(eng, init_of(j, want), groups, stage=stage))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        _same(a, b)


def test_train_stages_reports_the_first_non_finite_loss_like_its_calls():
    """The records are made after the last job, yet the error is the one the first failing call raises."""
    stages = _stages([([0] * 5 + [1] * 5, [2, 2, 0]), ([1] * 10, [0, 3, 0])])
    eng = _engine(lr=1e30)
    init_of = _init_of(stack_params([eng.module_params()] * 3))
    with pytest.raises(NonFiniteLossError) as err:
        eng.train_stages(stages, init_of)
    eng.lean_rounds = False
    with pytest.raises(NonFiniteLossError) as want:
        eng.train_groups(init_of(0, []), stages[0][1], stage=stages[0][0])
    assert str(err.value) == str(want.value) and "stage 1" in str(want.value)


def test_train_stages_of_no_jobs_trains_nothing():
    eng = _engine()
    assert eng.train_stages([], lambda j, results: {}) == []
