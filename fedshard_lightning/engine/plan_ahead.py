"""The batches of a chunk of clients, planned for several rounds in one vectorized call.

A round's batch plan (:meth:`.schedule.LocalSchedule.plan`) is a few dozen numpy calls whatever
the number of clients, a fixed cost per round that dominates rounds of one or two clients (the
lower stages of an unlearning request). When the same clients train in the next rounds (full
participation), the engine asks for those rounds at once: each (client, round) is planned as its
own row, and a row's batches depend only on its own key, so every round's slice equals the plan of
that round alone (``tests/engine/test_plan_ahead.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedshard_lightning.engine.client_loop import ClientBatch
from fedshard_lightning.engine.schedule import LocalSchedule

__all__ = ["BatchPlans"]

Plan = tuple[np.ndarray, np.ndarray, np.ndarray]


class BatchPlans:
    """Global sample indices, batch sizes and step counts of a batch of clients, planned ahead.

    Args:
        schedule: The local schedule.
        seed: Training seed.
        client_indices: Each client's global sample indices.
        budget: Sample slots (rounds x clients x steps x batch size) planned ahead at most.
    """

    def __init__(
        self, schedule: LocalSchedule, seed: int, client_indices: Sequence[np.ndarray], budget: int = 1 << 20
    ) -> None:
        self.schedule = schedule
        self.seed = seed
        self.budget = budget
        self.client_len = np.array([len(o) for o in client_indices], dtype=np.int64)
        self.client_off = np.cumsum(self.client_len) - self.client_len
        self.all_own = np.concatenate(client_indices) if len(client_indices) else np.zeros(0, dtype=np.int64)
        self._ahead: dict[tuple, Plan] = {}
        self._until: dict[tuple, int] = {}

    def plan(
        self, clients: Sequence[int], groups: Sequence[int], stage: int, rounds: Sequence[int]
    ) -> list[Plan]:
        """(global indices [m, S, B], sizes [m, S], steps [m]) of ``clients`` in each of ``rounds``."""
        cl = np.asarray(clients, dtype=np.int64)
        m, r = len(cl), len(rounds)
        pos, sizes, steps = self.schedule.plan(
            np.tile(self.client_len[cl], r),
            self.seed,
            stage,
            np.tile(np.asarray(groups, dtype=np.int64), r),
            np.repeat(np.asarray(rounds, dtype=np.int64), m),
            np.tile(cl, r),
        )
        off = np.tile(self.client_off[cl], r)
        # Padding slots read position 0 of their client; clipped for a client without samples.
        gidx = self.all_own[np.minimum(off[:, None, None] + pos, len(self.all_own) - 1)] if pos.size else pos
        return [
            (gidx[i * m : (i + 1) * m], sizes[i * m : (i + 1) * m], steps[i * m : (i + 1) * m])
            for i in range(r)
        ]

    def expect(self, clients: Sequence[int], groups: Sequence[int], stage: int, end: int) -> None:
        """These clients (of these groups) will train together in every round up to ``end`` (exclusive)."""
        self._until[(stage, tuple(clients), tuple(groups))] = end

    def clear(self) -> None:
        """Forget the plans made ahead and the expectations (a new engine call)."""
        self._ahead.clear()
        self._until.clear()

    def __call__(self, batch: ClientBatch) -> Plan:
        """The plan of ``batch``: made ahead, or now (with the rounds :meth:`expect`-ed after it)."""
        key = (batch.stage, tuple(batch.clients), tuple(batch.groups))
        got = self._ahead.pop((*key, batch.round), None)
        if got is not None:
            return got
        rounds = range(batch.round, max(batch.round + 1, self._until.get(key, 0)))
        if len(rounds) > 1:
            n = self.client_len[np.asarray(batch.clients, dtype=np.int64)]
            slots = int(self.schedule.plan_steps(n).max(initial=0)) * len(n) * self.schedule.batch_size
            rounds = rounds[: max(1, self.budget // max(slots, 1))]
        made = self.plan(batch.clients, batch.groups, batch.stage, rounds)
        for r, p in zip(rounds[1:], made[1:]):
            self._ahead[(*key, r)] = p
        return made[0]
