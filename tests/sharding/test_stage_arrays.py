"""The tree's per-stage arrays: the cache's fast rebuild and the vectorized weights and remaining clients."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.sharding import ShardTree
from fedshard_lightning.sharding.stage_arrays import grouping_error


def random_tree(k: int, rate: int, seed: int) -> ShardTree:
    rng = np.random.default_rng(seed)
    tree = ShardTree(k, rate)
    while not tree.complete:
        n = tree.stage_arrays(tree.num_stages).size
        perm = rng.permutation(n).tolist()
        cuts = (
            sorted(rng.choice(np.arange(1, n), size=-(-n // rate) - 1, replace=False).tolist())
            if n > 1
            else []
        )
        groups = [perm[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
        if max(map(len, groups)) > rate:  # rejected by add_stage: use contiguous groups of `rate`
            groups = [perm[i : i + rate] for i in range(0, n, rate)]
        tree.add_stage(groups)
    return tree


def as_arrays(tree: ShardTree) -> list[tuple[np.ndarray, np.ndarray]]:
    """Children and offsets per stage from the JSON form (not from the tree's own arrays)."""
    out = []
    for stage in tree.to_dict()["stages"]:
        offsets = np.cumsum([0, *map(len, stage)])
        out.append((np.array([c for g in stage for c in g], dtype=np.int64), offsets))
    return out


@settings(max_examples=40, deadline=None)
@given(k=st.integers(2, 300), r=st.integers(2, 5), seed=st.integers(0, 10**6), cut=st.integers(0, 9))
def test_from_arrays_equals_from_dict_and_clients_are_unions_of_children(k, r, seed, cut) -> None:
    tree = random_tree(k, r, seed)
    d = tree.to_dict()
    d["stages"] = d["stages"][: max(1, len(d["stages"]) - cut)]  # partial trees too
    ref = ShardTree.from_dict(d)
    got = ShardTree.from_arrays(k, r, as_arrays(ref))
    assert got == ref
    assert got.stages == ref.stages
    # Clients of a shard = union of its children's, built by hand from the JSON lists.
    below = [[c] for c in range(k)]
    for p, stage in enumerate(d["stages"], start=1):
        below = [sorted(c for ch in group for c in below[ch]) for group in stage]
        a = got.stage_arrays(p)
        assert [
            a.clients[a.client_starts[s] : a.client_starts[s + 1]].tolist() for s in range(a.size)
        ] == below
        assert [got.shard(p, s).clients for s in range(a.size)] == [tuple(b) for b in below]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(2, 30), r=st.integers(2, 4), data=st.data())
def test_grouping_error_accepts_exactly_what_add_stage_accepts(n, r, data) -> None:
    groups = data.draw(st.lists(st.lists(st.integers(-2, n + 1), max_size=r + 1), max_size=n // r + 3))
    tree = ShardTree(n, r)
    try:
        tree.add_stage(groups)
        ok = True
    except ValueError:
        ok = False
    flat = np.array([c for g in groups for c in g], dtype=np.int64)
    offsets = np.cumsum([0, *map(len, groups)]).astype(np.int64)
    assert (grouping_error(flat, offsets, n, r) is None) == ok


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ([([0, 1, 2, 3], [0, 2, 4])], "needs ceil"),
        ([([0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 4, 4, 8])], "empty"),
        ([([0, 1, 2, 3, 4, 5, 6, 7], [0, 3, 4, 6, 8])], "more than merge_rate"),
        ([([0, 1, 2, 3, 4, 5, 6, 9], [0, 2, 4, 6, 8])], "not in range"),
        ([([0, 1, 1, 3, 4, 5, 6, 7], [0, 2, 4, 6, 8])], "more than one group"),
        ([([0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 4, 6, 9])], "offsets"),
        ([([0.0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 4, 6, 8])], "non-integer"),
        ([([[0, 1, 2, 3, 4, 5, 6, 7]], [0, 2, 4, 6, 8])], "1-d"),
        (
            [
                ([0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 4, 6, 8]),
                ([0, 1, 2, 3], [0, 2, 4]),
                ([0, 1], [0, 2]),
                ([0], [0, 1]),
            ],
            "after the root",
        ),
    ],
)
def test_from_arrays_rejects_malformed_arrays(arrays, message) -> None:
    with pytest.raises(ValueError, match=f"malformed shard tree.*{message}"):
        ShardTree.from_arrays(8, 2, [(np.array(c), np.array(o)) for c, o in arrays])


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(2, 120),
    r=st.integers(2, 4),
    seed=st.integers(0, 10**6),
    weighting=st.sampled_from(["clients", "samples"]),
    data=st.data(),
)
def test_live_shards_match_plain_sums(k, r, seed, weighting, data) -> None:
    tree = random_tree(k, r, seed)
    sizes = data.draw(st.lists(st.integers(1, 10**6), min_size=k, max_size=k))
    gone = set(data.draw(st.lists(st.integers(0, k - 1), max_size=k)))
    weights = np.ones(k) if weighting == "clients" else np.asarray(sizes, dtype=np.float64)
    live = tree.live_shards(weights, gone)
    prev: list[float] = []
    for p in range(1, tree.num_stages + 1):
        weights, hit = live[p - 1]
        want = []
        for s, sh in enumerate(tree.stages[p]):
            remaining = tuple(c for c in sh.clients if c not in gone)
            if p == 1:
                want.append(float(sum(1.0 if weighting == "clients" else float(sizes[c]) for c in remaining)))
            else:
                want.append(float(sum(prev[ch] for ch in sh.children)))
            assert hit.get(s, sh.clients) == remaining
            assert (s in hit) == (remaining != sh.clients)
        assert weights == want  # bit for bit
        prev = want
