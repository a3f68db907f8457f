"""Rows of stacked models mixed term by term: a shard's initial model from its children's.

A shard's initial model is the weighted average of its live children, computed for every shard
in ``fit`` and ``audit`` and for the affected ones only in ``unlearn``; both must give the same
bits, so no matrix product over the rows (whose sums could depend on the other rows) is used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["mix_rows"]


def mix_rows(
    models: dict[str, Tensor],
    mixes: Sequence[Sequence[tuple[int, float]]],
    fresh: tuple[Sequence[int], dict[str, Tensor]] | None = None,
) -> dict[str, Tensor]:
    """Rows ``sum_j w_j * models[i_j]`` for each list of (row, weight) pairs, in list order.

    A shard's initial model (the weighted average of its children) must not depend on which other
    shards are computed with it (all of them in ``fit`` and ``audit``, only the affected ones in
    ``unlearn``); a matrix product over the rows would. Here each output row is accumulated
    element-wise, term by term.

    Args:
        models: Stacked models [N, ...] by name.
        mixes: For each output row, its (input row, weight) terms; weights are cast to the models' dtype.
        fresh: ``(rows, tensors)``: these rows of ``models`` are read from ``tensors`` [len(rows), ...]
            instead (an unlearning request's retrained shards, before they are put in their stage).
    """
    n = len(mixes)
    depth = max((len(m) for m in mixes), default=0)
    terms = []  # per term position j: (rows picked, their weights, output rows): the same for every tensor
    for j in range(depth):
        sel = [i for i, m in enumerate(mixes) if len(m) > j]
        terms.append(([mixes[i][j][0] for i in sel], [mixes[i][j][1] for i in sel], sel))
    used = sorted({r for rows, _, _ in terms for r in rows})
    fresh_at = {r: i for i, r in enumerate(fresh[0])} if fresh is not None else {}
    old = [r for r in used if r not in fresh_at]
    new = [r for r in used if r in fresh_at]
    at = {r: i for i, r in enumerate(old + new)}  # the source matrix: the kept rows, then the fresh ones
    pick = [at[r] for rows, _, _ in terms for r in rows]  # its row for every term, in term order
    kinds: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for k, v in models.items():
        kinds.setdefault((v.dtype, v.device), []).append(k)
    weights = torch.tensor([w for _, ws, _ in terms for w in ws], dtype=torch.float64)
    out = {}
    for (dtype, dev), names in kinds.items():  # all tensors of a dtype as one [rows, D] matrix
        size = [math.prod(models[k].shape[1:]) for k in names]
        src = _flat_rows(models, names, old, dev)
        if new:
            src = torch.cat([src, _flat_rows(fresh[1], names, [fresh_at[r] for r in new], dev)], 0)  # type: ignore[index]
        if pick != list(range(len(pick))):
            src = src.index_select(0, torch.as_tensor(pick, device=dev))
        weighted = src * weights.to(dtype=dtype, device=dev).view(-1, 1)  # every term, in term order
        acc = src.new_zeros((n, src.shape[1]))
        lo = 0
        for rows, _, sel in terms:  # element-wise, term by term: the bits of a sum per tensor
            acc.index_add_(0, torch.as_tensor(sel, device=dev), weighted[lo : lo + len(rows)])
            lo += len(rows)
        off = 0
        for k, numel in zip(names, size):
            out[k] = acc[:, off : off + numel].view(n, *models[k].shape[1:])
            off += numel
    return {k: out[k] for k in models}


def _flat_rows(
    models: dict[str, Tensor], names: Sequence[str], rows: Sequence[int], dev: torch.device
) -> Tensor:
    """These rows of these tensors as one [len(rows), D] matrix."""
    if len(rows) == 1:  # slices, not an index tensor
        return torch.cat([models[k][rows[0] : rows[0] + 1].reshape(1, -1) for k in names], 1)
    if not rows:
        return models[names[0]].new_zeros((0, sum(math.prod(models[k].shape[1:]) for k in names)))
    rows_t = torch.as_tensor(rows, device=dev)
    return torch.cat([models[k].index_select(0, rows_t).reshape(len(rows), -1) for k in names], 1)
