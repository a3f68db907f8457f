"""The per-client loop: the reference every stacked kernel is tested against, and the fallback.

One client after the other, with the user's own ``configure_optimizers``, on a deep copy of the
model (the worker); ``training_step`` gets the local step as ``batch_idx`` where it takes one. What a step may do is keyed as in the stacked path
(:mod:`fedshard_lightning.engine.step_context`): ``nn.Dropout`` masks from the client's step key, ``self.log`` values per
client; other random operators draw from the device's generator, seeded with the same key before
every step (inside ``fork_rng``, so the user's own stream is left as it was). With
``optimizer_state: keep`` a client's optimizer starts each round from the state its last round
left (``LocalTrainer.client_states``), not fresh.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.engine.grad_clip import clip_module
from fedshard_lightning.engine.kernels.base import ClientBatch, LocalResult, Probe, Trainer
from fedshard_lightning.engine.optim import RoundLR, normalize_optimizer
from fedshard_lightning.engine.step_context import step_loss
from fedshard_lightning.module import takes_batch_idx

__all__ = ["LOOP", "ClientBatch", "LocalResult", "LoopKernel", "run_client_loop"]


def run_client_loop(
    tr: Trainer,
    start: dict[str, Tensor],
    batch: ClientBatch,
    rows: Tensor | None,
    gidx_all: np.ndarray,
    size_all: np.ndarray,
    steps: np.ndarray,
) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
    """Final parameters and client buffers [m, ...], summed losses [m] and logged sums [m] by name.

    Args:
        tr: The local trainer (model, worker, data, optimizer, keys).
        start: Starting state, one row per client, or per group when ``rows`` is given.
        batch: The clients.
        rows: Row of ``start`` each client starts from.
        gidx_all: Global sample indices [m, S, B] of the clients' schedules.
        size_all: Batch sizes [m, S].
        steps: Local steps per client [m].
    """
    worker, worker_ctx = tr.loop_worker()
    params = dict(worker.named_parameters())
    wbuf = dict(worker.named_buffers())
    params.update({n: wbuf[n] for n in tr.buffer_names})  # copied in and out like parameters
    device = next(iter(start.values())).device
    m_all = len(batch.clients)
    src = list(range(m_all)) if rows is None else rows.tolist()
    out = {n: start[n].new_empty((m_all, *start[n].shape[1:])) for n in tr.names + tr.buffer_names}
    loss_sum = torch.zeros(m_all, dtype=tr.dtype, device=device)
    logs: dict[str, Tensor] = {}
    keys = tr.keys(batch, size_all.shape[1] if size_all.ndim == 2 else 0)
    keys_t = torch.as_tensor(keys, device=device)  # one copy per call, not one per step
    gen = (
        torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()
        ]
        if device.type == "cuda"
        else torch.default_generator
    )
    owner = type(worker).__name__
    with_idx = takes_batch_idx(worker)  # Lightning 2 also accepts training_step(batch)
    rng_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):  # the user's global stream is left as it was
        for i in range(len(batch.clients)):
            with torch.no_grad():
                for n in tr.names + tr.buffer_names:
                    params[n].copy_(start[n][src[i]])
            if tr.loop_uses_spec:
                opt = tr.spec.build(params)
            else:
                opt = normalize_optimizer(worker.configure_optimizers(), owner)
            kept = tr.client_states.get(batch.clients[i]) if tr.client_states is not None else None
            if kept is not None:  # optimizer_state: keep (the round's learning rates still apply below)
                opt.load_state_dict(kept)
            if not tr.loop_uses_spec and tr.lr_at is not None:
                RoundLR.apply(opt, tr.lr_at(batch.round))
            gidx = torch.as_tensor(gidx_all[i], device=device)
            for s, size in enumerate(size_all[i, : steps[i]].tolist()):
                x, y = tr.dm.gather(gidx[s, :size], tr.dtype)
                opt.zero_grad(set_to_none=True)
                # Random ops outside nn.Dropout draw from the device's generator, keyed by
                # the client step (the generator alone: torch.manual_seed costs ~100x more).
                gen.manual_seed(int(keys[i, s]))
                worker_ctx.begin(keys_t[i, s])
                try:
                    ret = worker.training_step((x, y), s) if with_idx else worker.training_step((x, y))
                    loss = step_loss(ret, owner)
                finally:
                    logged = worker_ctx.end()
                loss.backward()
                if tr.clip is not None:
                    clip_module(worker, opt, tr.clip)
                opt.step()
                loss_sum[i] += loss.detach()
                for k, v in logged.items():
                    logs.setdefault(k, torch.zeros(m_all, dtype=tr.dtype, device=device))[i] += v
            if tr.client_states is not None:
                tr.client_states[batch.clients[i]] = opt.state_dict()
            with torch.no_grad():
                for n in tr.names + tr.buffer_names:
                    out[n][i].copy_(params[n])
    return out, loss_sum, logs


class LoopKernel:
    """The per-client loop as a kernel: any model, one client at a time, the reference."""

    name = "loop"
    reason = "the reference: one client after the other with the user's own optimizer and training_step"
    stacked = False
    batch_invariant = True

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"

    def unsupported(self, probe: Probe) -> str | None:
        """None: the loop trains any model the user's ``training_step`` trains."""
        return None

    def parts(self, probe: Probe) -> tuple[None, None]:
        """Nothing for the stacked driver."""
        return None, None

    def train(
        self, local: Trainer, start: dict[str, Tensor], batch: ClientBatch, rows: Tensor | None = None
    ) -> LocalResult:
        """One client after the other (see :func:`run_client_loop`)."""
        gidx_all, size_all, steps = local.schedules(batch)
        out, loss_sum, logs = run_client_loop(local, start, batch, rows, gidx_all, size_all, steps)
        return LocalResult(out, steps, loss_sum, logs)


LOOP = LoopKernel()
