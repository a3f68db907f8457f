"""The frozen shard tree of FedShard: stages, paths and affected shards.

Paper: FedShard, Algorithm "FedShard Federated Learning" (Appendix D.1) builds the tree stage by
stage with ``P = ceil(log_R K)``; Algorithm "FedShard Federated Unlearning" retrains the shards
on a leaving client's path. SPEC sections 1, 2 and 7 make both precise.

Departures from the paper and choices of ours:

- ``P`` is the smallest integer with ``R**P >= K``, computed with integers only: the paper's
  ``ceil(log_R K)`` in floating point is wrong for exact powers (``math.log(125, 5)`` is
  ``3.0000000000000004``, so it would give 4 stages for ``K = 125, R = 5``); its main text even
  writes ``ceil(K/R)``.
- Every stage must have exactly ``ceil(N_{p-1} / R)`` shards (SPEC section 2), so a finished tree
  always has exactly ``P`` stages and the unlearning cost is predictable (SPEC section 7).
- Shard indices are 0-based; a shard's children keep the order its merge policy gave them, since
  the aggregation order of their models is part of what makes unlearning bit-exact.
- Each stage is held as flat arrays (:mod:`~fedshard_lightning.sharding.stage_arrays`); the
  :class:`Shard` objects are built only when asked for (loading builds no O(K P) tuples).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from fedshard_lightning.errors import ConfigError, UnlearningRequestError
from fedshard_lightning.sharding.stage_arrays import StageArrays, grouping_error, leaf_stage, next_stage

__all__ = ["Shard", "ShardTree", "num_stages"]

_FORMAT_VERSION = 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_index(value: object) -> int | None:
    """``value`` as a Python int if it is an integer (numpy ones included, bools excluded), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def num_stages(num_clients: int, merge_rate: int) -> int:
    """Number of stages ``P`` of a tree over ``num_clients`` clients with merging rate ``merge_rate``.

    ``P`` is the smallest integer with ``merge_rate**P >= num_clients`` (SPEC section 2). Pure
    integer arithmetic: ``math.log`` rounds some exact powers the wrong way (e.g. ``5**3``).

    Args:
        num_clients: Number of clients ``K``, at least 2.
        merge_rate: Merging rate ``R``, at least 2.

    Returns:
        The number of stages ``P >= 1``.

    Raises:
        ConfigError: If either argument is not an integer >= 2.
    """
    if not _is_int(merge_rate) or merge_rate < 2:
        raise ConfigError(f"merge_rate={merge_rate!r} must be an integer >= 2")
    if not _is_int(num_clients) or num_clients < 2:
        raise ConfigError(f"num_clients={num_clients!r} must be an integer >= 2")
    stages, capacity = 0, 1
    while capacity < num_clients:
        capacity *= merge_rate
        stages += 1
    return stages


@dataclass(frozen=True)
class Shard:
    """One node of the shard tree: shard ``index`` of stage ``stage``.

    Attributes:
        stage: Stage ``p`` (0 for the leaves, one per client).
        index: Position of the shard within its stage, 0-based.
        children: Indices of its children in stage ``p - 1``, in aggregation order (empty at stage 0).
        clients: Sorted ids of all clients below it.
    """

    stage: int
    index: int
    children: tuple[int, ...]
    clients: tuple[int, ...]


