"""FedShard's defaults are the paper's (Appendix D, SPEC section 5); our departures are named options.

Checked here: A1's seeded random stage 1, eq. 7's ``1 / |alpha_c|`` weights in
``allocateChildShard`` against a numpy formula, and the stage-shared A2 variant's rounds.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.errors import ConfigError
from fedshard_lightning.sharding import (
    A1Merge,
    AutoRounds,
    StageA2Rounds,
    StageCosts,
    a1_grouping,
    a2_rounds,
    eq7_weights,
    group_capacities,
    predicted_m_e,
    random_grouping,
)
from fedshard_lightning.unlearning import FedShard


def _costs(rng: np.random.Generator, n: int, weights: np.ndarray | None = None) -> StageCosts:
    owners = np.repeat(np.arange(n), rng.integers(1, 4, size=n))
    k = len(owners)
    clients = [np.flatnonzero(owners == j).tolist() for j in range(n)]
    steps = rng.integers(1, 30, size=k)
    return StageCosts(clients, steps, rng.uniform(0, 50, size=k), 3.0, 2.0 * steps, weights=weights)


def test_fedshard_defaults_are_the_paper() -> None:
    alg = FedShard()
    assert type(alg.round_policy) is AutoRounds
    merge = alg.merge_policy
    assert (merge.random_start, merge.refine, merge.weighting, merge.allocation) == (
        True,
        False,
        "alpha",
        "cost",
    )
    assert alg.variant == ""
    variant = FedShard(merge="a1_cost", rounds="stage_a2")
    assert (variant.merge_policy.random_start, variant.merge_policy.refine) == (False, True)
    assert variant.merge_policy.weighting == "uniform"
    assert type(variant.round_policy) is StageA2Rounds
    assert variant.variant == "merge: a1_cost, rounds: stage_a2"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"merge": "a1_spec"}, "algorithm.merge"),
        ({"rounds": "calibrated"}, "algorithm.rounds"),
        ({"max_rounds": 0}, "algorithm.max_rounds"),
        ({"patience": 0}, "algorithm.patience"),
        ({"tolerance": -1.0}, "algorithm.tolerance"),
    ],
)
def test_bad_options_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        FedShard(**kwargs)


# ---------------------------------------------------------------------- seeded random stage 1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 70), rate=st.integers(2, 6), seed=st.integers(0, 2**32 - 1))
def test_stage_one_is_the_seeded_random_grouping_even_with_costs(n: int, rate: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    costs = _costs(rng, n)
    counts = [len(c) for c in costs.shard_clients]
    got = A1Merge(n_init=1).group([0.0] * n, counts, rate, seed, costs=costs)
    assert got == random_grouping(n, rate, seed)
    perm = (
        np.random.default_rng(seed).permutation(n).tolist()
    )  # the reference: a permutation cut by capacities
    cuts = np.cumsum([0, *group_capacities(n, rate)])
    want = sorted((sorted(perm[a:b]) for a, b in itertools.pairwise(cuts)), key=lambda g: g[0])
    assert got == want
    # our variant fills stage 1 by the costs instead; still a partition with the capacities
    filled = A1Merge(n_init=1, random_start=False).group([0.0] * n, counts, rate, seed, costs=costs)
    assert sorted(i for g in filled for i in g) == list(range(n))
    assert sorted(len(g) for g in filled) == sorted(group_capacities(n, rate))


def test_stage_one_in_a_fit_is_the_seeded_random_grouping_of_its_merge_seed() -> None:
    alg = FedShard()
    alg.ctx = type("Ctx", (), {"seed": 5})()
    seed_one = alg._merge_seed(1)
    assert seed_one == (5 * 1_000_003 + 7919) % 2**32
    assert A1Merge().group([0.0] * 10, [1] * 10, 2, seed_one) == random_grouping(10, 2, seed_one)
    assert random_grouping(10, 2, seed_one) != random_grouping(10, 2, alg._merge_seed(2))


# ---------------------------------------------------------------------- eq. 7 weights


def test_eq7_weights_against_numpy() -> None:
    rng = np.random.default_rng(3)
    k = 20
    owner = rng.integers(0, 6, size=k)
    owner[:6] = np.arange(6)  # every shard has a client
    shards = [np.flatnonzero(owner == s).tolist() for s in range(6)]
    alphas = rng.normal(size=6)
    alphas[2] = 0.0  # floored at eps
    w = eq7_weights(shards, alphas, k)
    want = 1.0 / np.maximum(np.abs(alphas[owner]), 1e-6)
    np.testing.assert_array_equal(w, want)
    z = rng.uniform(0, 100, size=k)
    assert predicted_m_e(z, w) == pytest.approx(float(np.mean(want * (z.mean() - z) ** 2)), rel=1e-12)
    with pytest.raises(ValueError, match="one shard"):
        eq7_weights(shards[:-1], alphas[:-1], k)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(4, 40), rate=st.integers(2, 4), seed=st.integers(0, 2**32 - 1))
def test_a1_minimises_eq7_with_the_weights_it_is_given(n: int, rate: int, seed: int) -> None:
    """``weighting="alpha"`` keeps the costs' weights; ``uniform`` is A1 on the same costs without them."""
    rng = np.random.default_rng(seed)
    base = _costs(rng, n)
    weights = 1.0 / np.maximum(np.abs(rng.normal(size=len(base.client_steps))), 1e-6)
    costs = dataclasses.replace(base, weights=weights)
    alphas = rng.normal(size=n).tolist()
    counts = [len(c) for c in costs.shard_clients]
    paper = A1Merge(n_init=1).group(alphas, counts, rate, seed, costs=costs)
    assert paper == a1_grouping(alphas, counts, rate, seed, n_init=1, costs=costs)
    uniform = A1Merge(n_init=1, weighting="uniform").group(alphas, counts, rate, seed, costs=costs)
    assert uniform == a1_grouping(
        alphas, counts, rate, seed, n_init=1, costs=dataclasses.replace(costs, weights=None)
    )
    for groups in (paper, uniform):
        assert sorted(i for g in groups for i in g) == list(range(n))
        assert sorted(len(g) for g in groups) == sorted(group_capacities(n, rate))


