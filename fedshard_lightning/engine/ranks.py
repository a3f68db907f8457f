"""A stage split across processes (Fabric DDP): who trains which groups, and the rounds merged back.

:class:`Ranks` names the processes; :meth:`FederatedEngine.train_groups_split
<fedshard_lightning.engine.engine.FederatedEngine.train_groups_split>` trains this rank's share of
a stage and gathers every group's model, in order. Under DDP rank ``r`` trains groups
``r, r + W, ...`` and sees only their rounds. Reporting those
live would make every per-round metric (train loss, participants, client-steps, test accuracy)
describe one rank's share of the stage. :class:`RoundRecorder` keeps, for each round, the rank's
summary and the sample-weighted sum of its groups' models (weights normalised over all groups of
the stage); after the stage the ranks exchange them, and every rank reports the same merged
rounds: what a single process would have reported, up to the order of the float sums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fedshard_lightning.engine.groups import Group, RoundInfo

__all__ = ["Ranks", "RoundRecorder"]


@dataclass(frozen=True)
class Ranks:
    """The processes that train one stage together.

    Attributes:
        world_size: Number of processes.
        rank: This process's rank.
        all_gather: Gathers a tensor from every rank, stacked ``[world_size, ...]`` (Fabric's).
    """

    world_size: int
    rank: int
    all_gather: Callable[[Tensor], Tensor]

    def share(self, num_groups: int) -> list[int]:
        """Indices of the groups this rank trains: ``rank, rank + W, ...``."""
        return list(range(self.rank, num_groups, self.world_size))

    def gather_rows(self, rows: Tensor, num_groups: int) -> Tensor:
        """Every rank's rows (this rank's share, in :meth:`share` order) as one tensor in group order."""
        per = -(-num_groups // self.world_size)
        padded = torch.zeros(per, *rows.shape[1:], dtype=rows.dtype, device=rows.device)
        padded[: rows.shape[0]] = rows
        gathered = self.all_gather(padded)  # [world, per, ...]
        return torch.stack([gathered[g % self.world_size, g // self.world_size] for g in range(num_groups)])


class RoundRecorder:
    """One rank's rounds of a stage (see the module docstring).

    Args:
        groups: All groups of the stage, in order.
        mine: Indices into ``groups`` of this rank's groups.
        client_sizes: Training samples per client.
        template: Any stacked state of the stage (only its names, shapes and dtypes are used).
    """

    def __init__(
        self,
        groups: Sequence[Group],
        mine: Sequence[int],
        client_sizes: Sequence[int],
        template: dict[str, Tensor],
    ) -> None:
        self.groups, self.mine, self.sizes = list(groups), list(mine), client_sizes
        weight = [float(sum(client_sizes[c] for c in g.clients)) for g in groups]
        total = sum(weight) or 1.0
        self.weight = torch.tensor([weight[g] / total for g in mine], dtype=torch.float64)
        self.records: list[dict[str, Any]] = []
        self.sums: list[dict[str, Tensor]] = []
        self.empty = {
            k: torch.zeros(v.shape[1:], dtype=v.dtype, device=v.device) for k, v in template.items()
        }

    def record(self, info: RoundInfo, state: dict[str, Tensor]) -> None:
        """Keep the round's summary (global group indices) and this rank's weighted model sum."""
        self.records.append(
            {
                "stage": int(info.stage),
                "active": [self.mine[a] for a in info.active],
                "participants": [list(p) for p in info.participants],
                "mean_loss": list(info.mean_loss),
                "client_steps": int(info.client_steps),
                "seconds": float(info.seconds),
                "samples": float(sum(self.sizes[c] for c in info.client_ids)),
                "metrics": dict(info.metrics),
            }
        )
        w = self.weight
        self.sums.append({k: (v * w.to(v).view(-1, *[1] * (v.ndim - 1))).sum(0) for k, v in state.items()})

    def merged(
        self, gather: Callable[[Tensor], Tensor]
    ) -> Iterator[tuple[RoundInfo, dict[str, Tensor], list[Group]]]:
        """Exchange the records (a collective: every rank must call it) and yield the merged rounds.

        Yields ``(info, state, groups)`` for :meth:`LoopEvents.round_end`: ``state`` holds one row,
        the stage's sample-weighted average model, and ``groups`` one group of all the stage's
        clients, so the trainer's own weighted average returns that row unchanged.
        """
        device = next(iter(self.empty.values())).device
        n_rounds = int(gather(torch.tensor([len(self.records)], device=device)).max())
        last = self.sums[-1] if self.sums else self.empty
        padded = {
            k: torch.stack([s[k] for s in self.sums] + [last[k]] * (n_rounds - len(self.sums)))
            for k in self.empty
        }
        averages = {k: gather(v).sum(0) for k, v in padded.items()}  # [rounds, ...]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.records)
        clients = tuple(c for g in self.groups for c in g.clients)
        whole = [Group(0, clients, n_rounds)]
        for r in range(n_rounds):
            yield (
                _merge(r, [recs[r] for recs in everyone if r < len(recs)]),
                {k: v[r : r + 1] for k, v in averages.items()},
                whole,
            )


def _merge(r: int, parts: list[dict[str, Any]]) -> RoundInfo:
    """One round's summaries of every rank as the single-process record (groups in stage order)."""
    rows = sorted(
        (g, p, loss)
        for part in parts
        for g, p, loss in zip(part["active"], part["participants"], part["mean_loss"])
    )
    samples = sum(part["samples"] for part in parts) or 1.0
    metrics: dict[str, float] = {}
    for part in parts:
        for name, value in part["metrics"].items():
            metrics[name] = metrics.get(name, 0.0) + value * part["samples"] / samples
    return RoundInfo(
        stage=parts[0]["stage"],
        round=r,
        active=[g for g, _, _ in rows],
        participants=[p for _, p, _ in rows],
        mean_loss=[loss for _, _, loss in rows],
        client_steps=sum(part["client_steps"] for part in parts),
        seconds=max(part["seconds"] for part in parts),
        client_ids=[c for _, p, _ in rows for c in p],
        metrics=metrics,
    )
