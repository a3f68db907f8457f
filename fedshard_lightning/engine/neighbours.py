"""Whether a stacked client's bits depend on the clients that share its call (probed once per model).

Unlearning replays a shard with other clients beside each one than the original fit had, so it
is bit-exact only if a client's result is the same whoever shares its stacked call. The engine's
own kernels keep that (one GEMM per client, fixed-shape calls where kernels vary with the client
count), but an elementwise operator may not: on the CPU, float32 ``sigmoid``, ``silu``, ``elu``,
``mish``, ``softplus`` and tanh-``gelu`` (forward or backward) round a tensor's vectorized body
and its scalar tail differently, and which of a client's elements fall in the tail depends on its
row and on how many clients are stacked. The fx kernel applies those it knows per client
(:mod:`.kernels.per_client_ops`), but no list of operators can be complete (a user's ``training_step``
under ``vmap`` may call anything), so :func:`neighbour_dependence` trains a few clients both
alone and among others, through the engine's own stacked call, and compares the bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from fedshard_lightning.engine.kernels.loop import ClientBatch, LocalResult
from fedshard_lightning.engine.local import LocalTrainer

__all__ = ["NEIGHBOURS_REASON", "NEIGHBOUR_STEPS", "PROBE_STEPS", "first_steps", "neighbour_dependence"]

NEIGHBOURS_REASON = "stacked results depend on the neighbouring clients"


#: Steps of each client's first round that the path probes train: the timings and the loss
#: comparison (an inexact gradient shows in the losses of the steps after it: a functional
#: ``F.embedding(padding_idx=...)`` under vmap is off by 4.5e-6 relative after 2 steps, under
#: float32's 1e-5 tolerance, and by 5.2e-5 after 4), then the neighbour check, which sees more
#: values (rounding that depends on a client's position shows only for some values) in what is
#: still a fraction of a CNN's round.
PROBE_STEPS = 4
NEIGHBOUR_STEPS = 8


@contextlib.contextmanager
def first_steps(local: LocalTrainer, steps: int) -> Iterator[None]:
    """Run ``local``'s calls for the first ``steps`` steps of each client's round, then restore.

    The batches come from ``local.plans`` (:meth:`.plan_ahead.BatchPlans.first_steps`), not from
    ``local.schedule``: a probe that shortened only the schedule trained whole rounds.
    """
    plans = local.plans
    local.plans = plans.first_steps(steps)
    try:
        yield
    finally:
        local.plans = plans


def neighbour_dependence(local: LocalTrainer, start: dict[str, Tensor], batch: ClientBatch) -> str | None:
    """What differs when a client trains among others rather than alone, or None (nothing; not probed).

    Up to 8 of ``batch``'s clients (a lone client beside a copy of itself) train the first
    :data:`NEIGHBOUR_STEPS` steps of their first round through ``local.neighbour_run`` (the
    engine's stacked call, padded as the engine pads) in their order and reversed, and the first
    and the last alone; every client's parameters and loss must be bit for bit the same in each
    call it was in. Reversing moves every client but a middle one to another row; alone, a
    client's tensors end where its own rows end. The fit's results are not touched.

    Args:
        local: The engine's local trainer (``neighbour_run`` None: the engine promises no
            invariance here, nothing is probed).
        start: Starting state of ``batch``'s clients, one row per client.
        batch: The first chunk of the first round.
    """
    run = local.neighbour_run
    if run is None:
        return None
    k = min(len(batch.clients), 8)
    order = list(range(k)) if k > 1 else [0, 0]
    calls = [order, order[::-1], order[:1], order[-1:]]
    with first_steps(local, NEIGHBOUR_STEPS):
        results = [_call(run, start, batch, c) for c in calls]
    seen: dict[int, tuple[int, int]] = {}  # client position in ``batch`` -> (call, row) first seen
    for ci, (call, res) in enumerate(zip(calls, results)):
        for row, pos in enumerate(call):
            if pos not in seen:
                seen[pos] = (ci, row)
                continue
            first = results[seen[pos][0]]
            frow = seen[pos][1]
            for name, got in [*res.params.items(), ("loss", res.loss_sum)]:
                want = first.loss_sum if name == "loss" else first.params[name]
                if not _same(got[row], want[frow]):
                    return (
                        f"{NEIGHBOURS_REASON} (client {batch.clients[pos]}'s {name} after {NEIGHBOUR_STEPS} "
                        f"local steps at most: row {frow} of {len(calls[seen[pos][0]])} clients vs row {row} of {len(call)})"
                    )
    return None


def _call(
    run: Callable[[dict[str, Tensor], ClientBatch], LocalResult],
    start: dict[str, Tensor],
    batch: ClientBatch,
    order: list[int],
) -> LocalResult:
    """``run`` of ``batch``'s clients at positions ``order``, each from its own start row."""
    idx = torch.tensor(order, device=next(iter(start.values())).device)
    sub = ClientBatch(
        [batch.clients[i] for i in order], [batch.groups[i] for i in order], batch.stage, batch.round
    )
    return run({n: v.index_select(0, idx) for n, v in start.items()}, sub)


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal values, NaN where the other is NaN (a diverged client is training's to report)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())
