"""What an algorithm may see of the run: the context the trainer hands it, and the loop events.

An :class:`~fedshard_lightning.unlearning.base.Algorithm` never holds the trainer. The trainer
builds one :class:`AlgorithmContext` per run (engines over its model and data, the clients'
sample counts, the seed, the device, the process group) and passes it to
:meth:`Algorithm.setup <fedshard_lightning.unlearning.base.Algorithm.setup>`. The algorithm
reports progress through :class:`LoopEvents`; what happens on an event (callbacks, per-round
metrics, the cache commit after a stage) is the trainer's business. What-if analyses use the
default :class:`LoopEvents`, which does nothing, so a what-if never touches disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, RoundInfo
from fedshard_lightning.engine.ranks import Ranks

__all__ = ["AlgorithmContext", "LoopEvents"]


class LoopEvents:
    """Events an algorithm reports while it trains; every method is a no-op here.

    The trainer's subclass fires the callbacks, measures each round and commits FLCache at
    :meth:`stage_end` and :meth:`checkpoint`.
    """

    def stage_start(self, stage: int, groups: Sequence[Group]) -> None:
        """A stage's groups are about to train."""

    def stage_merge(self, stage: int, groups: Any, alphas: Any, rounds: Any) -> None:
        """The grouping and rounds of a new stage were decided."""

    def round_end(self, info: RoundInfo, state: dict[str, Tensor], groups: Sequence[Group]) -> None:
        """A FedAvg round of ``groups`` finished; ``state`` holds their models ``[groups, ...]``."""

    def stage_end(self, stage: int, metrics: dict[str, float] | None = None) -> None:
        """A stage is complete: the state is consistent and worth committing."""

    def groups_trained(self, stage: int, groups: Sequence[Group], client_steps: int) -> None:
        """An engine call finished (in fit, unlearn and audit alike): progress of the work."""

    def checkpoint(self, label: str) -> None:
        """Commit the state now (e.g. to free memory held for the next commit)."""

    def evaluate(self, params: dict[str, Tensor]) -> tuple[float, float]:
        """Test accuracy and loss of a model (NaN where no test set is wired)."""
        return float("nan"), float("nan")


@dataclass
class AlgorithmContext:
    """The run as an algorithm sees it; built by the trainer (or a test) and passed to ``setup``.

    Attributes:
        make_engine: Builds an engine over the run's model and data for a local schedule and a
            client fraction (the trainer's vectorization settings applied).
        client_sizes: Training samples per client (``K`` entries).
        seed: The training seed (keys every random choice).
        device: Where the model and data live.
        events: Receives the loop events.
        world_size: Processes training together (Fabric DDP); groups are split across them.
        global_rank: This process's rank.
        all_gather: Fabric's ``all_gather`` (needed when ``world_size > 1``).
    """

    make_engine: Callable[[LocalSchedule, float], FederatedEngine]
    client_sizes: list[int]
    seed: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    events: LoopEvents = field(default_factory=LoopEvents)
    world_size: int = 1
    global_rank: int = 0
    all_gather: Callable[[Tensor], Tensor] | None = None

    @property
    def ranks(self) -> Ranks:
        """The processes as the engine splits a stage across them (:class:`~fedshard_lightning.engine.ranks.Ranks`)."""
        if self.all_gather is None:
            raise ValueError("AlgorithmContext: splitting a stage across processes needs all_gather")
        return Ranks(self.world_size, self.global_rank, self.all_gather)

    @property
    def num_clients(self) -> int:
        """K, the number of clients of the partition."""
        return len(self.client_sizes)