class ShardTree:
    """The shard tree that FedShard freezes during training and replays during unlearning.

    Stage 0 holds one leaf shard per client (``Shard(0, c, (), (c,))``); :meth:`add_stage` adds
    the stages that a merge policy chooses. Once finished (one shard in the last stage) the tree
    is the structural part of FLCache: it round-trips through :meth:`to_dict` / :meth:`from_dict`.

    Args:
        num_clients: Number of clients ``K``, at least 2.
        merge_rate: Merging rate ``R``, at least 2.

    Raises:
        ConfigError: If ``num_clients`` or ``merge_rate`` is invalid.
    """

    def __init__(self, num_clients: int, merge_rate: int) -> None:
        self._planned = num_stages(num_clients, merge_rate)
        self._num_clients = num_clients
        self._merge_rate = merge_rate
        self._arrays: list[StageArrays] = [leaf_stage(num_clients)]
        self._shards: list[list[Shard] | None] = [None]  # built on first use

    # ------------------------------------------------------------------ construction

    def add_stage(self, groups: Sequence[Sequence[int]]) -> list[Shard]:
        """Build the next stage from a grouping of the current last stage.

        Args:
            groups: One sequence of previous-stage shard indices per new shard; together they must
                partition the previous stage into exactly ``ceil(N / merge_rate)`` non-empty groups
                of at most ``merge_rate`` children. Group ``s`` becomes shard ``s``.

        Returns:
            The shards of the new stage.

        Raises:
            ValueError: If the tree is already complete or ``groups`` is not a valid grouping.
        """
        if self.complete:
            raise ValueError("the shard tree is complete: its last stage already has a single shard")
        n_prev, rate = self._arrays[-1].size, self._merge_rate
        expected = -(-n_prev // rate)
        parents = [-1] * n_prev
        clean: list[tuple[int, ...]] = []
        if isinstance(groups, (str, bytes)):
            raise ValueError("groups must be a sequence of sequences of shard indices")
        for s, group in enumerate(groups):
            group = list(group)
            if not group:
                raise ValueError(f"group {s} is empty")
            if len(group) > rate:
                raise ValueError(f"group {s} has {len(group)} children, more than merge_rate={rate}")
            for i, child in enumerate(group):
                index = _as_index(child)
                if index is None or not 0 <= index < n_prev:
                    raise ValueError(f"group {s} names shard {child!r}, not in range 0..{n_prev - 1}")
                if parents[index] != -1:
                    raise ValueError(f"shard {index} appears in more than one group")
                parents[index] = s
                group[i] = index
            clean.append(tuple(group))
        if len(clean) != expected:
            raise ValueError(
                f"stage {len(self._arrays)} needs ceil({n_prev}/{rate}) = {expected} groups, got {len(clean)}"
            )
        missing = [i for i, parent in enumerate(parents) if parent == -1]
        if missing:
            raise ValueError(f"shards {missing[:10]} of stage {len(self._arrays) - 1} are in no group")
        starts = np.zeros(len(clean) + 1, dtype=np.int64)
        np.cumsum([len(g) for g in clean], out=starts[1:])
        children = np.fromiter(chain.from_iterable(clean), dtype=np.int64, count=int(starts[-1]))
        self._arrays.append(next_stage(self._arrays[-1], children, starts))
        self._shards.append(None)
        return list(self._stage_shards(len(self._arrays) - 1))

    def with_stage(self, groups: Sequence[Sequence[int]]) -> tuple[ShardTree, list[Shard]]:
        """A new tree with :meth:`add_stage`'s stage, and that stage's shards; this tree stays as it is.

        The immutable form for a planner's state: the stages' arrays are read-only and shared.
        """
        new = copy.copy(self)
        new._arrays, new._shards = list(self._arrays), list(self._shards)
        return new, new.add_stage(groups)

    def live_shards(
        self, client_weights: np.ndarray, gone: Iterable[int], stages: int | None = None
    ) -> list[tuple[list[float], dict[int, tuple[int, ...]]]]:
        """Per stage ``1..stages`` (default: all built): shard weights without ``gone``, and who remains where it hit.

        A shard's weight is the sum of its remaining clients' ``client_weights`` (stage 1) or of
        its children's weights; the remaining clients are listed only for the shards that lost one
        (the others keep all). Vectorized on the stages' arrays; with integer-valued weights the
        sums are exact, so they equal a sum over the shards in any order.
        """
        w = np.array(client_weights, dtype=np.float64)
        dead = np.array(sorted({int(c) for c in gone}), dtype=np.int64)
        w[dead] = 0.0
        out, prev = [], w
        for p in range(1, (self.num_stages if stages is None else stages) + 1):
            a = self._arrays[p]
            owner = a.owner()
            weights = np.bincount(owner if p == 1 else a.parents, weights=prev, minlength=a.size)
            hit = {}
            for s in np.unique(owner[dead]).tolist():
                ids = a.clients[a.client_starts[s] : a.client_starts[s + 1]]
                hit[s] = tuple(ids[~np.isin(ids, dead)].tolist())
            out.append((weights.tolist(), hit))
            prev = weights
        return out

    @classmethod
    def from_arrays(
        cls, num_clients: int, merge_rate: int, stages: Sequence[tuple[np.ndarray, np.ndarray]]
    ) -> ShardTree:
        """The fast twin of :meth:`from_dict` for the cache, validated vectorized.

        Shard ``s`` of a stage has the children ``children[offsets[s]:offsets[s + 1]]`` in order.

        Raises:
            ValueError: If the arrays are not a valid (possibly partial) tree.
        """
        try:
            tree = cls(num_clients, merge_rate)
        except ValueError as err:
            raise ValueError(f"malformed shard tree: {err}") from err
        for children, offsets in stages:
            stage, prev = len(tree._arrays), tree._arrays[-1]
            error = (
                "comes after the root"
                if tree.complete
                else grouping_error(children, offsets, prev.size, merge_rate)
            )
            if error is not None:
                raise ValueError(f"malformed shard tree: stage {stage} {error}")
            tree._arrays.append(
                next_stage(prev, np.asarray(children, np.int64), np.asarray(offsets, np.int64))
            )
            tree._shards.append(None)
        return tree

    def _stage_shards(self, stage: int) -> list[Shard]:
        """The :class:`Shard` objects of a stage (built once, from its arrays)."""
        shards = self._shards[stage]
        if shards is None:
            a = self._arrays[stage]
            ids, cs = a.clients.tolist(), a.client_starts.tolist()
            kids, ks = a.children.tolist(), a.child_starts.tolist()
            shards = [
                Shard(stage, s, tuple(kids[ks[s] : ks[s + 1]]), tuple(ids[cs[s] : cs[s + 1]]))
                for s in range(a.size)
            ]
            self._shards[stage] = shards
        return shards

    def stage_arrays(self, stage: int) -> StageArrays:
        """Stage ``stage`` as flat read-only arrays (children and clients as ranges); IndexError if none."""
        if not 0 <= stage < len(self._arrays):
            raise IndexError(f"stage {stage} not in range 0..{self.num_stages}")
        return self._arrays[stage]

    # ------------------------------------------------------------------ properties

    @property
    def num_clients(self) -> int:
        """Number of clients ``K``."""
        return self._num_clients

    @property
    def merge_rate(self) -> int:
        """Merging rate ``R``."""
        return self._merge_rate

    @property
    def planned_stages(self) -> int:
        """Number of stages ``P`` the finished tree will have."""
        return self._planned

    @property
    def num_stages(self) -> int:
        """Number of stages built after stage 0."""
        return len(self._arrays) - 1

    @property
    def complete(self) -> bool:
        """Whether the last stage built has a single shard (the root)."""
        return self._arrays[-1].size == 1

    @property
    def stages(self) -> list[list[Shard]]:
        """All stages, ``stages[0]`` being the leaves (a copy; shards are immutable)."""
        return [list(self._stage_shards(p)) for p in range(len(self._arrays))]

    # ------------------------------------------------------------------ queries

    def shard(self, stage: int, index: int) -> Shard:
        """Return shard ``index`` of stage ``stage``.

        Raises:
            IndexError: If there is no such shard.
        """
        a = self.stage_arrays(stage)
        if not 0 <= index < a.size:
            raise IndexError(f"stage {stage} has no shard {index} ({a.size} shards)")
        built = self._shards[stage]
        if built is not None:
            return built[index]
        kids = a.children[a.child_starts[index] : a.child_starts[index + 1]].tolist()
        ids = a.clients[a.client_starts[index] : a.client_starts[index + 1]].tolist()
        return Shard(stage, index, tuple(kids), tuple(ids))

    def _check_clients(self, clients: Iterable[int]) -> set[int]:
        found = set()
        for c in clients:
            index = _as_index(c)
            if index is None or not 0 <= index < self._num_clients:
                raise UnlearningRequestError(f"client {c!r} is not in range 0..{self._num_clients - 1}")
            found.add(index)
        return found

    def path(self, client: int) -> list[tuple[int, int]]:
        """Shards that hold ``client``, one per stage: ``(stage, index)`` for stages ``1..num_stages``.

        These are the shards that unlearning ``client`` alone must retrain.

        Raises:
            UnlearningRequestError: If ``client`` is not a client id of this tree.
        """
        self._check_clients([client])
        path, index = [], client
        for stage, a in enumerate(self._arrays[1:], start=1):
            index = int(a.parents[index])
            path.append((stage, index))
        return path

    def affected(self, leaving: Iterable[int]) -> dict[int, list[int]]:
        """Shards whose clients intersect ``leaving``, per stage (SPEC section 7).

        Args:
            leaving: Ids of the leaving clients (duplicates are ignored).

        Returns:
            ``{stage: sorted shard indices}`` for every stage ``1..num_stages`` (an empty list when
            no shard of that stage is affected, i.e. when ``leaving`` is empty).

        Raises:
            UnlearningRequestError: If an id is not a client of this tree.
        """
        current = np.array(sorted(self._check_clients(leaving)), dtype=np.int64)
        result: dict[int, list[int]] = {}
        for stage, a in enumerate(self._arrays[1:], start=1):
            current = np.unique(a.parents[current])
            result[stage] = current.tolist()
        return result

    def remaining_clients(self, stage: int, index: int, leaving: Iterable[int]) -> tuple[int, ...]:
        """Clients of shard ``(stage, index)`` that are not leaving, sorted.

        Raises:
            IndexError: If there is no such shard.
            UnlearningRequestError: If an id in ``leaving`` is not a client of this tree.
        """
        shard = self.shard(stage, index)
        gone = self._check_clients(leaving)
        return tuple(c for c in shard.clients if c not in gone)

    # ------------------------------------------------------------------ serialization

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable description: sizes plus the children of every shard of stages ``1..P``."""
        return {
            "version": _FORMAT_VERSION,
            "num_clients": self._num_clients,
            "merge_rate": self._merge_rate,
            "stages": [
                [list(s.children) for s in self._stage_shards(p)] for p in range(1, len(self._arrays))
            ],
        }

    @classmethod
    def from_dict(cls, d: Any) -> ShardTree:
        """Rebuild a tree from :meth:`to_dict` output, validating every field.

        Raises:
            ValueError: If ``d`` is not a well-formed shard tree description.
        """
        if not isinstance(d, dict):
            raise ValueError(f"malformed shard tree: expected a dict, got {type(d).__name__}")
        keys = {"version", "num_clients", "merge_rate", "stages"}
        if set(d) != keys:
            raise ValueError(f"malformed shard tree: keys {sorted(map(str, d))}, expected {sorted(keys)}")
        if not _is_int(d["version"]) or d["version"] != _FORMAT_VERSION:
            raise ValueError(f"malformed shard tree: unsupported version {d['version']!r}")
        stages = d["stages"]
        if not isinstance(stages, list) or not all(
            isinstance(stage, list) and all(isinstance(group, list) for group in stage) for stage in stages
        ):
            raise ValueError("malformed shard tree: 'stages' must be a list of lists of lists of ints")
        try:
            tree = cls(d["num_clients"], d["merge_rate"])
            for stage in stages:
                tree.add_stage(stage)
        except ValueError as err:  # ConfigError is a ValueError too
            raise ValueError(f"malformed shard tree: {err}") from err
        return tree

    # ------------------------------------------------------------------ display

    def pretty(self, max_clients_shown: int = 8) -> str:
        """Readable indented tree from the top stage down to stage 1 (leaves are not listed).

        Each line reads like ``stage 2 shard 0 (clients 0-7, 8 clients)``; runs of consecutive ids
        are shown as ranges and at most ``max_clients_shown`` ids or ranges are printed per shard.

        Args:
            max_clients_shown: Most ids or ranges of ids printed per shard before ``...``.
        """
        header = (
            f"ShardTree: {self.num_clients} clients, merge_rate {self.merge_rate}, "
            f"{self.num_stages}/{self.planned_stages} stages"
        )
        lines = [header]

        def visit(stage: int, index: int, depth: int) -> None:
            shard = self.shard(stage, index)
            ids = _format_ids(shard.clients, max_clients_shown)
            n = len(shard.clients)
            noun = "client" if n == 1 else "clients"
            lines.append(f"{'  ' * depth}stage {stage} shard {index} (clients {ids}, {n} {noun})")
            if stage > 1:
                for child in shard.children:
                    visit(stage - 1, child, depth + 1)

        if self.num_stages == 0:
            lines.append(f"stage 0: {self.num_clients} leaf shards, one per client")
        else:
            for index in range(self.stage_arrays(self.num_stages).size):
                visit(self.num_stages, index, 0)
        return "\n".join(lines)

    # ------------------------------------------------------------------ dunder

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardTree):
            return NotImplemented
        return (
            self._num_clients == other._num_clients
            and self._merge_rate == other._merge_rate
            and len(self._arrays) == len(other._arrays)
            and all(a.same(b) for a, b in zip(self._arrays, other._arrays))
        )

    __hash__ = None  # type: ignore[assignment]  # mutable: add_stage changes it

    def __repr__(self) -> str:
        return (
            f"ShardTree(num_clients={self._num_clients}, merge_rate={self._merge_rate}, "
            f"stages={self.num_stages}/{self._planned})"
        )


def _format_ids(ids: Sequence[int], max_shown: int) -> str:
    """Compress sorted ids into ``0-3, 7, 9-12`` and cut the list after ``max_shown`` items."""
    runs: list[str] = []
    start = prev = None
    for c in ids:
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = c
    if start is not None:
        runs.append(f"{start}-{prev}" if prev != start else f"{start}")
    if len(runs) > max(max_shown, 1):
        runs = [*runs[: max(max_shown, 1)], "..."]
    return ", ".join(runs)
