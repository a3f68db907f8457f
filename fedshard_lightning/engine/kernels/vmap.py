"""``torch.func.vmap`` of the user's own ``training_step``: the stacked kernel for any model.

The chain and the fx program (:mod:`.chain`, :mod:`.fx`) only train a model whose loss is a mean
of ``per_sample_loss`` made of operators known to act on each sample alone. Everything else (a
custom ``training_step``, BatchNorm buffers, ``self.log``, dropout, untraceable Python) still
trains stacked here: ``vmap`` maps the user's step over the clients' parameter rows, and one
``autograd.grad`` of the sum of the client losses gives every client its own gradient (client
c's loss depends only on its own row). It pays Python dispatch on every operator of every step,
so it is the slowest stacked kernel; where ``vmap`` cannot batch a step exactly
(:mod:`fedshard_lightning.engine.vmap_limits`), training raises ``NotVectorizable`` and the
engine trains on the per-client loop (:mod:`.loop`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from fedshard_lightning.engine.kernels.base import Probe, StackedKernel
from fedshard_lightning.engine.step_context import StepContext, step_loss
from fedshard_lightning.module import takes_batch_idx

__all__ = ["VMAP", "StepCaller", "VmapKernel"]


class StepCaller(nn.Module):
    """Makes ``training_step`` the forward of a module, so ``functional_call`` can swap parameters.

    It returns the loss and the values the step logged, and gives the step its client's key and
    ``batch_idx`` (the local step, the same for every client of a stacked call, as on the loop).
    """

    def __init__(self, module: nn.Module, ctx: StepContext) -> None:
        super().__init__()
        self.m = module
        self.ctx = ctx
        self.batch_idx = 0
        self._with_idx = takes_batch_idx(module)

    def _step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        """``training_step``, given ``batch_idx`` only where it takes one (``training_step(batch)``)."""
        return self.m.training_step(batch, batch_idx) if self._with_idx else self.m.training_step(batch)

    def forward(self, x: Tensor, y: Tensor, key: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The step's loss and logged values on one client's batch, with its step key."""
        self.ctx.begin(key, stacked=True)
        try:
            loss = step_loss(self._step((x, y), self.batch_idx), type(self.m).__name__)
        finally:
            logged = self.ctx.end()
        return loss, logged


class VmapKernel(StackedKernel):
    """``vmap`` of the user's ``training_step`` as a kernel: it never refuses a model up front."""

    name = "vmap"
    reason = "any model, stacked through vmap of its own training_step; slower than chain and fx"
    batch_invariant = False  # grouped convolutions and batched GEMMs may change with the call's size

    def unsupported(self, probe: Probe) -> str | None:
        """None: what ``vmap`` cannot batch exactly shows when it trains (``NotVectorizable``)."""
        return None

    def parts(self, probe: Probe) -> tuple[None, None]:
        """Neither a program nor a chain: the driver maps the user's step."""
        return None, None


VMAP = VmapKernel()