def test_eq7_weights_change_the_grouping() -> None:
    """The weights are not ignored: on random inputs some groupings differ from uniform weights'."""
    rng = np.random.default_rng(17)
    differ = 0
    for case in range(20):
        n, rate = int(rng.integers(8, 40)), int(rng.integers(2, 4))
        base = _costs(rng, n)
        weights = 1.0 / np.maximum(np.abs(rng.normal(size=len(base.client_steps))), 1e-6)
        costs = dataclasses.replace(base, weights=weights)
        alphas = rng.normal(size=n).tolist()
        counts = [len(c) for c in costs.shard_clients]
        paper = A1Merge(n_init=2).group(alphas, counts, rate, case, costs=costs)
        differ += paper != A1Merge(n_init=2, weighting="uniform").group(
            alphas, counts, rate, case, costs=costs
        )
    assert differ > 0


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 30), rate=st.integers(2, 4), seed=st.integers(0, 2**32 - 1))
def test_allocate_child_shard_scores_eq7_like_numpy(n: int, rate: int, seed: int) -> None:
    """The last placement's score is eq. 7 of the complete grouping, ``mean_c w_c (Z_avg - Z_c)^2``,
    with every ``Z_c`` from a plain loop over the groups (no projection is left at that point)."""
    from fedshard_lightning.sharding.cost_filler import CostFiller

    rng = np.random.default_rng(seed)
    base = _costs(rng, n)
    w = 1.0 / np.maximum(np.abs(rng.normal(size=len(base.client_steps))), 1e-6)
    costs = dataclasses.replace(base, weights=w)
    caps = group_capacities(n, rate)
    order = rng.permutation(n).tolist()
    filler = CostFiller(caps, np.zeros(n), costs, seed)
    groups: list[list[int]] = [[] for _ in caps]
    slots = [g for g, cap in enumerate(caps) for _ in range(cap)]
    for shard, g in zip(order[:-1], slots[:-1]):
        filler.add(len(groups[g]), g, shard)
        groups[g].append(shard)
    last, g_last = order[-1], slots[-1]
    score = float(filler.scores(g_last, np.asarray([last]))[0])
    groups[g_last].append(last)
    s = costs.client_steps
    z = costs.paid + costs.future
    for g in groups:
        clients = [c for child in g for c in costs.shard_clients[child]]
        for c in clients:
            z[c] += costs.rounds * (sum(s[x] for x in clients) - s[c])
    want = float(np.mean(w * (z.mean() - z) ** 2))
    assert score == pytest.approx(want, rel=1e-9)


def test_fedshard_passes_eq7_weights_of_the_stage_one_shards() -> None:
    """From stage 2 on, A1's costs weigh every client by ``1 / |alpha|`` of its stage-1 shard."""
    from fedshard_lightning.unlearning.plan_state import PlanState
    from fedshard_lightning.unlearning.shard_state import ShardRecord

    alg = FedShard(rounds="fixed", fixed_rounds=2)
    alg.ctx = type("Ctx", (), {"seed": 0, "num_clients": 6})()
    alg._steps, alg._sizes = [3, 1, 4, 1, 5, 9], [1] * 6
    recs = [
        ShardRecord(children=(0, 1), clients=(0, 1), weight=2.0, alpha=0.5, rounds=2, remaining=(0, 1)),
        ShardRecord(children=(2, 3), clients=(2, 3), weight=2.0, alpha=-0.25, rounds=2, remaining=(2, 3)),
        ShardRecord(children=(4, 5), clients=(4, 5), weight=2.0, alpha=0.0, rounds=2, remaining=(4, 5)),
    ]
    costs = alg._stage_costs(PlanState({"records": [recs]}), alg.round_policy, 2)
    np.testing.assert_array_equal(costs.weights, [2.0, 2.0, 4.0, 4.0, 1e6, 1e6])
    np.testing.assert_array_equal(
        alg._stage_costs(PlanState({"records": []}), alg.round_policy, 1).weights, np.ones(6)
    )


# ---------------------------------------------------------------------- the stage-shared variant


def test_stage_a2_gives_every_shard_of_a_stage_the_mean_a2_rounds() -> None:
    policy = StageA2Rounds(tolerance=0.0, patience=1, max_rounds=10)
    assert policy.rounds(1, [[0.0, 0.0]] * 3) == [10, 10, 10]
    tracker = policy.make_tracker(3)
    # mean losses 1.0, 0.5, 0.5: no improvement in round 3 -> every shard stops after 3 rounds
    assert tracker.update([1.5, 1.0, 0.5]) == [False] * 3
    assert tracker.update([0.5, 0.5, 0.5]) == [False] * 3
    assert tracker.update([0.2, 0.5, 0.8]) == [True] * 3
    assert tracker.rounds_used == [3, 3, 3] and tracker.done
    policy.observe(1, tracker.rounds_used)
    policy.observe(2, [6, 6])
    children = [[0.0, 0.1], [0.5, -0.5], [0.2, 0.3, -0.1]]
    per_shard = a2_rounds([float(np.var(c)) for c in children], 3, 6)
    shared = int(np.floor(np.mean(per_shard) + 0.5))
    assert policy.rounds(3, children) == [shared] * 3
    assert policy.rounds(4, [[0.4, -0.4]]) == [6]  # one shard: T1
