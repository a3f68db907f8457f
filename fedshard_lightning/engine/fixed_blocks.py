"""Stacked local training in calls of exactly ``q`` clients, where kernels vary with the client count.

``vmap``'s grouped kernels and every CUDA kernel may pick another algorithm for another number of
clients, so a client's bits would depend on who shares its chunk. There the engine trains a
chunk in calls of a constant ``q`` clients (:meth:`.FederatedEngine.invariant_block`), the last
one padded with inert copies of its last client whose results are dropped.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.engine.kernels.base import ClientBatch, LocalResult, Trainer

__all__ = ["train_in_blocks"]


def train_in_blocks(
    local: Trainer, q: int, state: dict[str, Tensor], rows: Tensor, batch: ClientBatch
) -> LocalResult:
    """``local.train_stacked`` of ``batch`` (state rows ``rows``) in fixed-shape calls of ``q`` clients."""
    parts = []
    for lo in range(0, len(batch.clients), q):
        cl, gr, rw = batch.clients[lo : lo + q], batch.groups[lo : lo + q], rows[lo : lo + q]
        real = len(cl)
        if real < q:  # inert copies of the last client keep the shape; their results are dropped
            pad = q - real
            cl, gr = cl + [cl[-1]] * pad, gr + [gr[-1]] * pad
            rw = torch.cat([rw, rw[-1:].expand(pad)])
        res = local.train_stacked(state, ClientBatch(cl, gr, batch.stage, batch.round), rw, fixed=True)
        parts.append((res, real))
    if len(parts) == 1 and parts[0][1] == q:
        return parts[0][0]
    return LocalResult(
        {k: torch.cat([r.params[k][:n] for r, n in parts]) for k in parts[0][0].params},
        np.concatenate([r.steps[:n] for r, n in parts]),
        torch.cat([r.loss_sum[:n] for r, n in parts]),
        {k: torch.cat([r.logs[k][:n] for r, n in parts]) for k in parts[0][0].logs},
    )
