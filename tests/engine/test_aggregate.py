"""Batch-invariant aggregation against a plain Python loop of the same rule (SPEC section 3)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.engine import aggregate
from fedshard_lightning.engine.aggregate import BLOCK, GroupSums


def _reference(rows: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Blocks of BLOCK rows in order; each block summed by adjacent pairs over BLOCK slots."""
    total = torch.zeros_like(rows[0])
    for lo in range(0, len(rows), BLOCK):
        level = [
            r * torch.tensor(w, dtype=r.dtype)
            for r, w in zip(rows[lo : lo + BLOCK], weights[lo : lo + BLOCK])
        ]
        level += [torch.zeros_like(rows[0])] * (BLOCK - len(level))
        while len(level) > 1:
            level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
        total = total + level[0]
    return total


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 150), min_size=1, max_size=4),
    chunk=st.integers(1, 200),
    seed=st.integers(0, 2**16),
    columns=st.sampled_from([None, 1, 3, 7]),
)
def test_group_sums_equal_reference_bitwise_for_any_chunking(sizes, chunk, seed, columns):
    """``columns``: chunks whose blocks close are summed that many columns at a time (None: never)."""
    saved = aggregate._COLUMN_BLOCKS, aggregate._COLUMNS
    aggregate._COLUMN_BLOCKS, aggregate._COLUMNS = (1 << 62, 16) if columns is None else (0, columns)
    try:
        _check_group_sums(sizes, chunk, seed)
    finally:
        aggregate._COLUMN_BLOCKS, aggregate._COLUMNS = saved


def _check_group_sums(sizes: list[int], chunk: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    d = 7
    rows = {g: [torch.randn(d, generator=gen) for _ in range(n)] for g, n in enumerate(sizes)}
    weights = {
        g: [float(torch.randint(1, 90, (1,), generator=gen)) for _ in range(n)] for g, n in enumerate(sizes)
    }
    order = [(g, j) for g, n in enumerate(sizes) for j in range(n)]
    sums = GroupSums({"w": torch.zeros(len(sizes), d)}, sizes)
    for lo in range(0, len(order), chunk):
        part = order[lo : lo + chunk]
        sums.add(
            {"w": torch.stack([rows[g][j] for g, j in part])},
            torch.tensor([weights[g][j] for g, j in part]),
            [g for g, _ in part],
        )
    got = sums.totals()["w"]
    for g, n in enumerate(sizes):
        want = _reference(rows[g], weights[g]) if n else torch.zeros(d)
        assert torch.equal(got[g], want), g


@pytest.mark.parametrize(
    ("one_pass", "columns"),
    [(0, None), (1 << 40, None), (0, 2), (0, 5)],
    ids=["weighted-into-flat", "concatenated", "by-2-columns", "by-5-columns"],
)
def test_several_tensors_sum_like_each_alone(monkeypatch, one_pass, columns):
    """Every way of flattening several tensors (by chunk size) gives each tensor's own reference bits."""
    monkeypatch.setattr(aggregate, "_ONE_PASS", one_pass)
    monkeypatch.setattr(aggregate, "_COLUMN_BLOCKS", 1 << 62 if columns is None else 0)
    monkeypatch.setattr(aggregate, "_COLUMNS", columns or 16)
    gen = torch.Generator().manual_seed(3)
    shapes = {"a": (5,), "b": (4, 3), "c": (2,)}
    sizes = [70, 3]
    like = {k: torch.zeros(len(sizes), *s) for k, s in shapes.items()}
    rows = [{k: torch.randn(sum(sizes), *s, generator=gen) for k, s in shapes.items()}]
    weights = torch.randint(1, 90, (sum(sizes),), generator=gen).double()
    owners = [0] * sizes[0] + [1] * sizes[1]
    for chunk in (33, 64, 73):  # blocks carried across chunks; closed in the chunk (by columns if asked)
        sums = GroupSums(like, sizes)
        for lo in range(0, len(owners), chunk):
            part = slice(lo, lo + chunk)
            sums.add({k: v[part] for k, v in rows[0].items()}, weights[part], owners[part])
        got = sums.totals()
        for k in shapes:
            for g, (lo, hi) in enumerate([(0, sizes[0]), (sizes[0], sum(sizes))]):
                want = _reference(list(rows[0][k][lo:hi]), weights[lo:hi].tolist())
                assert torch.equal(got[k][g], want), (chunk, k, g)
