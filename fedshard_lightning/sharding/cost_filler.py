"""A1's cost-aware ``allocateChildShard``: groups filled by the lowest predicted M_e (SPEC section 5).

:mod:`~fedshard_lightning.sharding.merging` clusters the shards and alternates the clusters; this
module owns the choice of the child within a cluster when costs are known: every candidate is
scored in O(1) from running sums by the M_e of the predicted per-client unlearning costs
(:mod:`~fedshard_lightning.sharding.costs`), projected over the free slots and unplaced shards.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np

from fedshard_lightning.sharding.costs import StageCosts

__all__ = ["CostFiller", "CostPool"]


class CostPool:
    """A cluster's unplaced shards for the cost-aware filler.

    Shards with equal sums (at stage 1 every leaf of one client size, thousands of them) get equal
    scores, so the filler scores each distinct row once: it indexes the pool on first use into
    classes of equal rows, each a queue ordered by the tie-break (``|alpha|``, then the seeded
    rank). A placement then costs O(distinct rows), not O(shards) in Python.
    """

    def __init__(self, members: list[int]) -> None:
        self.initial = list(members)
        self.left = len(self.initial)
        self.class_rows: np.ndarray | None = None  # [U, 6] distinct child rows
        self.queues: list[deque[int]] = []  # per class, its unplaced shards in tie-break order
        self.alive = np.zeros(0, dtype=bool)  # per class: shards left

    def __bool__(self) -> bool:
        return self.left > 0

    @property
    def members(self) -> list[int]:
        """The unplaced shards, ascending."""
        if self.class_rows is None:
            return sorted(self.initial)
        return sorted(i for q in self.queues for i in q)


class CostFiller:
    """Groups filled by ``allocateChildShard``: each candidate scored by the predicted M_e in O(1).

    Every client's predicted cost is ``Z_c = v_c + T * (S + f * m)`` where ``v_c`` = cost already
    paid + expected later cost - ``T * s_c``, ``S`` the step sum of its (projected) group, ``f`` the
    group's free slots (an unplaced shard: the mean free slots of an average group) and ``m`` the
    mean step sum of the shards not yet placed. A group (or unplaced shard) enters M_e only through
    seven sums (:meth:`_contrib`), so adding a child changes three of them.
    """

    _N = 7

    def __init__(self, caps: list[int], a: np.ndarray, costs: StageCosts, seed: int) -> None:
        s, w = costs.client_steps, costs.weights
        t = float(costs.rounds)
        v = costs.paid + costs.future - t * s
        self.t, self.k, self.w_total = t, float(len(s)), float(w.sum())
        n_items = len(costs.shard_clients)
        # per child shard: clients, sum v, sum w, sum w v, sum w v^2, step sum b
        self.child = np.zeros((n_items, 6))
        for j, clients in enumerate(costs.shard_clients):
            idx = np.asarray(clients, dtype=np.int64)
            self.child[j] = (
                idx.size,
                v[idx].sum(),
                w[idx].sum(),
                (w[idx] * v[idx]).sum(),
                (w[idx] * v[idx] ** 2).sum(),
                s[idx].sum(),
            )
        self.k_free = max(sum(caps) / len(caps) - 1.0, 0.0)
        self.groups: list[list[int]] = [[] for _ in caps]
        self.gsum = np.zeros((len(caps), 6))  # same columns as child
        self.free = np.asarray(caps, dtype=np.float64)
        self.alpha_sums = [0.0] * len(caps)
        self.a = a
        self.rank = np.random.default_rng(seed).permutation(n_items)
        self.unplaced_b, self.unplaced_n = float(self.child[:, 5].sum()), n_items
        self.total = self._contrib(self.child, self.k_free).sum(axis=0)  # groups are empty
        self.heap = [(0, g) for g in range(len(caps))]

    def _contrib(self, rows: np.ndarray, f: np.ndarray | float) -> np.ndarray:
        """The seven sums (Σu, Σk, Σwu, Σwk, Σwu², Σwuk, Σwk²) of entities with sums ``rows``."""
        n, sv, sw, swv, swv2, big_s = rows.T
        t = self.t
        wu = swv + sw * t * big_s
        return np.stack(
            [
                sv + n * t * big_s,
                n * f,
                wu,
                sw * f,
                swv2 + 2 * t * big_s * swv + sw * (t * big_s) ** 2,
                f * wu,
                sw * f * f,
            ],
            axis=-1,
        )

    def _m_e(self, total: np.ndarray, m: np.ndarray | float) -> np.ndarray:
        a, kk, wu, wk, wu2, wuk, wk2 = total.T
        tm = self.t * m
        z_avg = (a + tm * kk) / self.k
        swz = wu + tm * wk
        swz2 = wu2 + 2 * tm * wuk + tm * tm * wk2
        return (swz2 - 2 * z_avg * swz + z_avg * z_avg * self.w_total) / self.k

    def next_mean_alpha(self) -> float:
        """Mean alpha of the group that receives the next shard (0 for an empty group)."""
        g = self.heap[0][1]
        return self.alpha_sums[g] / len(self.groups[g]) if self.groups[g] else 0.0

    def scores(self, g: int, candidates: np.ndarray) -> np.ndarray:
        """Predicted M_e after adding each candidate to group ``g``."""
        return self._row_scores(g, self.child[candidates])

    def _row_scores(self, g: int, rows: np.ndarray) -> np.ndarray:
        """Predicted M_e after adding a child with each of these sums to group ``g``."""
        merged = self.gsum[g] + rows
        new_total = (
            self.total
            - self._contrib(self.gsum[g : g + 1], self.free[g])
            - self._contrib(rows, self.k_free)
            + self._contrib(merged, self.free[g] - 1.0)
        )
        left = self.unplaced_n - 1
        m = (self.unplaced_b - rows[:, 5]) / left if left > 0 else np.zeros(len(rows))
        return self._m_e(new_total, m)

    def _index(self, pool: CostPool) -> None:
        """Split the pool into classes of equal child rows, each queued by (``|alpha|``, rank)."""
        members = np.asarray(pool.initial, dtype=np.int64)
        rows = self.child[members]
        pool.class_rows, inverse = np.unique(rows, axis=0, return_inverse=True)
        inverse = np.asarray(inverse).reshape(-1)
        order = np.lexsort((self.rank[members], np.abs(self.a[members]), inverse))
        pool.queues = [deque() for _ in range(len(pool.class_rows))]
        for pos in order.tolist():
            pool.queues[int(inverse[pos])].append(int(members[pos]))
        pool.alive = np.ones(len(pool.class_rows), dtype=bool)

    def place(self, pool: CostPool) -> None:
        """Give the next group (fewest children, lowest index) the candidate of lowest predicted M_e."""
        size, g = heapq.heappop(self.heap)
        if pool.class_rows is None:
            self._index(pool)
        live = np.flatnonzero(pool.alive)
        sc = self._row_scores(g, pool.class_rows[live])
        best = sc.min()
        tied = live[sc <= best + 1e-9 * max(1.0, abs(best))]
        heads = [pool.queues[c][0] for c in tied.tolist()]  # each class's first in tie-break order
        pick = min(range(len(heads)), key=lambda t: (abs(float(self.a[heads[t]])), int(self.rank[heads[t]])))
        c = int(tied[pick])
        i = pool.queues[c].popleft()
        if not pool.queues[c]:
            pool.alive[c] = False
        pool.left -= 1
        self.add(size, g, i)

    def add(self, size: int, g: int, i: int) -> None:
        """Put shard ``i`` into group ``g`` (which had ``size`` children) and update the running sums."""
        row = self.child[i]
        self.total = (
            self.total
            - self._contrib(self.gsum[g : g + 1], self.free[g])[0]
            - self._contrib(row[None], self.k_free)[0]
        )
        self.gsum[g] += row
        self.free[g] -= 1.0
        self.total = self.total + self._contrib(self.gsum[g : g + 1], self.free[g])[0]
        self.unplaced_b -= float(row[5])
        self.unplaced_n -= 1
        self.groups[g].append(i)
        self.alpha_sums[g] += float(self.a[i])
        if self.free[g]:
            heapq.heappush(self.heap, (size + 1, g))
