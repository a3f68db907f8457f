"""Shard tree: integer stage count, partition at every stage, paths, affected shards, serialization."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.errors import ConfigError, UnlearningRequestError
from fedshard_lightning.sharding import Shard, ShardTree, num_stages, random_grouping


def brute_force_stages(k: int, r: int) -> int:
    return next(p for p in range(200) if r**p >= k)


def random_groups(n: int, rate: int, rng: np.random.Generator) -> list[list[int]]:
    """A random valid grouping: ceil(n / rate) non-empty groups of at most `rate`, any sizes."""
    n_groups = -(-n // rate)
    sizes = [1] * n_groups
    for _ in range(n - n_groups):
        room = [g for g in range(n_groups) if sizes[g] < rate]
        sizes[int(rng.choice(room))] += 1
    perm = rng.permutation(n).tolist()
    groups, start = [], 0
    for size in sizes:
        groups.append(perm[start : start + size])
        start += size
    return groups


def build_tree(k: int, rate: int, seed: int) -> ShardTree:
    rng = np.random.default_rng(seed)
    tree = ShardTree(k, rate)
    while not tree.complete:
        tree.add_stage(random_groups(len(tree.stages[-1]), rate, rng))
    return tree


# ---------------------------------------------------------------------- num_stages


@settings(max_examples=200, deadline=None)
@given(k=st.integers(2, 10**7), r=st.integers(2, 12))
def test_num_stages_matches_brute_force(k: int, r: int) -> None:
    assert num_stages(k, r) == brute_force_stages(k, r)


@pytest.mark.parametrize(
    ("r", "p"),
    [(2, 1), (2, 10), (2, 29), (2, 62), (3, 20), (3, 40), (5, 3), (5, 13), (6, 3), (10, 18), (7, 30)],
)
def test_num_stages_exact_powers(r: int, p: int) -> None:
    # math.ceil(math.log(r**p, r)) is wrong for (2, 29), (2, 62), (5, 3), (5, 13), (6, 3).
    assert num_stages(r**p, r) == p
    assert num_stages(r**p + 1, r) == p + 1
    if r**p - 1 >= 2:
        assert num_stages(r**p - 1, r) == p


@pytest.mark.parametrize(
    ("k", "r", "field"), [(10, 1, "merge_rate=1"), (10, 0, "merge_rate=0"), (1, 2, "num_clients=1")]
)
def test_num_stages_rejects_bad_config(k: int, r: int, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        num_stages(k, r)
    with pytest.raises(ConfigError, match=field):
        ShardTree(k, r)


def test_config_error_message_is_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        num_stages(8, 1)
    assert str(info.value) == "merge_rate=1 must be an integer >= 2"


def test_num_stages_rejects_non_integers() -> None:
    with pytest.raises(ConfigError):
        num_stages(8, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        num_stages(8, True)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- structure (property tests)


@settings(max_examples=60, deadline=None)
@given(k=st.integers(2, 300), r=st.integers(2, 5), seed=st.integers(0, 2**32 - 1))
def test_tree_is_partition_at_every_stage_and_paths_are_unique(k: int, r: int, seed: int) -> None:
    tree = build_tree(k, r, seed)
    assert tree.complete
    assert tree.num_stages == tree.planned_stages == num_stages(k, r)
    assert tree.stages[0] == [Shard(0, c, (), (c,)) for c in range(k)]
    for p, stage in enumerate(tree.stages):
        clients = [c for shard in stage for c in shard.clients]
        assert sorted(clients) == list(range(k)), f"stage {p} is not a partition"
        assert len(set(clients)) == k
        for s, shard in enumerate(stage):
            assert (shard.stage, shard.index) == (p, s)
            assert list(shard.clients) == sorted(shard.clients)
            if p > 0:
                assert 1 <= len(shard.children) <= r
                below = sorted(c for child in shard.children for c in tree.shard(p - 1, child).clients)
                assert below == list(shard.clients)
        if p > 0:
            assert len(stage) == -(-len(tree.stages[p - 1]) // r)
            children = sorted(c for shard in stage for c in shard.children)
            assert children == list(range(len(tree.stages[p - 1])))
    # Every client has exactly one path, and each shard on it holds the client.
    for c in range(k):
        path = tree.path(c)
        assert [p for p, _ in path] == list(range(1, tree.num_stages + 1))
        for p, s in path:
            assert c in tree.shard(p, s).clients
        holders = [
            (p, s)
            for p in range(1, tree.num_stages + 1)
            for s, sh in enumerate(tree.stages[p])
            if c in sh.clients
        ]
        assert holders == path
    assert tree.path(0)[-1] == (tree.num_stages, 0)


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(2, 200),
    r=st.integers(2, 5),
    seed=st.integers(0, 10**6),
    data=st.data(),
)
def test_affected_is_union_of_paths(k: int, r: int, seed: int, data: st.DataObject) -> None:
    tree = build_tree(k, r, seed)
    leaving = data.draw(st.lists(st.integers(0, k - 1), max_size=10))
    affected = tree.affected(leaving)
    assert sorted(affected) == list(range(1, tree.num_stages + 1))
    for p in affected:
        expected = sorted({s for c in leaving for (q, s) in tree.path(c) if q == p})
        assert affected[p] == expected
        for s, shard in enumerate(tree.stages[p]):
            assert (s in affected[p]) == bool(set(shard.clients) & set(leaving))
            remaining = tree.remaining_clients(p, s, leaving)
            assert remaining == tuple(c for c in shard.clients if c not in set(leaving))
    if len(leaving) == 1:
        assert [(p, v[0]) for p, v in affected.items()] == tree.path(leaving[0])


@settings(max_examples=40, deadline=None)
@given(k=st.integers(2, 200), r=st.integers(2, 5), seed=st.integers(0, 10**6), partial=st.booleans())
def test_dict_round_trip_through_json(k: int, r: int, seed: int, partial: bool) -> None:
    tree = build_tree(k, r, seed)
    if partial and tree.num_stages > 1:
        d = tree.to_dict()
        d["stages"] = d["stages"][:1]
        tree = ShardTree.from_dict(d)
    d = tree.to_dict()
    again = ShardTree.from_dict(json.loads(json.dumps(d)))
    assert again == tree
    assert again.to_dict() == d
    assert again.stages == tree.stages


def test_random_grouping_builds_the_full_tree() -> None:
    tree = ShardTree(100, 4)
    stage = 0
    while not tree.complete:
        stage += 1
        tree.add_stage(random_grouping(len(tree.stages[-1]), 4, seed=stage))
    assert tree.num_stages == 4
    assert tree.shard(4, 0).clients == tuple(range(100))


# ---------------------------------------------------------------------- small examples


def sequential_tree(k: int = 8, r: int = 2) -> ShardTree:
    tree = ShardTree(k, r)
    while not tree.complete:
        n = len(tree.stages[-1])
        tree.add_stage([list(range(i, min(i + r, n))) for i in range(0, n, r)])
    return tree


def test_small_tree_paths_and_affected() -> None:
    tree = sequential_tree(8, 2)
    assert tree.num_stages == 3
    assert tree.path(5) == [(1, 2), (2, 1), (3, 0)]
    assert tree.affected([5]) == {1: [2], 2: [1], 3: [0]}
    assert tree.affected([0, 7, 7]) == {1: [0, 3], 2: [0, 1], 3: [0]}
    assert tree.affected([]) == {1: [], 2: [], 3: []}
    assert tree.remaining_clients(2, 1, [5, 0]) == (4, 6, 7)
    assert tree.remaining_clients(0, 5, [5]) == ()
    assert tree.shard(1, 2) == Shard(1, 2, (4, 5), (4, 5))


def test_children_keep_their_order_and_numpy_ints_are_accepted() -> None:
    tree = ShardTree(5, 3)
    shards = tree.add_stage([np.array([4, 0, 2]), [np.int64(3), 1]])
    assert shards[0].children == (4, 0, 2)
    assert shards[0].clients == (0, 2, 4)
    assert all(type(c) is int for s in shards for c in s.children)
    json.dumps(tree.to_dict())


def test_uneven_tree_sizes() -> None:
    tree = sequential_tree(10, 3)
    assert [len(s) for s in tree.stages] == [10, 4, 2, 1]
    assert [len(s.clients) for s in tree.stages[1]] == [3, 3, 3, 1]


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([[0], [1], [2, 3], [4, 5], [6]], "needs ceil"),  # too many groups
        ([[0, 1, 2], [3, 4], [5], [6]], "more than merge_rate"),
        ([[0, 1], [2, 3], [4, 5], [6], []], "empty"),
        ([[0, 1], [1, 2], [3, 4], [5, 6]], "more than one group"),
        ([[0, 1], [2, 3], [4, 9], [5, 6]], "not in range"),
        ([[0, 1], [2, 3], [4], [5]], "in no group"),  # 6 is missing, the count is right
        ([[0, 1], [2, 3], [4, "5"], [6]], "not in range"),
        ([[0, 1], [2, 3], [4, True], [5, 6]], "not in range"),
        ("abcd", "sequence of sequences"),
    ],
)
def test_add_stage_rejects_invalid_groupings(groups: list, message: str) -> None:
    tree = ShardTree(7, 2)
    with pytest.raises(ValueError, match=message):
        tree.add_stage(groups)
    assert tree.num_stages == 0  # nothing was added


def test_add_stage_refuses_a_complete_tree() -> None:
    tree = sequential_tree(4, 2)
    with pytest.raises(ValueError, match="complete"):
        tree.add_stage([[0]])


def test_queries_reject_unknown_shards_and_clients() -> None:
    tree = sequential_tree(4, 2)
    with pytest.raises(IndexError):
        tree.shard(3, 0)
    with pytest.raises(IndexError):
        tree.shard(1, 2)
    with pytest.raises(UnlearningRequestError):
        tree.path(4)
    with pytest.raises(ValueError, match="client -1"):
        tree.affected([-1])
    with pytest.raises(ValueError):
        tree.remaining_clients(1, 0, [10])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: [],
        lambda d: {**d, "extra": 1},
        lambda d: {k: v for k, v in d.items() if k != "stages"},
        lambda d: {**d, "version": 2},
        lambda d: {**d, "merge_rate": 1},
        lambda d: {**d, "num_clients": "8"},
        lambda d: {**d, "stages": "abc"},
        lambda d: {**d, "stages": [[0, 1]]},
        lambda d: {**d, "stages": [[[0, 1], [2, 3], [4, 5], [6, 6]]]},
        lambda d: {**d, "stages": [*d["stages"], [[0]]]},  # past the root
    ],
)
def test_from_dict_rejects_malformed_input(mutate) -> None:
    d = sequential_tree(8, 2).to_dict()
    with pytest.raises(ValueError, match="malformed shard tree"):
        ShardTree.from_dict(mutate(d))


def test_pretty() -> None:
    text = sequential_tree(8, 2).pretty()
    lines = text.splitlines()
    assert lines[1] == "stage 3 shard 0 (clients 0-7, 8 clients)"
    assert "  stage 2 shard 1 (clients 4-7, 4 clients)" in lines
    assert "    stage 1 shard 3 (clients 6-7, 2 clients)" in lines
    assert len(lines) == 1 + 1 + 2 + 4

    tree = ShardTree(12, 12)
    tree.add_stage([[0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11]])
    assert "clients 0-11, 12 clients" in tree.pretty()
    tree = ShardTree(24, 12)
    tree.add_stage([list(range(0, 24, 2)), list(range(1, 24, 2))])
    line = tree.pretty(max_clients_shown=3).splitlines()[1]
    assert line == "stage 1 shard 0 (clients 0, 2, 4, ..., 12 clients)"
    assert "stage 0: 5 leaf shards" in ShardTree(5, 2).pretty()


def test_equality() -> None:
    a, b = sequential_tree(8, 2), sequential_tree(8, 2)
    assert a == b
    assert a != sequential_tree(8, 3)
    c = ShardTree(8, 2)
    c.add_stage([[1, 0], [2, 3], [4, 5], [6, 7]])
    assert c != ShardTree(8, 2)
    assert a != "tree"
    assert ShardTree(8, 2) == ShardTree(8, 2)
    assert "ShardTree(num_clients=8" in repr(a)
