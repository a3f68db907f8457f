"""The lean path's FedAvg sums: :func:`.aggregate.reduce_rows` in place, with every view made once.

:func:`.aggregate.reduce_rows` sums a round's weighted rows by a pairwise tree per block, which it
builds from slices, additions and concatenations: about five operators per tree level, remade
every round. In a segment of the lean path the rows live in one buffer and the block plan is
fixed, so :class:`InPlaceSums` makes the tree's views once and a level is one in-place addition:
level ``k`` adds the odd rows of the view ``rows[::2**k]`` into its even rows, and an odd last
row, which ``reduce_rows`` carries by concatenation, is already where the next level reads it.
Every element sees the same additions of the same operands in the same order, so the sums are
``reduce_rows``' bits (``tests/engine/test_lean_sums.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedshard_lightning.engine.aggregate import BlockPlan

__all__ = ["InPlaceSums"]


class InPlaceSums:
    """``reduce_rows(x, plan, target)`` for a fixed row buffer ``x`` [rows, D] and block plan.

    Args:
        x: The buffer the weighted rows are written to before every :meth:`reduce` (overwritten
            by it when the plan needs no row picks).
        plan: A block plan (:func:`.aggregate.block_plan`) of ``x``'s rows.
    """

    def __init__(self, x: Tensor, plan: BlockPlan) -> None:
        n_keys, plans, scatter = plan
        d = x.shape[1]
        self.x = x
        self.picks: list[tuple[Tensor, Tensor]] = []  # (rows, buffer): copied out of x first
        self.levels: list[tuple[Tensor, Tensor]] = []  # (even rows, odd rows) of each tree level
        self.results: list[tuple[Tensor | None, Tensor]] = []  # (block ids, block sums view)
        for n, blocks_t, n_blocks, pick in plans:
            if pick is None:
                rows = x
            else:
                rows = x.new_empty((n_blocks * n, d))
                self.picks.append((pick, rows))
            v = rows.view(n_blocks, n, d)
            while v.shape[1] > 1:
                pairs = v.shape[1] // 2
                self.levels.append((v[:, 0 : 2 * pairs : 2], v[:, 1 : 2 * pairs : 2]))
                v = v[:, ::2]
            self.results.append((blocks_t, v[:, 0]))
        self.sums = None if len(plans) == 1 and plans[0][3] is None else x.new_empty((n_keys, d))
        self.scatter = scatter

    def reduce(self, target: Tensor) -> None:
        """Add the block sums of the rows now in ``x`` to ``target`` [groups, D], as ``reduce_rows``."""
        for pick, rows in self.picks:  # every pick reads x before any level writes
            torch.index_select(self.x, 0, pick, out=rows)
        for even, odd in self.levels:
            even.add_(odd)
        sums = self.sums
        for blocks_t, result in self.results:
            if sums is None:
                sums = result
            else:
                sums.index_copy_(0, blocks_t, result)
        for g_t, pick_k in self.scatter:
            target.index_add_(0, g_t, sums if pick_k is None else sums.index_select(0, pick_k))
