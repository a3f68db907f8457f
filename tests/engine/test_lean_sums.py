"""The lean path's in-place sums against a plain loop of the aggregation rule, and reduce_rows' bits."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.engine.aggregate import BLOCK, block_plan, reduce_rows, row_meta
from fedshard_lightning.engine.lean_sums import InPlaceSums


def _loop(rows: list[torch.Tensor]) -> torch.Tensor:
    """One group's rows in order, blocks of BLOCK summed by adjacent pairs over BLOCK zero-padded slots."""
    total = torch.zeros_like(rows[0])
    for lo in range(0, len(rows), BLOCK):
        level = list(rows[lo : lo + BLOCK]) + [torch.zeros_like(rows[0])] * (
            BLOCK - len(rows[lo : lo + BLOCK])
        )
        while len(level) > 1:
            level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
        total = total + level[0]
    return total


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 140), min_size=1, max_size=4),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    d=st.integers(1, 9),
)
def test_in_place_sums_equal_the_loop_and_reduce_rows_bits(sizes, shuffle, seed, dtype, d):
    """Any group sizes (one or many blocks, odd lengths); rows in group order (the engine's) or interleaved.

    Interleaved rows make blocks of runs, not the rule's blocks: there only reduce_rows' bits are checked.
    """
    gen = torch.Generator().manual_seed(seed)
    owners = [g for g, n in enumerate(sizes) for _ in range(n)]
    if shuffle:
        owners = [owners[i] for i in torch.randperm(len(owners), generator=gen).tolist()]
    if not owners:
        return
    x = torch.randn(len(owners), d, generator=gen, dtype=dtype)
    x[torch.rand(x.shape, generator=gen) < 0.1] = 0.0
    x[torch.rand(x.shape, generator=gen) < 0.1] = -0.0  # signed zeros keep their bits too
    meta = row_meta(owners, [0] * len(sizes))
    plan = block_plan(meta, x.device)

    want = torch.zeros(len(sizes), d, dtype=dtype)
    reduce_rows(x.clone(), plan, want)
    buf = torch.empty_like(x)
    lean = InPlaceSums(buf, plan)
    for _ in range(2):  # the views are made once and serve every round
        buf.copy_(x)
        got = torch.zeros(len(sizes), d, dtype=dtype)
        lean.reduce(got)
        assert torch.equal(_bits(got), _bits(want))
    if shuffle:
        return
    for g in range(len(sizes)):
        rows = [x[i] for i, o in enumerate(owners) if o == g]
        if rows:
            assert torch.equal(got[g], _loop(rows)), g
        else:
            assert not got[g].any()
