"""Ranks: each rank's share of a stage's groups, and the rows gathered back in group order."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.engine.ranks import Ranks


def _gathered(world: int, num_groups: int, full: torch.Tensor) -> list[torch.Tensor]:
    """What every rank gets back, with an all_gather played out by hand over the ranks' inputs."""
    sent: dict[int, torch.Tensor] = {}

    def recording(rank: int):
        def gather(t: torch.Tensor) -> torch.Tensor:
            sent[rank] = t.clone()
            return torch.zeros(world, *t.shape, dtype=t.dtype)

        return gather

    shares = [Ranks(world, r, recording(r)).share(num_groups) for r in range(world)]
    for r in range(world):  # first pass: each rank's padded rows
        Ranks(world, r, recording(r)).gather_rows(full[shares[r]], num_groups)
    stacked = torch.stack([sent[r] for r in range(world)])
    return [Ranks(world, r, lambda t: stacked).gather_rows(full[shares[r]], num_groups) for r in range(world)]


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 5), num_groups=st.integers(1, 13))
def test_every_rank_gets_every_group_in_order(world, num_groups):
    full = torch.arange(num_groups * 3, dtype=torch.float64).view(num_groups, 3)
    shares = [Ranks(world, r, lambda t: t).share(num_groups) for r in range(world)]
    assert sorted(g for s in shares for g in s) == list(range(num_groups)), "each group on exactly one rank"
    for rows in _gathered(world, num_groups, full):
        assert torch.equal(rows, full)
