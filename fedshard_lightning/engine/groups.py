"""What the engine trains and returns: groups of clients, per-round records, results, stacked models."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.errors import ContractError, NonFiniteLossError

if TYPE_CHECKING:
    from fedshard_lightning.engine.local import LocalResult
    from fedshard_lightning.engine.round_plan import Chunk

__all__ = [
    "Group",
    "RoundInfo",
    "TrainResult",
    "add_logged",
    "check_finite",
    "one_sample_batchnorm",
    "stack_params",
    "unstack_params",
]


@dataclass(frozen=True)
class Group:
    """A set of clients trained together by FedAvg (a shard, or all clients for plain FedAvg).

    Args:
        key: Stable identifier used in the keyed randomness (the shard's index in its stage).
        clients: Client ids.
        rounds: FedAvg rounds for this group.
    """

    key: int
    clients: tuple[int, ...]
    rounds: int


@dataclass
class RoundInfo:
    """What happened in one round, passed to ``on_round_end``."""

    stage: int
    round: int
    active: list[int]
    participants: list[list[int]]
    mean_loss: list[float]
    client_steps: int
    seconds: float
    start_params: dict[str, Tensor] | None = None
    client_params: dict[str, Tensor] | None = None
    client_ids: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainResult:
    """Final group models [G, ...], cost counters and the per-round record."""

    params: dict[str, Tensor]
    client_steps: int
    group_client_steps: list[int]
    rounds_run: list[int]
    seconds: float
    history: list[RoundInfo]


def stack_params(models: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack a list of state dicts along a new leading dimension."""
    return {k: torch.stack([m[k] for m in models]) for k in models[0]}


def unstack_params(params: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    """Row ``i`` of stacked parameters, as a state dict."""
    return {k: v[i] for k, v in params.items()}


def check_finite(
    losses: np.ndarray, clients: list[int], owner: list[int], groups: Sequence[Group], stage: int, r: int
) -> None:
    """Raise :class:`NonFiniteLossError` naming the first client of round ``r`` whose loss is not finite."""
    finite = np.isfinite(losses)
    if finite.all():
        return
    j = int(np.flatnonzero(~finite)[0])
    raise NonFiniteLossError(
        f"non-finite training loss at stage {stage}, shard {groups[owner[j]].key}, round {r}, client {clients[j]}; "
        "lower model.lr or check the client's data"
    )


def add_logged(logged: dict[str, float], res: LocalResult, chunk: Chunk) -> None:
    """Add the sample-weighted per-client means of the values the training step logged.

    A client's value in a round is the mean over its local steps; the round's value is the
    FedAvg-weighted mean over the participants (divided by their total samples at the end).
    """
    if not res.logs:
        return
    n = chunk.samples_f64
    steps = torch.as_tensor(np.maximum(res.steps, 1), dtype=torch.float64)
    for k, v in res.logs.items():
        logged[k] = logged.get(k, 0.0) + float((n * v.detach().cpu().double() / steps).sum())


@contextmanager
def one_sample_batchnorm(model: str, where: str) -> Iterator[None]:
    """Turn BatchNorm's one-sample-batch ``ValueError`` into a one-line :class:`ContractError`.

    Wraps every call that trains clients, the ``vectorize`` probe and check included: they run
    the first round's batches before the round itself does, so they meet a client's one-sample
    last batch first.
    """
    try:
        yield
    except ValueError as err:
        if "Expected more than 1 value per channel" not in str(err):
            raise
        raise ContractError(
            f"{model}: a BatchNorm layer got a one-sample batch ({where}; a client's last batch); "
            "use a batch size that leaves no client one sample, or nn.GroupNorm"
        ) from None
