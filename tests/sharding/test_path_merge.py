"""``merge: a1_path``: A1 that balances every client's whole path cost, calibration stages included.

Checked against a hand computation on a four-client tree and against a numpy reference of the
predicted path costs (``StageCosts.predicted`` is the reference the costs module is tested with):
the refinement only accepts swaps that lower the predicted M_e, and it stops at a grouping that no
swap of same-cluster children improves.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.experiments.budget import match_budget
from fedshard_lightning.init_args import init_args
from fedshard_lightning.sharding import (
    A1Merge,
    StageCosts,
    a1_grouping,
    expected_future_costs,
    group_capacities,
    predicted_m_e,
    tree_client_costs,
)
from fedshard_lightning.sharding.merging import _three_clusters, with_shared_rounds
from fedshard_lightning.unlearning import FedShard

PATH = FedShard(merge="a1_path", rounds="stage_a2").merge_policy


def _m_e(costs: StageCosts, groups: list[list[int]]) -> float:
    """Uniform-weight M_e of the predicted path costs, every new shard at the expected rounds."""
    return predicted_m_e(costs.predicted(groups, [costs.rounds] * len(groups)))


def test_a1_path_is_a1_cost_refined_in_every_stage() -> None:
    assert (PATH.random_start, PATH.refine, PATH.weighting, PATH.shared_rounds) == (
        False,
        True,
        "uniform",
        True,
    )
    assert FedShard(merge="a1_path", rounds="stage_a2").variant == "merge: a1_path, rounds: stage_a2"
    assert not FedShard(merge="a1_cost").merge_policy.shared_rounds


def test_four_clients_by_hand() -> None:
    """Steps [1, 1, 5, 5], one round a stage, two stages.

    The top stage costs client c ``S - s_c`` = [11, 11, 7, 7]. Pairing the equal clients, stage 1
    costs each its partner's steps, [1, 1, 5, 5], and every client's path costs 12: no spread.
    Pairing a small with a large client costs [5, 5, 1, 1] below and [16, 16, 8, 8] in all, the
    variance of FedAvg retraining at the same budget (2 rounds: ``Z_c = 2 (S - s_c)``
    = [22, 22, 14, 14]), which any balanced grouping ties.
    """
    steps = np.array([1.0, 1.0, 5.0, 5.0])
    future = expected_future_costs(steps, [1], [1.0])
    np.testing.assert_array_equal(future, [11.0, 11.0, 7.0, 7.0])
    costs = StageCosts([[0], [1], [2], [3]], steps, np.zeros(4), 1.0, future)
    groups = PATH.group([0.0] * 4, [1] * 4, 2, 0, costs=costs)
    assert groups == [[0, 1], [2, 3]]
    tree = [[([0, 1], 1), ([2, 3], 1)], [([0, 1, 2, 3], 1)]]
    np.testing.assert_array_equal(tree_client_costs(tree, steps), [12.0, 12.0, 12.0, 12.0])
    crossed = tree_client_costs([[([0, 2], 1), ([1, 3], 1)], [([0, 1, 2, 3], 1)]], steps)
    np.testing.assert_array_equal(crossed, [16.0, 16.0, 8.0, 8.0])
    fedavg = 2.0 * (steps.sum() - steps)
    assert np.var(crossed) == np.var(fedavg) == 16.0
    # a1_cost skips the refinement here (the rounds of a calibrating stage are not known)
    greedy = A1Merge(random_start=False, weighting="uniform").group([0.0] * 4, [1] * 4, 2, 0, costs=costs)
    assert _m_e(costs, greedy) >= _m_e(costs, groups) == 0.0


def test_shared_rounds_give_every_shard_the_expected_rounds() -> None:
    costs = StageCosts([[0], [1], [2]], [1, 2, 3], np.zeros(3), 7.0, np.zeros(3))
    shared = with_shared_rounds(costs)
    assert shared.rounds_fn([[0.1, 0.2], [0.3]]) == [7.0, 7.0]
    stat, rule = shared.rounds_rule
    assert stat([0.1, 0.5]) == 0.0
    np.testing.assert_array_equal(rule(np.zeros(3)), [7.0, 7.0, 7.0])
    known = dataclasses.replace(costs, rounds_fn=lambda ca: [3] * len(ca))
    # where the policy says its rounds, a1_path uses them (refined as a1_cost is)
    g1 = PATH.group([0.0] * 3, [1] * 3, 2, 0, costs=known)
    g2 = A1Merge(random_start=False, refine=True, weighting="uniform").group(
        [0.0] * 3, [1] * 3, 2, 0, costs=known
    )
    assert g1 == g2


def test_the_calibration_cap_matches_the_budget() -> None:
    steps = [2] * 10  # S = 20; K = 10 at R = 2 has P = 4 stages (10, 5, 3, 2, 1 shards)
    capped, how = match_budget(FedShard(merge="a1_path", rounds="stage_a2"), 430, steps)
    assert capped.round_policy.max_rounds == 430 // (4 * 20) == 5
    assert how["rounds"] == 5 and "floor(C / (P S))" in how["rule"]
    # a run reopened from its recorded settings calibrates with the cap it trained with
    assert init_args(capped)["init_args"]["max_rounds"] == 5
    template = FedShard(merge="a1_path", rounds="stage_a2")
    match_budget(template, 430, steps)
    assert template.round_policy.max_rounds == 30 == init_args(template)["init_args"]["max_rounds"]
    fixed, how = match_budget(FedShard(rounds="fixed"), 430, steps)
    assert how["rounds"] is None and fixed.round_policy.rounds_per_shard == 5


_steps = st.lists(st.integers(1, 40), min_size=4, max_size=18)


@settings(max_examples=60, deadline=None)
@given(steps=_steps, rate=st.integers(2, 3), equal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_a1_path_never_predicts_worse_than_the_greedy_fill(steps, rate, equal, seed) -> None:
    """On random client sizes, a random earlier stage and random alphas: a partition with A1's
    capacities and cluster mix, whose predicted path-cost M_e is at most the greedy fill's, and
    that no swap of two same-cluster children in different groups lowers (a local optimum)."""
    rng = np.random.default_rng(seed)
    k = len(steps)
    s = np.asarray(steps, dtype=np.float64)
    n = max(2, k // 2)
    owner = np.concatenate([np.arange(n), rng.integers(0, n, size=k - n)])
    children = [np.flatnonzero(owner == j).tolist() for j in range(n)]
    paid = tree_client_costs([[(c, int(rng.integers(1, 5))) for c in children]], s)
    later = expected_future_costs(s, [1], [3.0])
    costs = StageCosts(children, s, paid, 3.0, later)
    alphas = [0.0] * n if equal else rng.normal(size=n).round(3).tolist()
    counts = [len(c) for c in children]
    path = PATH.group(alphas, counts, rate, seed, costs=costs)
    assert sorted(i for g in path for i in g) == list(range(n))
    assert sorted(len(g) for g in path) == sorted(group_capacities(n, rate))
    greedy = a1_grouping(alphas, counts, rate, seed, costs=costs, random_start=False)
    best = _m_e(costs, path)
    assert best <= _m_e(costs, greedy) * (1 + 1e-9) + 1e-9
    a = np.asarray(alphas)
    if np.all(a == a[0]):
        label = [1] * n
    else:
        label = [0] * n
        for lab, cluster in enumerate(_three_clusters(a, seed, 10)):
            for i in cluster:
                label[i] = lab
    for gi, gj in itertools.combinations(range(len(path)), 2):
        for i, j in itertools.product(path[gi], path[gj]):
            if label[i] != label[j]:
                continue
            swapped = [list(g) for g in path]
            swapped[gi][swapped[gi].index(i)], swapped[gj][swapped[gj].index(j)] = j, i
            assert _m_e(costs, swapped) >= best * (1 - 1e-9) - 1e-9
