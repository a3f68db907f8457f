"""Local training of many clients in one round: stacked (vmap) and per-client loop, same math.

Both functions take the clients' starting parameters stacked along a leading dimension and return
their final parameters stacked the same way. The stacked version sorts clients by their number of
steps (clients with more data take more steps); at every step the clients still training are a
prefix of that order, so finished clients are retired (their parameters copied out) and the
optimizer state is sliced, never masked. Partial last batches are handled exactly by calling the
training step once per distinct batch size at that step, so the user's loss needs no masking.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.engine.optim import OptimizerSpec, normalize_optimizer, shrink_optimizer
from fedshard_lightning.engine.schedule import LocalSchedule
from fedshard_lightning.module import FederatedModule

__all__ = ["ClientBatch", "LocalTrainer"]

_PREFIX = "m."


class _StepCaller(nn.Module):
    """Makes ``training_step`` the forward of a module, so ``functional_call`` can swap parameters."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.m = module

    def forward(self, x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is None:
            return self.m.training_step((x, y), 0)
        # Padded batch: the mean over the real samples, as training_step would compute it.
        return (self.m.per_sample_loss((x, y)) * mask).sum() / mask.sum()


@dataclass
class ClientBatch:
    """The clients of one local-training call and where their randomness comes from."""

    clients: list[int]
    groups: list[int]
    stage: int
    round: int


@dataclass
class LocalResult:
    """Final parameters [m, ...] by name, steps per client and summed loss per client."""

    params: dict[str, Tensor]
    steps: np.ndarray
    loss_sum: Tensor


class LocalTrainer:
    """Runs one round of local training for a batch of clients, vectorized or in a loop."""

    def __init__(
        self,
        module: nn.Module,
        datamodule: FederatedDataModule,
        schedule: LocalSchedule,
        spec: OptimizerSpec,
        names: Sequence[str],
        seed: int,
    ) -> None:
        self.module = module
        self.dm = datamodule
        self.schedule = schedule
        self.spec = spec
        self.names = list(names)
        self.seed = seed
        self.dtype = next(module.parameters()).dtype
        self._caller = _StepCaller(module)
        self._fwd = vmap(self._loss, in_dims=(0, None, 0, 0))
        self._fwd_masked = vmap(self._loss, in_dims=(0, None, 0, 0, 0))
        # The default training_step is a mean of per_sample_loss: partial batches can then be
        # padded and masked (one call per step) instead of one call per distinct batch size.
        self.maskable = isinstance(module, FederatedModule) and (
            type(module).training_step is FederatedModule.training_step
        )
        self._worker: nn.Module | None = None
        self.loop_uses_spec = False
        self._client_np = [ix.cpu().numpy() for ix in datamodule.client_indices]

    def _loss(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        x: Tensor,
        y: Tensor,
        mask: Tensor | None = None,
    ) -> Tensor:
        return functional_call(self._caller, (params, buffers), (x, y, mask))

    def _grad(
        self,
        leaves: dict[str, Tensor],
        buffers: dict[str, Tensor],
        x: Tensor,
        y: Tensor,
        mask: Tensor | None = None,
    ) -> tuple[dict[str, Tensor], Tensor]:
        """Per-client gradients: vmapped forward, one backward of the summed client losses.

        Client c's loss depends only on its own parameter slice, so the gradient of the sum
        with respect to that slice is exactly client c's gradient.
        """
        with torch.enable_grad():
            losses = (
                self._fwd(leaves, buffers, x, y)
                if mask is None
                else self._fwd_masked(leaves, buffers, x, y, mask)
            )
            grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
        return dict(zip(leaves, grads)), losses.detach()

    def schedules(self, batch: ClientBatch) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Global sample indices [steps, B] and batch sizes [steps] of every client."""
        idx, sizes = [], []
        for c, g in zip(batch.clients, batch.groups):
            own = self._client_np[c]
            pos, sz = self.schedule.batches(len(own), self.seed, batch.stage, g, batch.round, c)
            idx.append(own[pos])
            sizes.append(sz)
        return idx, sizes

    # -- stacked ---------------------------------------------------------------------------------
    def train_stacked(self, start: dict[str, Tensor], batch: ClientBatch) -> LocalResult:
        """All clients of ``batch`` at once under vmap; equal to :meth:`train_loop`."""
        idx_list, size_list = self.schedules(batch)
        m_all = len(batch.clients)
        steps = np.array([len(s) for s in size_list], dtype=np.int64)
        order = np.argsort(-steps, kind="stable")
        s_max = int(steps.max()) if m_all else 0
        b = self.schedule.batch_size
        device = next(iter(start.values())).device
        gidx = np.zeros((s_max, m_all, b), dtype=np.int64)
        gsz = np.zeros((s_max, m_all), dtype=np.int64)
        for j, i in enumerate(order):
            gidx[: steps[i], j] = idx_list[i]
            gsz[: steps[i], j] = size_list[i]
        gidx_t = torch.as_tensor(gidx, device=device)
        order_t = torch.as_tensor(order, device=device)
        out = {n: torch.empty_like(start[n]) for n in self.names}
        leaves = {_PREFIX + n: start[n].index_select(0, order_t).requires_grad_() for n in self.names}
        buffers = {_PREFIX + n: b_ for n, b_ in self.module.named_buffers()}
        opt = self.spec.build(leaves, _PREFIX)
        loss_sum = torch.zeros(m_all, dtype=self.dtype, device=device)
        steps_sorted = steps[order]
        m = m_all
        self.module._in_federated_step = True
        try:
            for s in range(s_max):
                m_s = int((steps_sorted > s).sum())
                if m_s < m:
                    self._retire(out, leaves, order_t, m_s, m)
                    new = {k: v.detach()[:m_s].requires_grad_() for k, v in leaves.items()}
                    shrink_optimizer(opt, list(leaves.values()), list(new.values()), m_s)
                    leaves, m = new, m_s
                sizes = gsz[s, :m]
                if (sizes == b).all():
                    x, y = self.dm.gather(gidx_t[s, :m], self.dtype)
                    grads, losses = self._grad(leaves, buffers, x, y)
                    loss_sum[:m] += losses
                elif self.maskable:
                    x, y = self.dm.gather(gidx_t[s, :m], self.dtype)
                    mask = (
                        torch.arange(b, device=device) < torch.as_tensor(sizes, device=device)[:, None]
                    ).to(self.dtype)
                    grads, losses = self._grad(leaves, buffers, x, y, mask)
                    loss_sum[:m] += losses
                else:
                    grads = {k: torch.zeros_like(v) for k, v in leaves.items()}
                    for size in np.unique(sizes):
                        sel = torch.as_tensor(np.flatnonzero(sizes == size), device=device)
                        x, y = self.dm.gather(gidx_t[s, sel, :size], self.dtype)
                        sub = {k: v.index_select(0, sel) for k, v in leaves.items()}
                        g_sub, l_sub = self._grad(sub, buffers, x, y)
                        for k in grads:
                            grads[k].index_copy_(0, sel, g_sub[k])
                        loss_sum.index_add_(0, sel, l_sub)
                for k, v in leaves.items():
                    v.grad = grads[k]
                opt.step()
                for v in leaves.values():
                    v.grad = None
        finally:
            self.module._in_federated_step = False
        self._retire(out, leaves, order_t, 0, m)
        inv = torch.empty_like(order_t)
        inv[order_t] = torch.arange(m_all, device=device)
        return LocalResult(out, steps, loss_sum.index_select(0, inv))

    @staticmethod
    def _retire(out: dict[str, Tensor], leaves: dict[str, Tensor], order: Tensor, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        rows = order[lo:hi]
        for k, v in leaves.items():
            out[k[len(_PREFIX) :]].index_copy_(0, rows, v[lo:hi].detach())

    # -- per-client loop (reference and fallback) -----------------------------------------------
    def train_loop(self, start: dict[str, Tensor], batch: ClientBatch) -> LocalResult:
        """One client after the other with the user's own optimizer and ``backward``."""
        if self._worker is None:
            self._worker = copy.deepcopy(self.module)
        worker = self._worker
        params = dict(worker.named_parameters())
        idx_list, size_list = self.schedules(batch)
        device = next(iter(start.values())).device
        out = {n: torch.empty_like(start[n]) for n in self.names}
        loss_sum = torch.zeros(len(batch.clients), dtype=self.dtype, device=device)
        worker._in_federated_step = True
        try:
            for i in range(len(batch.clients)):
                with torch.no_grad():
                    for n in self.names:
                        params[n].copy_(start[n][i])
                if self.loop_uses_spec:
                    opt = self.spec.build(params)
                else:
                    opt = normalize_optimizer(worker.configure_optimizers(), type(worker).__name__)
                gidx = torch.as_tensor(idx_list[i], device=device)
                for s, size in enumerate(size_list[i]):
                    x, y = self.dm.gather(gidx[s, :size], self.dtype)
                    opt.zero_grad(set_to_none=True)
                    loss = worker.training_step((x, y), s)
                    loss.backward()
                    opt.step()
                    loss_sum[i] += loss.detach()
                with torch.no_grad():
                    for n in self.names:
                        out[n][i].copy_(params[n])
        finally:
            worker._in_federated_step = False
        steps = np.array([len(s) for s in size_list], dtype=np.int64)
        return LocalResult(out, steps, loss_sum)
