"""A1's ``allocateChildShard`` by client counts (``allocation="count"``, the ablation; SPEC section 5).

:mod:`~fedshard_lightning.sharding.merging` clusters the shards and alternates the clusters; this
module picks the child within a cluster when no costs are known: the shard whose addition keeps the
groups' projected client counts most even, scored in O(1) from running sums. The cost-aware rule
is :mod:`~fedshard_lightning.sharding.cost_filler`.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

import numpy as np

__all__ = ["CountFiller", "CountPool"]


class CountPool:
    """A cluster's unplaced shards, bucketed by client count, each bucket by ``(|alpha|, index)``."""

    def __init__(self, members: list[int], a: np.ndarray, counts: np.ndarray) -> None:
        self.buckets: dict[int, deque[int]] = {}
        for i in sorted(members, key=lambda i: (abs(float(a[i])), i)):
            self.buckets.setdefault(int(counts[i]), deque()).append(i)
        self.a = a

    def __bool__(self) -> bool:
        return bool(self.buckets)

    def pop_best(self, spread: Callable[[int], int]) -> tuple[int, int]:
        """Remove and return ``(index, count)`` of the shard with least spread, then ``|alpha|``, index."""
        c = min(
            self.buckets,
            key=lambda c: (spread(c), abs(float(self.a[self.buckets[c][0]])), self.buckets[c][0]),
        )
        bucket = self.buckets[c]
        i = bucket.popleft()
        if not bucket:
            del self.buckets[c]
        return i, c


class CountFiller:
    """The groups being filled, with the sums that make each evenness evaluation O(1).

    Evenness is the variance of the groups' projected client counts: a group's count plus its free
    slots times ``m``, the mean client count of the shards still unplaced. Scaled by
    ``N^2 * rest^2`` (``rest`` = shards unplaced) every term is an integer, so equal spreads compare
    equal and the ``|alpha|`` tie-break is exact.
    """

    def __init__(self, caps: list[int], a: np.ndarray, counts: np.ndarray) -> None:
        self.groups: list[list[int]] = [[] for _ in caps]
        self.totals = [0] * len(caps)  # client count of every group so far
        self.free = list(caps)  # free slots of every group
        self.alpha_sums = [0.0] * len(caps)
        self.a = a
        self.left, self.left_sum = len(a), int(counts.sum())  # unplaced shards and their clients
        self.t_sum, self.s_sum = 0, sum(caps)
        self.t_sq, self.ts, self.s_sq = 0, 0, sum(c * c for c in caps)
        # Fewest children among groups with room, ties lowest index: a heap of (children, index).
        self.heap = [(0, g) for g in range(len(caps))]

    def next_mean_alpha(self) -> float:
        """Mean alpha of the group that receives the next shard (0 for an empty group)."""
        g = self.heap[0][1]
        return self.alpha_sums[g] / len(self.groups[g]) if self.groups[g] else 0.0

    def spread(self, g: int, c: int) -> int:
        """Scaled variance of the projected client counts if ``c`` clients join group ``g``."""
        rest = self.left - 1
        scale, big_m = max(rest, 1), self.left_sum - c  # m = big_m / rest (big_m = 0 when rest = 0)
        tg, sg = self.totals[g], self.free[g]
        others = (
            scale * scale * (self.t_sq - tg * tg)
            + 2 * scale * big_m * (self.ts - tg * sg)
            + big_m * big_m * (self.s_sq - sg * sg)
        )
        mine = scale * (tg + c) + (sg - 1) * big_m
        total = scale * (self.t_sum + c) + (self.s_sum - 1) * big_m
        return len(self.totals) * (others + mine * mine) - total * total

    def place(self, pool: CountPool) -> None:
        """Give the next group (fewest children, lowest index) the pool's most even-making shard."""
        size, g = heapq.heappop(self.heap)
        i, c = pool.pop_best(lambda c: self.spread(g, c))
        tg, sg = self.totals[g], self.free[g]
        self.t_sq += (tg + c) ** 2 - tg * tg
        self.ts += (tg + c) * (sg - 1) - tg * sg
        self.s_sq += (sg - 1) ** 2 - sg * sg
        self.t_sum += c
        self.s_sum -= 1
        self.totals[g], self.free[g] = tg + c, sg - 1
        self.groups[g].append(i)
        self.alpha_sums[g] += float(self.a[i])
        self.left, self.left_sum = self.left - 1, self.left_sum - c
        if self.free[g]:
            heapq.heappush(self.heap, (size + 1, g))
