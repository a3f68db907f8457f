"""What FedShard keeps of a shard besides its model: :class:`ShardRecord`, an immutable value.

A record is part of FedShard's planner state (one tuple of records per stage). FLCache stores only
its frozen part (children, alpha, rounds, as ``structure_<p>.safetensors``); clients, remaining
clients and weights follow from the tree, the unlearned clients and the client weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ShardRecord"]


@dataclass(frozen=True)
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
