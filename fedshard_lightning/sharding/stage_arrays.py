"""One stage of the shard tree as flat integer arrays: children and clients as ranges.

A tree over K clients has O(K P) (shard, client) memberships. Held as one tuple of client ids
per shard, rebuilding a K = 65,536 tree from the cache took 1.8 s of Python; as arrays it is a few
vectorized passes. Per stage, ``clients`` holds every client id exactly once, grouped by shard
(sorted within a shard), and shard ``s`` owns ``clients[client_starts[s]:client_starts[s + 1]]``;
its children are ``children[child_starts[s]:child_starts[s + 1]]`` in aggregation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["StageArrays", "grouping_error", "leaf_stage", "next_stage"]


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class StageArrays:
    """The shards of one stage (read-only int64 arrays).

    Attributes:
        children: Child indices (previous stage) of every shard, concatenated in aggregation order.
        child_starts: ``[N + 1]`` offsets into ``children``.
        clients: ``[K]`` client ids, grouped by shard, sorted within each shard.
        client_starts: ``[N + 1]`` offsets into ``clients``.
        parents: ``[N_prev]`` index in this stage of each previous-stage shard (empty at stage 0).
    """

    children: np.ndarray
    child_starts: np.ndarray
    clients: np.ndarray
    client_starts: np.ndarray
    parents: np.ndarray

    @property
    def size(self) -> int:
        """Number of shards N."""
        return len(self.client_starts) - 1

    def owner(self) -> np.ndarray:
        """``[K]``: the shard of this stage that holds each client."""
        out = np.empty(len(self.clients), dtype=np.int64)
        out[self.clients] = np.repeat(np.arange(self.size), np.diff(self.client_starts))
        return out

    def same(self, other: StageArrays) -> bool:
        """Equal children (in order) and therefore equal clients."""
        return np.array_equal(self.child_starts, other.child_starts) and np.array_equal(
            self.children, other.children
        )


def leaf_stage(num_clients: int) -> StageArrays:
    """Stage 0: one leaf shard per client."""
    ids = np.arange(num_clients, dtype=np.int64)
    return StageArrays(
        _frozen(np.empty(0)),
        _frozen(np.zeros(num_clients + 1)),
        _frozen(ids),
        _frozen(np.arange(num_clients + 1)),
        _frozen(np.empty(0)),
    )


def grouping_error(children: np.ndarray, starts: np.ndarray, n_prev: int, rate: int) -> str | None:
    """Why ``(children, starts)`` is not a valid grouping of ``n_prev`` shards at rate ``rate``, or None.

    The arrays must be 1-d integer arrays. Valid: exactly ``ceil(n_prev / rate)`` non-empty groups of at most ``rate`` children that
    together name every previous shard exactly once (SPEC section 2).
    """
    children, starts = np.asarray(children), np.asarray(starts)
    if children.ndim != 1 or starts.ndim != 1 or len(starts) < 1:
        return "needs 1-d children and offsets"
    if children.dtype.kind not in "iu" or starts.dtype.kind not in "iu":
        return "holds non-integer indices"
    expected = -(-n_prev // rate)
    n = len(starts) - 1
    if n != expected:
        return f"needs ceil({n_prev}/{rate}) = {expected} groups, got {n}"
    if starts[0] != 0 or starts[-1] != len(children):
        return "group offsets do not cover the children"
    sizes = np.diff(starts)
    if (sizes < 1).any():
        return f"group {int(np.argmax(sizes < 1))} is empty"
    if (sizes > rate).any():
        s = int(np.argmax(sizes > rate))
        return f"group {s} has {int(sizes[s])} children, more than merge_rate={rate}"
    bad = (children < 0) | (children >= n_prev)
    if bad.any():
        return f"a group names shard {int(children[np.argmax(bad)])}, not in range 0..{n_prev - 1}"
    counts = np.bincount(children, minlength=n_prev)
    if (counts > 1).any():
        return f"shard {int(np.argmax(counts > 1))} appears in more than one group"
    if (counts == 0).any():
        return f"shards {np.flatnonzero(counts == 0)[:10].tolist()} are in no group"
    return None


def next_stage(prev: StageArrays, children: np.ndarray, starts: np.ndarray) -> StageArrays:
    """The stage that groups ``prev``'s shards as ``(children, starts)`` (a valid grouping).

    A client's shard is its previous shard's parent; a stable sort by shard keeps the ids of a
    shard in increasing order (the order ``Shard.clients`` promises).
    """
    n = len(starts) - 1
    parents = np.empty(prev.size, dtype=np.int64)
    parents[children] = np.repeat(np.arange(n), np.diff(starts))
    owner = parents[prev.owner()]
    clients = np.argsort(owner, kind="stable")
    client_starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=n), out=client_starts[1:])
    return StageArrays(
        _frozen(children), _frozen(starts), _frozen(clients), _frozen(client_starts), _frozen(parents)
    )
