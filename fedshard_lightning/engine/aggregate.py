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

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "BlockPlan",
    "GroupSums",
    "SumLayout",
    "block_plan",
    "cached_block_plan",
    "reduce_rows",
    "row_meta",
    "tree_sum",
]

BLOCK = 64
# Elements of a chunk's models above which they are weighted tensor by tensor into the flat matrix
# rather than concatenated and then weighted (the same products, so the same bits).
_ONE_PASS = 1 << 16
# On the CPU, a chunk of at least this many elements whose blocks all close in it is weighted and
# summed _COLUMNS columns at a time (cache-sized), not as whole matrices: every element sees the
# same operations in the same order, so the same bits, with one pass over memory instead of four
# (FedAvg CNN, 64 clients, 1 thread: 344 -> 94 ms per round).
_COLUMN_BLOCKS = 1 << 20
_COLUMNS = 16384


def tree_sum(x: Tensor) -> Tensor:
    """Sum ``x`` [n, BLOCK, D] over dim 1 by adjacent pairs: ((x0 + x1) + (x2 + x3)) + ..."""
    while x.shape[1] > 1:
        x = x[:, 0::2] + x[:, 1::2]
    return x[:, 0]


def row_meta(owners: Sequence[int], seen: list[int]) -> list[tuple[int, int, int]]:
    """(group, block, slot) of each row, continuing the per-group counts ``seen`` (updated in place)."""
    meta = []
    for g in owners:
        j = seen[g]
        seen[g] += 1
        meta.append((g, j // BLOCK, j % BLOCK))
    return meta


@dataclass(frozen=True)
class SumLayout:
    """How :class:`GroupSums` lays a state dict out: names by dtype, shapes and sizes.

    A function of the names, shapes and dtypes alone, so an engine call makes it once for all its
    rounds (it was a dozen dict and shape operations per round).
    """

    kinds: list[list[str]]  # names of each dtype, in the state's order
    shapes: dict[str, torch.Size]  # per-row shape
    numel: dict[str, int]  # per-row elements

    @classmethod
    def of(cls, like: dict[str, Tensor]) -> SumLayout:
        """The layout of a stacked state dict ``like`` [G, ...]."""
        kinds: dict[torch.dtype, list[str]] = {}
        for k, v in like.items():
            kinds.setdefault(v.dtype, []).append(k)
        return cls(
            list(kinds.values()),
            {k: v.shape[1:] for k, v in like.items()},
            {k: math.prod(v.shape[1:]) for k, v in like.items()},
        )


class GroupSums:
    """Streams the weighted client models of one round into per-group sums.

    All tensors of one dtype are summed as one flat [rows, D] matrix (the adds are element-wise,
    so the bits are those of a sum per tensor, with one kernel call instead of one per tensor).

    Args:
        like: A stacked state dict [G, ...] (names, shapes, dtype and device of the sums).
        participants: Participant count of every group this round (0 for inactive groups).
        plans: A dict the caller keeps across rounds: the block plan of a chunk (Python lists and
            index tensors) is built once per distinct (counts, rows) and reused when the same
            participants train again, as they do in every round of a full-participation call.
        layout: ``SumLayout.of(like)``, when the caller has made it already.
    """

    def __init__(
        self,
        like: dict[str, Tensor],
        participants: Sequence[int],
        plans: dict[tuple, BlockPlan] | None = None,
        layout: SumLayout | None = None,
    ) -> None:
        self.count = [int(c) for c in participants]
        self.seen = [0] * len(participants)
        self._carry: tuple[list[Tensor], list[tuple[int, int, int]]] | None = None
        self._plans = {} if plans is None else plans
        lay = SumLayout.of(like) if layout is None else layout
        self.kinds, self.shapes, self.numel = lay.kinds, lay.shapes, lay.numel
        self.flat = [
            like[names[0]].new_zeros((len(self.count), sum(self.numel[k] for k in names)))
            for names in self.kinds
        ]

    def add(
        self,
        params: dict[str, Tensor],
        weights: Tensor,
        owners: Sequence[int],
        meta: Sequence[tuple[int, int, int]] | None = None,
    ) -> None:
        """Add the next rows of the round, in participant order.

        Args:
            params: Local models [m, ...] by name.
            weights: FedAvg weight of each row (sample count), [m].
            owners: Group of each row.
            meta: The rows' (group, block, slot) as :func:`row_meta` gives them, when the caller
                keeps them across rounds (a :class:`~.round_plan.RoundPlan`); given for every
                chunk of the round or for none.
        """
        meta = row_meta(owners, self.seen) if meta is None else list(meta)
        m = len(owners)
        w = weights.to(dtype=next(iter(params.values())).dtype)
        if (  # on CUDA whole matrices: a kernel launch per column block would cost more
            self._carry is None
            and self.flat[0].device.type == "cpu"
            and not self._open(meta)
            and m * max(f.shape[1] for f in self.flat) >= _COLUMN_BLOCKS
        ):
            self._add_by_columns(params, w, meta)
            return
        rows = []
        for names, flat in zip(self.kinds, self.flat):
            first = params[names[0]]
            wcol = w.to(device=first.device).unsqueeze(1)
            width = flat.shape[1]
            if len(names) == 1:
                rows.append(first.reshape(m, -1) * wcol)
            elif m * width < _ONE_PASS:  # few elements: two calls cost less than one per tensor
                rows.append(torch.cat([params[k].reshape(m, -1) for k in names], 1) * wcol)
            else:  # weighted rows written straight into the flat matrix: one pass over memory
                x = first.new_empty((m, width))
                off = 0
                for k in names:
                    n = self.numel[k]
                    torch.mul(params[k].reshape(m, n), wcol, out=x[:, off : off + n])
                    off += n
                rows.append(x)
        if self._carry is not None:
            old, old_meta = self._carry
            rows = [torch.cat([a, b]) for a, b in zip(old, rows)]
            meta = old_meta + meta
            self._carry = None
        # Blocks whose last row has arrived are summed now; an open block waits for the next chunk.
        if self._open(meta):
            last = meta[-1]
            cut = len(meta)
            while cut > 0 and meta[cut - 1][:2] == last[:2]:
                cut -= 1
            self._carry = ([v[cut:].clone() for v in rows], meta[cut:])
            rows, meta = [v[:cut] for v in rows], meta[:cut]
        if not meta:
            return
        plan = self._plan(meta, rows[0].device)
        for x, flat in zip(rows, self.flat):
            reduce_rows(x, plan, flat)

    def _open(self, meta: list[tuple[int, int, int]]) -> bool:
        """Whether the last block of these rows waits for rows of a later chunk."""
        g, block, slot = meta[-1]
        return slot + 1 < min(BLOCK, self.count[g] - block * BLOCK)

    def _plan(self, meta: list[tuple[int, int, int]], device: torch.device) -> BlockPlan:
        return cached_block_plan(self._plans, meta, device)

    def _add_by_columns(self, params: dict[str, Tensor], w: Tensor, meta: list[tuple[int, int, int]]) -> None:
        """:meth:`add` for a large chunk whose blocks all close here, ``_COLUMNS`` columns at a time."""
        m = len(meta)
        for names, flat in zip(self.kinds, self.flat):
            first = params[names[0]]
            plan = self._plan(meta, first.device)
            wcol = w.to(device=first.device).unsqueeze(1)
            buf = first.new_empty(m * min(_COLUMNS, flat.shape[1]))
            off = 0
            for k in names:
                n = self.numel[k]
                src = params[k].reshape(m, n)
                for lo in range(0, n, _COLUMNS):
                    hi = min(n, lo + _COLUMNS)
                    x = buf[: m * (hi - lo)].view(m, hi - lo)
                    torch.mul(src[:, lo:hi], wcol, out=x)
                    reduce_rows(x, plan, flat[:, off + lo : off + hi])
                off += n

    def totals(self) -> dict[str, Tensor]:
        """The per-group sums [G, ...] by name (every row must have been added)."""
        return self._split(self.flat)

    def averages(self, rows: Tensor, weight: Tensor) -> dict[str, Tensor]:
        """Rows ``rows`` of the sums divided by ``weight`` [len(rows)] (cast to each dtype), by name.

        One division per dtype over the flat sums; element-wise, so the bits of a division per tensor.
        """
        return self._split([f.index_select(0, rows) / weight.to(f).unsqueeze(1) for f in self.flat])

    def write_averages(self, state: dict[str, Tensor], rows: Tensor, weight: Tensor) -> None:
        """``state[k][rows] = averages(rows, weight)[k]`` for every name, in place.

        The same division, then one row copy per name: no intermediate dict of views.
        """
        if self._carry is not None:
            raise RuntimeError("GroupSums read before every participant was added")
        n = len(rows)
        for flat, names in zip(self.flat, self.kinds):
            avg = flat.index_select(0, rows) / weight.to(flat).unsqueeze(1)
            off = 0
            for k in names:
                size = self.numel[k]
                state[k].index_copy_(0, rows, avg[:, off : off + size].view(n, *self.shapes[k]))
                off += size

    def _split(self, flats: list[Tensor]) -> dict[str, Tensor]:
        """Views by name of flat [n, D] matrices laid out like the sums."""
        if self._carry is not None:
            raise RuntimeError("GroupSums read before every participant was added")
        out: dict[str, Tensor] = {}
        for flat, names in zip(flats, self.kinds):
            off = 0
            for k in names:
                out[k] = flat[:, off : off + self.numel[k]].reshape(len(flat), *self.shapes[k])
                off += self.numel[k]
        return out


def reduce_rows(x: Tensor, plan: BlockPlan, target: Tensor) -> None:
    """Sum the weighted rows ``x`` [rows, D] by ``plan`` into ``target`` [groups, D] (in place)."""
    n_keys, plans, scatter = plan
    sums = x.new_empty((n_keys, x.shape[1]))
    for n, blocks_t, n_blocks, pick in plans:
        xb = (x if pick is None else x.index_select(0, pick)).view(n_blocks, n, -1)
        part = _pairwise(xb)
        if pick is None:
            sums = part
        else:
            sums.index_copy_(0, blocks_t, part)
    for g_t, pick_k in scatter:
        target.index_add_(0, g_t, sums if pick_k is None else sums.index_select(0, pick_k))


# (blocks, [(rows per block, block ids, block count, row pick)], [(groups, block pick)] per rank)
BlockPlan = tuple[
    int, list[tuple[int, Tensor | None, int, Tensor | None]], list[tuple[Tensor, Tensor | None]]
]


def cached_block_plan(
    plans: dict[tuple, BlockPlan], meta: Sequence[tuple[int, int, int]], device: torch.device
) -> BlockPlan:
    """:func:`block_plan` of ``meta``, kept in ``plans`` (at most 1024 layouts, then afresh)."""
    key = tuple(meta)
    plan = plans.get(key)
    if plan is None:
        if len(plans) > 1024:
            plans.clear()
        plan = plans[key] = block_plan(meta, device)
    return plan


def block_plan(meta: Sequence[tuple[int, int, int]], dev: torch.device) -> BlockPlan:
    """How :meth:`GroupSums.add` sums rows ``meta`` = (group, block, slot): a function of ``meta`` alone.

    Rows of a block are contiguous (participant order). Blocks of equal length are summed
    together by a pairwise tree on a [blocks, length, D] view; each group's blocks are then added
    in block order, one ``index_add_`` per rank touching a group once.
    """
    keys: list[tuple[int, int]] = []
    offsets: list[int] = []
    lengths: list[int] = []
    for i, (g, b, _) in enumerate(meta):
        if keys and keys[-1] == (g, b):
            lengths[-1] += 1
        else:
            keys.append((g, b))
            offsets.append(i)
            lengths.append(1)
    buckets: dict[int, list[int]] = {}
    for k, n in enumerate(lengths):
        buckets.setdefault(n, []).append(k)
    plans = []
    for n, blocks in buckets.items():
        if len(buckets) == 1:
            plans.append((n, None, len(blocks), None))  # every row, in order: a view, no copy
        else:
            pick = torch.as_tensor([offsets[k] + j for k in blocks for j in range(n)], device=dev)
            plans.append((n, torch.as_tensor(blocks, device=dev), len(blocks), pick))
    rank: dict[int, int] = {}
    order: list[tuple[int, int]] = []  # (rank, block)
    for k, (g, _) in enumerate(keys):
        r = rank.get(g, 0)
        rank[g] = r + 1
        order.append((r, k))
    scatter = []  # per rank: the groups it adds to and, unless it is every block, which blocks
    for r in range(max(r for r, _ in order) + 1):
        ks = [k for rr, k in order if rr == r]
        g_t = torch.as_tensor([keys[k][0] for k in ks], device=dev)
        scatter.append((g_t, None if len(ks) == len(keys) else torch.as_tensor(ks, device=dev)))
    return len(keys), plans, scatter


def _pairwise(x: Tensor) -> Tensor:
    """Sum ``x`` [n, L, D] over dim 1 by adjacent pairs, an odd last row carried unchanged.

    With L <= BLOCK this equals :func:`tree_sum` over BLOCK slots padded with zeros.
    """
    while x.shape[1] > 1:
        pairs = x.shape[1] // 2
        y = x[:, 0 : 2 * pairs : 2] + x[:, 1 : 2 * pairs : 2]
        x = torch.cat([y, x[:, -1:]], 1) if x.shape[1] % 2 else y
    return x[:, 0]
