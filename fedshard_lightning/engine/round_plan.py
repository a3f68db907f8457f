"""What a round's participants fix before any training: chunks, owners, index tensors, weights.

A round of :meth:`~fedshard_lightning.engine.FederatedEngine.train_groups` needs, besides the
local training itself, the flat list of participants, the group owning each, the chunks and their
index tensors, and each group's FedAvg weight (its participants' samples). All of it is a function
of the participants alone, so one :class:`RoundPlan` serves every round with the same
participants: every round of a full-participation call, instead of being rebuilt each round (a
fixed cost that matters when a round trains one or two clients, as unlearning's do).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.engine.aggregate import row_meta

__all__ = ["Chunk", "RoundPlan"]


@dataclass(frozen=True)
class Chunk:
    """Participants trained together: ids, owning group, and their tensors."""

    clients: list[int]
    owners: list[int]
    owners_t: Tensor  # on the models' device
    owners_cpu: Tensor
    samples: Tensor  # sample counts in the models' dtype, on their device (FedAvg weights)
    samples_f64: Tensor  # the same in float64 on the CPU (the loss weights)
    meta: tuple[tuple[int, int, int], ...]  # each row's (group, block, slot) in the round's sums


@dataclass(frozen=True)
class RoundPlan:
    """The participant-only part of one round (see the module docstring)."""

    active: list[int]
    parts: list[list[int]]
    clients: list[int]
    counts: list[int]
    chunks: list[Chunk]
    weight: Tensor  # [G] float64: each group's participant samples (exact integers)
    active_t: Tensor  # on the models' device
    active_weight: Tensor  # weight of the active groups, in ``active`` order
    metric_norm: float  # the round's total samples (at least 1)

    @classmethod
    def build(
        cls,
        active: Sequence[int],
        parts: Sequence[Sequence[int]],
        n_groups: int,
        sizes: np.ndarray,
        chunk: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> RoundPlan:
        """The plan of groups ``active`` with participants ``parts``, in chunks of ``chunk`` clients."""
        clients = [int(c) for p in parts for c in p]
        owner = [int(i) for i, p in zip(active, parts) for _ in p]
        counts = [0] * n_groups
        for i, p in zip(active, parts):
            counts[i] = len(p)
        chunks = []
        seen = [0] * n_groups
        for lo in range(0, len(clients), chunk):
            cl, ow = clients[lo : lo + chunk], owner[lo : lo + chunk]
            n = sizes[cl]
            chunks.append(
                Chunk(
                    cl,
                    ow,
                    torch.as_tensor(ow, device=device),
                    torch.as_tensor(ow),
                    torch.as_tensor(n, dtype=dtype, device=device),
                    torch.as_tensor(n, dtype=torch.float64),
                    tuple(row_meta(ow, seen)),
                )
            )
        weight = np.bincount(np.asarray(owner, dtype=np.int64), weights=sizes[clients], minlength=n_groups)
        weight_t = torch.as_tensor(weight.astype(np.float64))
        return cls(
            active=list(active),
            parts=[list(p) for p in parts],
            clients=clients,
            counts=counts,
            chunks=chunks,
            weight=weight_t,
            active_t=torch.as_tensor(list(active), device=device),
            active_weight=weight_t[list(active)],
            metric_norm=max(float(sizes[clients].sum()), 1.0),
        )
