"""The stacked clients' optimizer stepped row by row, so that half precision on the CPU is batch-invariant.

The CPU's element-wise kernels run a contiguous tensor in vector chunks and its last
``numel mod chunk`` elements in a scalar loop. For bfloat16 and float16 ``p.add_(g, alpha=-lr)``
(SGD's update, momentum and weight decay) rounds differently in the two: the vector loop fuses the
multiply-add in float32 and rounds once, the scalar loop rounds ``alpha * g`` to the dtype before
adding. Which elements of a stacked ``[clients, ...]`` parameter fall in the scalar loop depends
on the client's row, so a client's update depended on where it sat in the call (up to 1e-3 on
digits in bf16), and an unlearning replay, which trains a client among other neighbours, failed
its audit. In float32 and float64 both loops give the same bits (measured for SGD with and
without momentum, Adam, AdamW, RMSprop, Adagrad), so the stacked optimizer is kept there.

Stepping each client's row as its own tensor gives every client the chunking the per-client
loop's optimizer gives it, whatever its row. CUDA kernels compute every element with the same
float32 functor (vectorized or not), so only the CPU needs this.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedshard_lightning.engine.optim import OptimizerSpec

__all__ = ["RowOptimizer", "needs_rows"]

_HALF = (torch.bfloat16, torch.float16)


def needs_rows(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether stacked parameters of this dtype on this device need :class:`RowOptimizer`."""
    return dtype in _HALF and device.type == "cpu"


class RowOptimizer:
    """``spec``'s optimizer over each client's row of the stacked leaves, every row its own tensor.

    The rows are views of the leaves, so updates land in the stacked tensors. It offers what the
    stacked loop needs of an optimizer: :meth:`step` (reads the leaves' ``.grad``) and
    :meth:`shrink` (keep the first ``m`` clients).

    Args:
        spec: The client optimizer.
        leaves: Stacked parameters ``[clients, ...]`` by (prefixed) name.
        prefix: Prefix of the names in ``leaves``.
    """

    def __init__(self, spec: OptimizerSpec, leaves: dict[str, Tensor], prefix: str = "") -> None:
        self.leaves = leaves
        self.rows = {k: list(v.detach().unbind(0)) for k, v in leaves.items()}
        self.opt = spec.cls(
            [{"params": [r for n in names for r in self.rows[prefix + n]], **hp} for names, hp in spec.groups]
        )

    def step(self) -> None:
        """One step of every row from its row of the leaf's gradient (none: the row is skipped)."""
        for k, v in self.leaves.items():
            g = v.grad
            for i, r in enumerate(self.rows[k]):
                r.grad = None if g is None else g[i]
        self.opt.step()
        for rows in self.rows.values():
            for r in rows:
                r.grad = None

    def shrink(self, leaves: dict[str, Tensor], m: int) -> None:
        """Keep the first ``m`` clients: ``leaves`` are the new leaves (views of the old ones' rows ``:m``)."""
        gone = {id(r) for rows in self.rows.values() for r in rows[m:]}
        for group in self.opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in gone]
        for rows in self.rows.values():
            for r in rows[m:]:
                self.opt.state.pop(r, None)
        self.rows = {k: rows[:m] for k, rows in self.rows.items()}
        self.leaves = leaves
