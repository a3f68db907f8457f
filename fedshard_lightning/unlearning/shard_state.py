"""What FedShard keeps of its frozen shard tree, and how that state becomes FLCache files.

:class:`ShardRecord` is a shard's metadata (children, clients, merge weight, alpha, rounds, the
clients that remain after unlearning); the shard models are stacked per stage. :class:`ShardCache`
gives :class:`~fedshard_lightning.unlearning.fedshard.FedShard` its ``cache_files`` /
``cache_stacks`` / ``restore_cache`` (FLCache format 2): one stack ``stage_<p>`` per stage (one blob
per shard model), and the frozen structure of each stage (children, alpha, rounds) as one
``structure_<p>.safetensors`` that every later version shares. Clients, remaining clients and
weights are not stored: they follow from the tree, the unlearned clients and the client weights,
computed on the tree's per-stage arrays (a record's client tuples come from one ``tolist`` of its
stage, and the shards that no unlearned client touched share one tuple for clients and remaining).

Which shards changed is part of the state (``changed``: stage -> changed rows, ``None`` for a whole
new stage), declared by ``fit`` and ``unlearn``; the trainer's commit then writes only those rows
(a request adds one blob per shard it retrained). A stage whose tensors are the very objects of the
last committed version writes nothing; when the state did not come from the cache's current
version, every row is hashed and only missing blobs are written (content addressing makes the
result the same either way).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.cache import FLCache, StackWrite
from fedshard_lightning.sharding import ShardTree

__all__ = ["ShardCache", "ShardRecord"]


@dataclass
class ShardRecord:
    """What FLCache keeps of a shard besides its model."""

    children: tuple[int, ...]
    clients: tuple[int, ...]
    weight: float
    alpha: float
    rounds: int
    remaining: tuple[int, ...]

    @property
    def empty(self) -> bool:
        """No client of this shard remains (it disappeared after unlearning)."""
        return not self.remaining

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "children": list(self.children),
            "clients": list(self.clients),
            "weight": self.weight,
            "alpha": self.alpha,
            "rounds": self.rounds,
            "remaining": list(self.remaining),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardRecord:
        """Inverse of :meth:`to_dict`."""
        return cls(
            tuple(int(c) for c in d["children"]),
            tuple(int(c) for c in d["clients"]),
            float(d["weight"]),
            float(d["alpha"]),
            int(d["rounds"]),
            tuple(int(c) for c in d["remaining"]),
        )


class ShardCache:
    """FedShard's persistence (a mixin: it reads the tree, records and stage models of the state)."""

    tree: ShardTree
    records: list[list[ShardRecord]]
    models: list[dict[str, Tensor]]
    changed: dict[int, list[int] | None]
    merge_rate: int
    _committed: tuple[str, str, dict[int, dict[str, Tensor]]] | None = None
    """(cache root, version, {stage: models}): the in-memory stage models that are the stacks of that
    committed version; ``changed`` is relative to it."""

    def mark_changed(self, shards: Iterable[tuple[int, int]] = (), new_stage: int | None = None) -> None:
        """Declare shards ``(stage, index)`` changed since the last commit, or a whole new stage.

        ``changed`` is replaced, never mutated, so states handed out before stay as they were.
        """
        changed = dict(self.changed)
        if new_stage is not None:
            changed[new_stage] = None
        for p, i in shards:
            if p not in changed or changed[p] is not None:
                changed[p] = sorted({*changed.get(p, []), int(i)})
        self.changed = changed

    def _structure(self, stage: int) -> dict[str, Tensor]:
        """The frozen metadata of a stage's shards: children (in aggregation order), alpha, rounds.

        It never changes after the stage is trained, so its blob is written once per run and every
        later version shares it.
        """
        recs = self.records[stage - 1]
        lengths = torch.tensor([len(r.children) for r in recs], dtype=torch.int64)
        return {
            "children": torch.tensor([c for r in recs for c in r.children], dtype=torch.int64),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            "alpha": torch.tensor([r.alpha for r in recs], dtype=torch.float64),
            "rounds": torch.tensor([r.rounds for r in recs], dtype=torch.int64),
        }

    def cache_files(
        self, cache: FLCache
    ) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict[str, str]]:
        """The stage count, the client sizes and every completed stage's frozen structure."""
        stages = len(self.records)
        fields = {
            "merge_rate": self.merge_rate,
            "planned_stages": self.planned_stages,
            "stages_done": stages,
            "round_policy_state": self.round_policy.state_dict(),
        }
        tensors = {"client_sizes.safetensors": {"sizes": torch.tensor(self._sizes, dtype=torch.int64)}}
        for p in range(1, stages + 1):
            tensors[f"structure_{p}.safetensors"] = self._structure(p)
        return fields, tensors, {}

    def cache_stacks(self, cache: FLCache) -> dict[str, StackWrite]:
        """One stack per stage; only the rows changed since the committed version are written."""
        committed = self._committed
        clean = (
            committed is not None
            and cache.exists()
            and committed[0] == str(cache.root)
            and committed[1] == cache.current()
        )
        stacks = {}
        for p, m in enumerate(self.models, start=1):
            rows: list[int] | None = None
            if clean:
                before = committed[2].get(p)
                if _same_tensors(before, m):
                    rows = []
                elif before is not None:
                    rows = self.changed.get(p)
            stacks[f"stage_{p}"] = StackWrite(m, rows)
        return stacks

    def committed(self, cache: FLCache, version: str) -> None:
        """The current stage models are the stacks of ``version``; nothing has changed since."""
        self._committed = (str(cache.root), version, dict(enumerate(self.models, start=1)))
        self.changed = {}

    def live_shards(
        self, stages: int, gone: Iterable[int]
    ) -> list[tuple[list[float], dict[int, tuple[int, ...]]]]:
        """Per stage ``1..stages``: the shards' merge weights without ``gone``, and who remains where it hit.

        The remaining clients are listed only for the shards that lost one (the others keep all).
        Vectorized on the tree's arrays; weights are sums of integer-valued client weights, so
        summing them in client (or child) index order gives the bits of ``_replay``'s sums.
        """
        k = self.num_clients
        w = np.ones(k) if self.merge_weighting == "clients" else np.asarray(self._sizes, dtype=np.float64)
        dead = np.array(sorted({int(c) for c in gone}), dtype=np.int64)
        w[dead] = 0.0
        out, prev = [], w
        for p in range(1, stages + 1):
            a = self.tree.stage_arrays(p)
            owner = a.owner()
            weights = np.bincount(owner if p == 1 else a.parents, weights=prev, minlength=a.size)
            hit = {}
            for s in np.unique(owner[dead]).tolist():
                ids = a.clients[a.client_starts[s] : a.client_starts[s + 1]]
                hit[s] = tuple(ids[~np.isin(ids, dead)].tolist())
            out.append((weights.tolist(), hit))
            prev = weights
        return out

    def _records_from(self, structures: list[dict[str, Tensor]], gone: set[int]) -> list[list[ShardRecord]]:
        """Records of every stage from the frozen structure, the tree and the unlearned clients."""
        records: list[list[ShardRecord]] = []
        for p, (st, (weights, hit)) in enumerate(zip(structures, self.live_shards(len(structures), gone)), 1):
            alpha, rounds = st["alpha"].tolist(), st["rounds"].tolist()
            a = self.tree.stage_arrays(p)
            if len(alpha) != a.size or len(rounds) != a.size:
                raise ValueError(f"structure of stage {p}: {len(alpha)} shards, the tree has {a.size}")
            ids, cs = a.clients.tolist(), a.client_starts.tolist()
            kids, ks = a.children.tolist(), a.child_starts.tolist()
            recs = []
            for i in range(a.size):
                clients = tuple(ids[cs[i] : cs[i + 1]])
                children = tuple(kids[ks[i] : ks[i + 1]])
                recs.append(
                    ShardRecord(children, clients, weights[i], alpha[i], int(rounds[i]), hit.get(i, clients))
                )
            records.append(recs)
        return records

    def restore_structure(self, structures: list[dict[str, Tensor]], gone: set[int]) -> None:
        """The tree and the records from each stage's frozen structure (children as ranges of one array)."""
        arrays = [(st["children"].numpy(), st["offsets"].numpy()) for st in structures]
        with _gc_paused():
            self.tree = ShardTree.from_arrays(self.num_clients, self.merge_rate, arrays)
            self.records = self._records_from(structures, gone)

    def restore_cache(self, cache: FLCache, manifest: dict[str, Any], device: torch.device) -> None:
        """Restore the tree and the records from the frozen structure, and every stage's shard models."""
        version = cache.current()
        if manifest.get("merge_rate") != self.merge_rate:
            raise CacheError(f"{cache.root}: the cache was made for another number of clients or merge rate")
        stages = manifest.get("stages_done")
        if isinstance(stages, bool) or not isinstance(stages, int) or not 0 <= stages <= self.planned_stages:
            raise CacheError(f"{cache.root}: the manifest's stage count {stages!r} is malformed")
        structures = [
            cache.tensors(f"structure_{p}.safetensors", version=version, manifest=manifest)
            for p in range(1, stages + 1)
        ]
        gone = {int(c) for c in manifest.get("unlearned", [])}
        try:
            self.restore_structure(structures, gone)
        except (KeyError, TypeError, ValueError) as e:
            raise CacheError(f"{cache.root}: the cached tree is malformed ({e})") from None
        self.models = [
            cache.stack(f"stage_{p}", version=version, device=device, manifest=manifest)
            for p in range(1, stages + 1)
        ]
        self.stage_seconds = []
        self.committed(cache, version)
        if "round_policy_state" in manifest:
            self.round_policy.load_state_dict(manifest["round_policy_state"])

    def resumable(self, manifest: dict[str, Any]) -> bool:
        """A partial fit continues after its last complete stage."""
        return manifest.get("stages_done") is not None


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic GC while ~K records and their tuples are built.

    They all stay alive, so each collection would rescan the whole heap for nothing (0.55 s
    of CPU instead of 0.16 s for the tree and records at K = 65,536).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _same_tensors(a: Any, b: Any) -> bool:
    """The same tensor objects under the same names."""
    return (
        isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    )
