"""One stacked step whose clients have different batch sizes (a partial last batch), for ``vmap`` kernels.

A ``vmap``'d ``training_step`` may reduce over the batch (a mean loss, BatchNorm statistics), so a
partial batch cannot be padded and masked. Both forms below call the step once per distinct batch
size at this step and keep, for every client, the result computed at its own size:

* :func:`mixed_sizes_fixed` computes every size for all rows, so the kernel's shape never depends
  on which clients share the call (bit-exact whatever the neighbours; ``fixed=True``);
* :func:`mixed_sizes_split` computes each size only for the rows that have it (less arithmetic).

A parameter the step leaves unused gets no gradient (None) at every size, and stays None.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["mixed_sizes_fixed", "mixed_sizes_split"]


def _rows_where(own: Tensor, new: Tensor, old: Tensor) -> Tensor:
    return torch.where(own.view(-1, *[1] * (new.ndim - 1)), new, old)


def mixed_sizes_fixed(
    local: Any,
    leaves: dict[str, Tensor],
    buffers: dict[str, Tensor],
    cbuf: dict[str, Tensor],
    gidx: Tensor,
    sizes: np.ndarray,
    size_t: Tensor,
    keys: Tensor,
    loss_sum: Tensor,
    logs: dict[str, Tensor],
) -> dict[str, Tensor | None]:
    """Gradients of all ``m`` rows, each at its own batch size, every size computed for every row (None: unused).

    Args:
        local: The :class:`~fedshard_lightning.engine.local.LocalTrainer` (its ``dm``, ``dtype``,
            ``_grad`` and ``_add_logs``).
        leaves: The rows' parameters (``[m, ...]``, requiring grad).
        buffers: Shared (non-client) buffers.
        cbuf: The rows' own buffers, updated in place to the values of their own size.
        gidx: Sample indices ``[m, B]`` of this step.
        sizes: Batch size of every row ``[m]`` on the host (0: the row has finished).
        size_t: The same on the device.
        keys: Random key of every row at this step ``[m]``.
        loss_sum: Per-row loss sums ``[M]``; rows ``:m`` are added to.
        logs: Per-row sums of what ``training_step`` logged.
    """
    m, m_all = gidx.shape[0], loss_sum.shape[0]
    grads: dict[str, Tensor | None] = dict.fromkeys(leaves)
    before = {k: v.clone() for k, v in cbuf.items()}
    after = {k: v.clone() for k, v in cbuf.items()}
    for size in np.unique(sizes[sizes > 0]):
        x, y = local.dm.gather(gidx[:, :size], local.dtype)
        for k, v in cbuf.items():
            v.copy_(before[k])
        g_all, l_all, logged = local._grad(leaves, buffers, x, y, keys=keys, client_buffers=cbuf)
        own = size_t == int(size)
        for k, v in cbuf.items():
            after[k] = _rows_where(own, v, after[k])
        for k, g in g_all.items():
            if g is not None:
                grads[k] = _rows_where(own, g, torch.zeros_like(g) if grads[k] is None else grads[k])
        loss_sum[:m] += torch.where(own, l_all, torch.zeros_like(l_all))
        kept = {k: torch.where(own, v, torch.zeros_like(v)) for k, v in logged.items()}
        local._add_logs(logs, kept, m_all, slice(0, m))
    for k, v in cbuf.items():
        v.copy_(after[k])
    return grads


def mixed_sizes_split(
    local: Any,
    leaves: dict[str, Tensor],
    buffers: dict[str, Tensor],
    cbuf: dict[str, Tensor],
    gidx: Tensor,
    sizes: np.ndarray,
    keys: Tensor,
    loss_sum: Tensor,
    logs: dict[str, Tensor],
) -> dict[str, Tensor | None]:
    """Gradients of the ``m = len(sizes)`` first rows, each size computed only for its own rows (None: unused).

    Args are those of :func:`mixed_sizes_fixed`, except ``sizes`` (numpy, ``[m]``) and ``gidx`` and
    ``keys``, which may hold more rows than ``m`` (only the first ``m`` are read).
    """
    m_all = loss_sum.shape[0]
    device = loss_sum.device
    grads: dict[str, Tensor | None] = dict.fromkeys(leaves)
    for size in np.unique(sizes):
        sel = torch.as_tensor(np.flatnonzero(sizes == size), device=device)
        x, y = local.dm.gather(gidx[sel, :size], local.dtype)
        sub = {k: v.index_select(0, sel) for k, v in leaves.items()}
        sub_buf = {k: v.index_select(0, sel) for k, v in cbuf.items()}
        g_sub, l_sub, logged = local._grad(
            sub, buffers, x, y, keys=keys.index_select(0, sel), client_buffers=sub_buf
        )
        for k, v in cbuf.items():
            v.index_copy_(0, sel, sub_buf[k])
        for k, g in g_sub.items():
            if g is not None:
                if grads[k] is None:
                    grads[k] = torch.zeros_like(leaves[k])
                grads[k].index_copy_(0, sel, g)
        loss_sum.index_add_(0, sel, l_sub)
        local._add_logs(logs, logged, m_all, sel)
    return grads
