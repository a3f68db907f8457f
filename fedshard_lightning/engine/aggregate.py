"""FedAvg's weighted sums in an order fixed by each group alone (batch-invariant aggregation).

Exact unlearning compares a model retrained with only the affected shards against a replay of
every shard, so a group's average must not depend on which other groups, or how many clients,
shared its local-training chunk. A GEMV over a chunk's rows or an ``index_add_`` (atomic on CUDA)
sums in an order set by the chunk. Here a group's participants, in their keyed order, are cut into
blocks of ``BLOCK`` rows; each block is summed by a pairwise tree over ``BLOCK`` slots (missing
rows are zeros, and ``x + 0 == x`` exactly), and the block sums are added to the group's total in
block order. Only element-wise additions are used, so the result is the same bits on any chunking,
thread count or device kernel choice. ``tests/engine/test_aggregate.py`` checks it against a plain
Python loop of the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["BLOCK", "GroupSums", "mix_rows", "tree_sum"]

BLOCK = 64


def tree_sum(x: Tensor) -> Tensor:
    """Sum ``x`` [n, BLOCK, D] over dim 1 by adjacent pairs: ((x0 + x1) + (x2 + x3)) + ..."""
    while x.shape[1] > 1:
        x = x[:, 0::2] + x[:, 1::2]
    return x[:, 0]


class GroupSums:
    """Streams the weighted client models of one round into per-group sums.

    Args:
        like: A stacked state dict [G, ...] (names, shapes, dtype and device of the sums).
        participants: Participant count of every group this round (0 for inactive groups).
    """

    def __init__(self, like: dict[str, Tensor], participants: Sequence[int]) -> None:
        self.names = list(like)
        first = like[self.names[0]]
        self.shapes = [like[k].shape[1:] for k in self.names]
        self.sizes = [int(torch.Size(s).numel()) for s in self.shapes]
        self.acc = torch.zeros(len(participants), sum(self.sizes), dtype=first.dtype, device=first.device)
        self.count = [int(c) for c in participants]
        self.seen = [0] * len(participants)
        self._carry: tuple[Tensor, list[tuple[int, int, int]]] | None = None

    def add(self, params: dict[str, Tensor], weights: Tensor, owners: Sequence[int]) -> None:
        """Add the next rows of the round, in participant order.

        Args:
            params: Local models [m, ...] by name.
            weights: FedAvg weight of each row (sample count), [m].
            owners: Group of each row.
        """
        m = len(owners)
        flat = torch.cat([params[k].reshape(m, -1) for k in self.names], 1)
        flat = flat * weights.to(flat.dtype).unsqueeze(1)
        meta = []
        for g in owners:
            j = self.seen[g]
            self.seen[g] += 1
            meta.append((g, j // BLOCK, j % BLOCK))
        if self._carry is not None:
            rows, old = self._carry
            flat, meta = torch.cat([rows, flat]), old + meta
            self._carry = None
        # Blocks whose last row has arrived are summed now; an open block waits for the next chunk.
        last = meta[-1]
        full = min(BLOCK, self.count[last[0]] - last[1] * BLOCK)
        if last[2] + 1 < full:
            cut = len(meta)
            while cut > 0 and meta[cut - 1][:2] == last[:2]:
                cut -= 1
            self._carry = (flat[cut:].clone(), meta[cut:])
            flat, meta = flat[:cut], meta[:cut]
        if not meta:
            return
        blocks: dict[tuple[int, int], int] = {}
        pad = len(meta)  # index of the zero row
        index = []
        for i, (g, b, p) in enumerate(meta):
            k = blocks.setdefault((g, b), len(blocks))
            if k == len(index):
                index.append([pad] * BLOCK)
            index[k][p] = i
        src = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
        idx = torch.as_tensor(index, device=flat.device)
        sums = tree_sum(src[idx])
        # Each group's blocks are added in block order; one index_add_ per rank touches a group once.
        keys = list(blocks)
        rank: dict[int, int] = {}
        by_rank: list[tuple[list[int], list[int]]] = []
        for k, (g, _) in enumerate(keys):
            r = rank.get(g, 0)
            rank[g] = r + 1
            if r == len(by_rank):
                by_rank.append(([], []))
            by_rank[r][0].append(g)
            by_rank[r][1].append(k)
        for groups, rows in by_rank:
            g_t = torch.as_tensor(groups, device=flat.device)
            r_t = torch.as_tensor(rows, device=flat.device)
            self.acc.index_add_(0, g_t, sums.index_select(0, r_t))

    def totals(self) -> dict[str, Tensor]:
        """The per-group sums [G, ...] by name (every row must have been added)."""
        if self._carry is not None:
            raise RuntimeError("GroupSums.totals before every participant was added")
        out, lo = {}, 0
        for k, shape, n in zip(self.names, self.shapes, self.sizes):
            out[k] = self.acc[:, lo : lo + n].view(len(self.count), *shape)
            lo += n
        return out


def mix_rows(models: dict[str, Tensor], mixes: Sequence[Sequence[tuple[int, float]]]) -> dict[str, Tensor]:
    """Rows ``sum_j w_j * models[i_j]`` for each list of (row, weight) pairs, in list order.

    A shard's initial model (the weighted average of its children) must not depend on which other
    shards are computed with it (all of them in ``fit`` and ``audit``, only the affected ones in
    ``unlearn``); a matrix product over the rows would. Here each output row is accumulated
    element-wise, term by term.

    Args:
        models: Stacked models [N, ...] by name.
        mixes: For each output row, its (input row, weight) terms; weights are cast to the models' dtype.
    """
    n = len(mixes)
    depth = max((len(m) for m in mixes), default=0)
    out = {}
    for k, v in models.items():
        acc = v.new_zeros((n, *v.shape[1:]))
        for j in range(depth):
            sel = [i for i, m in enumerate(mixes) if len(m) > j]
            rows = torch.as_tensor([mixes[i][j][0] for i in sel], device=v.device)
            w = torch.as_tensor([mixes[i][j][1] for i in sel], dtype=torch.float64).to(v)
            term = v.index_select(0, rows) * w.view(-1, *([1] * (v.ndim - 1)))
            acc.index_add_(0, torch.as_tensor(sel, device=v.device), term)
        out[k] = acc
    return out
