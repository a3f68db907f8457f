"""Local training of many clients in one round: stacked and per-client loop, same math.

Both functions take the clients' starting parameters stacked along a leading dimension and return
their final parameters stacked the same way. The stacked version sorts clients by their number of
steps (clients with more data take more steps); at every step the clients still training are a
prefix of that order, so finished clients are retired (their parameters copied out) and the
optimizer state is sliced, never masked.

Stacked kernels, fastest first (the registry of :mod:`.kernels`): the hand-written chain
(:mod:`.kernels.chain`), the fx rewrite (:mod:`.kernels.fx`), and ``vmap`` of the user's
``training_step`` (:mod:`.kernels.vmap`); :meth:`LocalTrainer.train_stacked` is their one
driver. The first two exist only for models made of per-sample operations, so they pad partial
batches and mask them (one call per step); under ``vmap`` a partial batch is exact for any model
by calling the training step once per distinct batch size at that step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.engine.fixed_blocks import train_in_blocks
from fedshard_lightning.engine.grad_clip import GradClip, clip_rows
from fedshard_lightning.engine.kernel_choice import choose_kernel
from fedshard_lightning.engine.kernels.base import ConvMode, KernelChoice
from fedshard_lightning.engine.kernels.chain import StackedChain
from fedshard_lightning.engine.kernels.fx import StackedProgram
from fedshard_lightning.engine.kernels.loop import LOOP, ClientBatch, LocalResult
from fedshard_lightning.engine.kernels.vmap import VMAP, StepCaller
from fedshard_lightning.engine.lone_rows import min_rows
from fedshard_lightning.engine.mixed_sizes import mixed_sizes_fixed, mixed_sizes_split
from fedshard_lightning.engine.optim import OptimizerSpec, RoundLR, fused_sgd_lr, round_lr, shrink_optimizer
from fedshard_lightning.engine.plan_ahead import BatchPlans
from fedshard_lightning.engine.row_optim import RowOptimizer, needs_rows
from fedshard_lightning.engine.schedule import LocalSchedule
from fedshard_lightning.engine.step_context import NotVectorizable, StepContext, step_keys, step_loss
from fedshard_lightning.engine.step_layout import StepLayouts
from fedshard_lightning.engine.vmap_limits import not_vectorizable, vmap_blocker
from fedshard_lightning.module import FederatedModule, shared_step_buffers

__all__ = ["ClientBatch", "KernelChoice", "LocalTrainer", "NotVectorizable", "step_loss"]

_PREFIX = "m."


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
        buffer_names: Sequence[str] = (),
    ) -> None:
        self.module = module
        self.dm = datamodule
        self.schedule = schedule
        self.spec = spec
        self.names = list(names)
        # Buffers every client keeps its own copy of (BatchNorm running statistics), stacked like
        # the parameters and updated in place by the training step.
        self.buffer_names = list(buffer_names)
        self.seed = seed
        self.dtype = next(module.parameters()).dtype
        self.ctx = StepContext.of(module)
        self._caller = StepCaller(module, self.ctx)
        self._fwd = vmap(self._loss, in_dims=(0, 0, None, 0, 0, 0))
        self._blocker = vmap_blocker(module)
        # Learning rate per round from the model's scheduler (None: the optimizer's own, constant).
        self.lr_at: RoundLR | None = round_lr(module)
        # The default training_step is a mean of per_sample_loss, which the fx kernels rewrite.
        self.maskable = isinstance(module, FederatedModule) and (
            type(module).training_step is FederatedModule.training_step
        )
        self._worker: nn.Module | None = None
        self._worker_ctx = StepContext()
        # Stacked kernel: "auto" (hand-written chain, else fx program, else vmap), "fx" or "vmap".
        self.kernel = "auto"
        # Stacked convolutions: one grouped call (GPU) or one call per client (faster on CPU).
        self.conv_mode: ConvMode = (
            "per_client" if next(module.parameters()).device.type == "cpu" else "grouped"
        )
        self._program: StackedProgram | None = None
        self._chain: StackedChain | None = None
        self.kernel_choice: KernelChoice | None = None  # decided on first use
        # torch.compile of the stacked step (the hand-written chain step, or the fx program's
        # forward; vmap stays eager). Set through FederatedEngine(compile=True).
        self.compiled = False
        # The engine's stacked call (its padding included), where it promises batch invariance.
        self.neighbour_run: Callable[[dict[str, Tensor], ClientBatch], LocalResult] | None = None
        self._compiled: dict[str, Any] = {}
        self.loop_uses_spec = False
        # Each client's gradient clipping (trainer.gradient_clip_val); None: none (grad_clip.py).
        self.clip: GradClip | None = None
        # optimizer_state: keep: each client's optimizer state by client id, carried between the
        # rounds of one train_groups call (the per-client loop); None: a fresh optimizer every round.
        self.client_states: dict[int, dict[str, Any]] | None = None
        self._fused: tuple[OptimizerSpec | None, dict[str, float] | None] = (None, None)
        own = [ix.cpu().numpy().astype(np.int64) for ix in datamodule.client_indices]
        self.plans = BatchPlans(schedule, seed, own)  # keyed batches, planned ahead by the engine
        self.layouts = StepLayouts(schedule.batch_size, self.dtype)  # per distinct batch sizes

    def _loss(
        self,
        params: dict[str, Tensor],
        client_buffers: dict[str, Tensor],
        buffers: dict[str, Tensor],
        x: Tensor,
        y: Tensor,
        key: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return functional_call(self._caller, (params, client_buffers, buffers), (x, y, key))

    @property
    def program_status(self) -> str | None:
        """The kernel choice as text, for logs and benchmark tables."""
        return None if self.kernel_choice is None else str(self.kernel_choice)

    @property
    def chain(self) -> StackedChain | None:
        """The hand-written chain kernel, when it is the one that trains (after :meth:`program`)."""
        return self._chain

    def program(self) -> StackedProgram | None:
        """The vmap-free rewrite of the model's loss, built and checked once (None: keep vmap)."""
        if self.kernel_choice is None:
            self.kernel_choice = KernelChoice(VMAP, "chosen")  # kept if the choice raises
            self.kernel_choice, self._program, self._chain = choose_kernel(
                self.module, self.names, self.conv_mode, self.kernel, self._check_sample, self._not_maskable()
            )
        return self._program

    def _not_maskable(self) -> str | None:
        """Why the loss is not the default mean of ``per_sample_loss`` (None where it is)."""
        if self.maskable:
            return None
        return (
            "training_step is overridden"
            if isinstance(self.module, FederatedModule)
            else "a plain LightningModule"
        )

    def _maybe_compiled(self, key: str, fn: Any) -> Any:
        """``fn`` compiled once (static shapes: the engine then runs fixed-shape calls), or as is."""
        if not self.compiled:
            return fn
        if key not in self._compiled:
            self._compiled[key] = torch.compile(fn, dynamic=False)
        return self._compiled[key]

    def spec_at(self, round_: int) -> OptimizerSpec:
        """The client optimizer of round ``round_`` (the scheduler's learning rates, if any)."""
        return self.spec if self.lr_at is None else self.spec.with_lrs(self.lr_at(round_))

    def _check_sample(self) -> tuple[Tensor, Tensor]:
        """A few samples of up to three non-empty clients, [C, B, ...], for the program check (indices are host tensors)."""
        own = [ix for ix in self.dm.client_indices if len(ix) > 0][:3]
        k = min(4, *(len(ix) for ix in own))
        return self.dm.gather(torch.stack([ix[:k] for ix in own]).to(self.dm.train_y.device), self.dtype)

    def _grad(
        self,
        leaves: dict[str, Tensor],
        buffers: dict[str, Tensor],
        x: Tensor,
        y: Tensor,
        mask: Tensor | None = None,
        keys: Tensor | None = None,
        client_buffers: dict[str, Tensor] | None = None,
    ) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
        """Per-client gradients, losses and logged values: stacked forward, one backward of the sum.

        Client c's loss depends only on its own parameter slice, so the gradient of the sum
        with respect to that slice is exactly client c's gradient. ``client_buffers`` [m, ...]
        (running statistics) are updated in place, each client's row by its own batch.
        """
        prog = self.program()
        logged: dict[str, Tensor] = {}
        with torch.enable_grad():
            if prog is not None:
                per = self._maybe_compiled("fx", prog)(
                    {k[len(_PREFIX) :]: v for k, v in leaves.items()}, x, y
                )
                losses = per.mean(1) if mask is None else (per * mask).sum(1) / mask.sum(1).clamp_min(1)
            else:
                if keys is None:
                    keys = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
                try:
                    losses, logged = self._fwd(leaves, client_buffers or {}, buffers, x, y, keys)
                except RuntimeError as err:
                    reason = not_vectorizable(err, type(self.module).__name__)
                    if reason is not None:
                        raise reason from None
                    raise
            # A parameter the step does not use gets no gradient (None), which torch.optim skips
            # (no update, weight decay or momentum), as the loop's optimizer does.
            grads = torch.autograd.grad(losses.sum(), list(leaves.values()), allow_unused=True)
        return dict(zip(leaves, grads)), losses.detach(), {k: v.detach() for k, v in logged.items()}

    def schedules(self, batch: ClientBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global sample indices [m, S, B], batch sizes [m, S] and step counts [m] of the clients."""
        return self.plans(batch)

    # -- stacked ---------------------------------------------------------------------------------
    def train_stacked(
        self,
        start: dict[str, Tensor],
        batch: ClientBatch,
        rows: Tensor | None = None,
        fixed: bool = False,
    ) -> LocalResult:
        """All clients of ``batch`` at once; equal to :meth:`train_loop`.

        Args:
            start: Starting parameters, one row per client, or per group when ``rows`` is given.
            batch: The clients.
            rows: Row of ``start`` each client starts from (saves expanding group models).
            fixed: Keep every kernel's shape fixed for the whole call: finished clients are copied
                out but stay in the stacked tensors (their later updates are discarded), and a
                partial batch is computed for all rows at its size. Kernels whose numerics depend
                on the batch of clients (cuBLAS, cuDNN, grouped convolutions under vmap) then give
                a client the same bits whatever its neighbours.
        """
        if self.clip is not None and self.clip.hook:
            raise NotVectorizable(
                f"{type(self.module).__name__} overrides configure_gradient_clipping, which must see one client's "
                "gradients at a time"
            )
        gidx, gsz, steps = self.schedules(batch)
        self.program()
        if self._program is None and self._blocker:  # vmap would train it inexactly
            raise NotVectorizable(self._blocker)
        chain, spec = self._chain, self.spec_at(batch.round)
        if chain is not None and self._fused[0] is not spec:  # asked every round: once per spec
            # Clipping needs every gradient before any update: no update fused into backward.
            self._fused = (spec, fused_sgd_lr(spec) if self.clip is None else None)
        fused = self._fused[1] if chain is not None else None
        m_all = len(batch.clients)
        b = self.schedule.batch_size
        device = next(iter(start.values())).device
        floor = 1 if fixed or (chain is None and self._program is None) else min_rows(device)
        if m_all == 1 < floor:  # never one client row on a multi-threaded CPU (.lone_rows): a block of 2
            one = torch.zeros(1, dtype=torch.long, device=device) if rows is None else rows
            return train_in_blocks(self, floor, start, one, batch)
        lay = self.layouts(gsz, steps, device, chain is not None)
        order, order_t, in_order, s_max, gsz = lay.order, lay.order_t, lay.in_order, lay.s_max, lay.gsz
        gidx_t = torch.as_tensor(
            np.ascontiguousarray((gidx if in_order else gidx[order]).transpose(1, 0, 2)), device=device
        )
        pick = order_t if rows is None else rows if in_order else rows.index_select(0, order_t)
        out: dict[str, Tensor] = {}  # rows of retired clients; allocated on the first retirement
        leaves = {
            _PREFIX + n: start[n].index_select(0, pick).requires_grad_(fused is None) for n in self.names
        }
        cbuf = {_PREFIX + n: start[n].index_select(0, pick) for n in self.buffer_names}
        # Fused SGD needs no optimizer; only autograd steps read shared buffers and random keys (a
        # round's fixed cost matters when it trains one or two clients: unlearning's lower stages).
        # Half precision on the CPU steps each client's row alone (see .row_optim).
        opt: Any = None
        if fused is None:
            rowwise = needs_rows(self.dtype, device)
            opt = RowOptimizer(spec, leaves, _PREFIX) if rowwise else spec.build(leaves, _PREFIX)
        buffers: dict[str, Tensor] = {}
        keys_all = torch.zeros(0)  # [S, m] in step order, for autograd steps
        if chain is None:
            shared = shared_step_buffers(self.module, self.buffer_names)
            buffers = {_PREFIX + n: b_ for n, b_ in shared.items()}
            keys_all = torch.as_tensor(np.ascontiguousarray(self.keys(batch, s_max)[order].T), device=device)
        loss_sum = torch.zeros(m_all, dtype=self.dtype, device=device)
        logs: dict[str, Tensor] = {}
        size_t, weight_all = lay.size_t, lay.weight_all
        m = live = m_all
        for s, m_s in enumerate(lay.live):
            if m_s < live:  # finished clients are copied out; rows kept beyond ``live`` are inert
                self._retire(out, {**leaves, **cbuf}, order_t, m_s, live)
                live = m_s
            keep = m if fixed else max(m_s, floor)
            if keep < m:
                new = {k: v.detach()[:keep].requires_grad_() for k, v in leaves.items()}
                if isinstance(opt, RowOptimizer):
                    opt.shrink(new, keep)
                elif opt is not None:
                    shrink_optimizer(opt, list(leaves.values()), list(new.values()), keep)
                leaves, m = new, keep
                cbuf = {k: v[:keep] for k, v in cbuf.items()}
            sizes = gsz[s, :m]
            self._caller.batch_idx = s
            if chain is not None:
                x, y = self.dm.gather(gidx_t[s, :m], self.dtype)
                weight_t = weight_all[s, :m]
                named = {k[len(_PREFIX) :]: v for k, v in leaves.items()}
                losses, by_name = self._maybe_compiled("chain", chain.step)(named, x, y, weight_t, fused)
                loss_sum[:live] += losses if live == m else losses[:live]  # inert rows: none
                if fused is not None:
                    continue
                grads = {_PREFIX + k: g for k, g in by_name.items()}
            elif (sizes == b).all():
                x, y = self.dm.gather(gidx_t[s, :m], self.dtype)
                grads, losses, logged = self._grad(
                    leaves, buffers, x, y, keys=keys_all[s, :m], client_buffers=cbuf
                )
                loss_sum[:m] += losses
                self._add_logs(logs, logged, m_all, slice(0, m))
            elif self._program is not None:  # per-sample ops only: pad and mask
                x, y = self.dm.gather(gidx_t[s, :m], self.dtype)
                mask = (torch.arange(b, device=device) < size_t[s, :m, None]).to(self.dtype)
                grads, losses, _ = self._grad(leaves, buffers, x, y, mask)
                loss_sum[:live] += losses if live == m else losses[:live]
            elif fixed:  # every distinct batch size for all rows, kept where it is the row's own
                grads = mixed_sizes_fixed(
                    self,
                    leaves,
                    buffers,
                    cbuf,
                    gidx_t[s, :m],
                    sizes,
                    size_t[s, :m],
                    keys_all[s, :m],
                    loss_sum,
                    logs,
                )
            else:
                grads = mixed_sizes_split(
                    self, leaves, buffers, cbuf, gidx_t[s], sizes, keys_all[s], loss_sum, logs
                )
            if self.clip is not None:
                clip_rows([grads[k] for k in leaves], self.clip)
            for k, v in leaves.items():
                v.grad = grads[k]
            opt.step()
            for v in leaves.values():
                v.grad = None
        if live == m_all and in_order:  # nobody retired early
            out = {k[len(_PREFIX) :]: v.detach() for k, v in {**leaves, **cbuf}.items()}
            return LocalResult(out, steps, loss_sum, logs)
        self._retire(out, {**leaves, **cbuf}, order_t, 0, live)
        inv = torch.empty_like(order_t)
        inv[order_t] = torch.arange(m_all, device=device)
        return LocalResult(
            out,
            steps,
            loss_sum.index_select(0, inv),
            {k: v.index_select(0, inv) for k, v in logs.items()},
        )

    def keys(self, batch: ClientBatch, steps: int) -> np.ndarray:
        """Random key of every client's every local step, [m, steps] (see ``step_context``)."""
        return step_keys(self.seed, batch.stage, batch.groups, batch.round, batch.clients, steps)

    def _add_logs(
        self, logs: dict[str, Tensor], logged: dict[str, Tensor], m_all: int, rows: slice | Tensor
    ) -> None:
        """Add one step's logged values of ``rows`` (positions in step order) to the sums."""
        for k, v in logged.items():
            acc = logs.setdefault(k, torch.zeros(m_all, dtype=self.dtype, device=v.device))
            if isinstance(rows, slice):
                acc[rows] += v
            else:
                acc.index_add_(0, rows, v)

    @staticmethod
    def _retire(out: dict[str, Tensor], leaves: dict[str, Tensor], order: Tensor, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        rows = order[lo:hi]
        for k, v in leaves.items():
            if k[len(_PREFIX) :] not in out:
                out[k[len(_PREFIX) :]] = v.new_empty((len(order), *v.shape[1:]))
            out[k[len(_PREFIX) :]].index_copy_(0, rows, v[lo:hi].detach())

    # -- per-client loop (reference and fallback) -----------------------------------------------
    def train_loop(
        self, start: dict[str, Tensor], batch: ClientBatch, rows: Tensor | None = None
    ) -> LocalResult:
        """One client after the other with the user's own optimizer (args as stacked; :data:`.kernels.LOOP`)."""
        return LOOP.train(self, start, batch, rows)

    def loop_worker(self) -> tuple[nn.Module, StepContext]:
        """The per-client loop's deep copy of the model and its step context, made on first use."""
        if self._worker is None:
            self._worker = copy.deepcopy(self.module)
            self._worker_ctx = StepContext.of(self._worker)
        return self._worker, self._worker_ctx
