"""``vectorize: auto``: which local-training path a model runs on, and why, in one line.

The stacked path is not always faster (a model of many small layers on a CPU may run faster one
client at a time), and not always possible (random operators that ``vmap`` cannot key per client
make the stacked step raise :class:`~.step_context.RandomInStep`). :func:`choose_path` answers
both before the first round, with the reason the trainer prints at start-up.
"""

from __future__ import annotations

import math
import time

from torch import Tensor

from fedshard_lightning.engine.client_loop import ClientBatch
from fedshard_lightning.engine.local import LocalTrainer
from fedshard_lightning.engine.schedule import LocalSchedule
from fedshard_lightning.engine.step_context import RandomInStep

__all__ = ["choose_path"]


def choose_path(local: LocalTrainer, start: dict[str, Tensor], batch: ClientBatch) -> tuple[str, str]:
    """Time two local steps per client both ways (results discarded); ``(cheaper path, reason)``.

    The stacked kernel runs up to 8 clients (its cost per client falls with more clients, so
    this is conservative) and the loop 2 (its cost is linear in clients); each is timed twice,
    interleaved, and its best time per client counts, so one preempted run on a busy machine
    does not decide. The issue-7 digits profile spent 88 ms here with 8 looped clients.

    Args:
        local: The engine's local trainer.
        start: Starting state of the batch's clients, one row per client.
        batch: The first chunk of the first round.
    """
    k = min(len(batch.clients), 8)
    sizes = {"stacked": k, "loop": min(k, 2)}
    runs = {
        mode: (
            fn,
            ClientBatch(batch.clients[: sizes[mode]], batch.groups[: sizes[mode]], batch.stage, batch.round),
        )
        for mode, fn in (("stacked", local.train_stacked), ("loop", local.train_loop))
    }
    full = local.schedule
    local.schedule = LocalSchedule(batch_size=full.batch_size, local_steps=2)
    per_client = dict.fromkeys(runs, math.inf)
    try:
        try:
            for mode, (fn, sub) in runs.items():
                fn({n: v[: sizes[mode]] for n, v in start.items()}, sub)  # warm-up (builds the kernels)
        except RandomInStep as err:
            return "loop", f"vectorize: auto; {err}; the loop seeds each client step by its key"
        for _ in range(2):
            for mode, (fn, sub) in runs.items():
                sub_start = {n: v[: sizes[mode]] for n, v in start.items()}
                t = time.perf_counter()
                fn(sub_start, sub)
                per_client[mode] = min(per_client[mode], (time.perf_counter() - t) / sizes[mode])
    finally:
        local.schedule = full
    ms = {k: f"{1e3 * v:.2f}" for k, v in per_client.items()}
    reason = f"vectorize: auto; timed {ms['stacked']} ms/client stacked vs {ms['loop']} ms/client loop"
    return min(per_client, key=per_client.get), reason
