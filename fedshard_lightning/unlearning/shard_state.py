"""What FedShard keeps of its frozen shard tree, and how that state becomes FLCache files.

:class:`ShardRecord` is a shard's metadata (children, clients, merge weight, alpha, rounds, the
clients that remain after unlearning); the shard models are stacked per stage. :class:`ShardCache`
gives :class:`~fedshard_lightning.unlearning.fedshard.FedShard` its ``cache_files`` /
``restore_cache``: one ``stage_<p>.safetensors`` per stage and the records in the manifest, with
the stages that did not change since the last commit hard-linked instead of rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.cache import FLCache
from fedshard_lightning.errors import CacheError
from fedshard_lightning.sharding import ShardTree

__all__ = ["ShardCache", "ShardRecord"]


@dataclass
class ShardRecord:
    """What FLCache keeps of a shard besides its model."""

    children: list[int]
    clients: list[int]
    weight: float
    alpha: float
    rounds: int
    remaining: list[int]

    @property
    def empty(self) -> bool:
        """No client of this shard remains (it disappeared after unlearning)."""
        return not self.remaining

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "children": self.children,
            "clients": self.clients,
            "weight": self.weight,
            "alpha": self.alpha,
            "rounds": self.rounds,
            "remaining": self.remaining,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardRecord:
        """Inverse of :meth:`to_dict`."""
        return cls(
            [int(c) for c in d["children"]],
            [int(c) for c in d["clients"]],
            float(d["weight"]),
            float(d["alpha"]),
            int(d["rounds"]),
            [int(c) for c in d["remaining"]],
        )


class ShardCache:
    """FedShard's persistence (a mixin: it reads the tree, records and stage models of the state)."""

    tree: ShardTree
    records: list[list[ShardRecord]]
    models: list[dict[str, Tensor]]
    merge_rate: int
    _committed: tuple[str, str, dict[int, dict[str, Tensor]]] | None = None
    """(cache root, version, {stage: models}): the in-memory stage models that are the files of that
    committed version, so the next commit hard-links the stages that did not change."""

    def cache_files(
        self, cache: FLCache
    ) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict[str, str]]:
        """Every completed stage's shard models and the tree's records (unchanged stages hard-linked)."""
        fields = {
            "merge_rate": self.merge_rate,
            "planned_stages": self.planned_stages,
            "client_sizes": list(self._sizes),
            "tree": self.tree.to_dict(),
            "stages": [[r.to_dict() for r in recs] for recs in self.records],
            "round_policy_state": self.round_policy.state_dict(),
        }
        tensors, reuse = {}, {}
        base_version = cache.current() if cache.exists() else None
        base = cache.manifest(base_version) if base_version is not None else None
        for p, m in enumerate(self.models, start=1):
            fname = f"stage_{p}.safetensors"
            if (
                base is not None
                and fname in base["files"]
                and self._stage_unchanged(p, base, cache, base_version)
            ):
                reuse[fname] = fname
            else:
                tensors[fname] = m
        return fields, tensors, reuse

    def committed(self, cache: FLCache, version: str) -> None:
        """Remember that the current stage models are the files of ``version``."""
        self._committed = (str(cache.root), version, dict(enumerate(self.models, start=1)))

    def _stage_unchanged(self, stage: int, base: dict[str, Any], cache: FLCache, base_version: str) -> bool:
        """Whether stage ``stage``'s file in ``base_version`` holds exactly the current records and models.

        True for the stages a fit committed before (each stage commit hard-links the earlier
        stages instead of rewriting them) and for stages loaded from ``base_version``.
        """
        stages = base.get("stages", [])
        committed = self._committed
        return (
            committed is not None
            and committed[0] == str(cache.root)
            and committed[1] == base_version
            and committed[2].get(stage) is self.models[stage - 1]
            and len(stages) >= stage
            and stages[stage - 1] == [r.to_dict() for r in self.records[stage - 1]]
        )

    def restore_cache(self, cache: FLCache, manifest: dict[str, Any], device: torch.device) -> None:
        """Restore the tree, the records and every stage's shard models."""
        version = cache.current()
        if manifest.get("merge_rate") != self.merge_rate:
            raise CacheError(f"{cache.root}: the cache was made for another number of clients or merge rate")
        try:
            self.tree = ShardTree.from_dict(manifest["tree"])
            self.records = [[ShardRecord.from_dict(r) for r in recs] for recs in manifest["stages"]]
        except (KeyError, TypeError, ValueError) as e:
            raise CacheError(f"{cache.root}: the manifest's tree is malformed ({e})") from None
        self.models = [
            cache.tensors(f"stage_{p}.safetensors", version=version, device=device, manifest=manifest)
            for p in range(1, len(self.records) + 1)
        ]
        self.stage_seconds = []
        self.committed(cache, version)
        if "round_policy_state" in manifest:
            self.round_policy.load_state_dict(manifest["round_policy_state"])

    def resumable(self, manifest: dict[str, Any]) -> bool:
        """A partial fit continues after its last complete stage."""
        return manifest.get("stages") is not None
