"""The batches of a chunk of clients, planned for several rounds in one vectorized call.

A round's batch plan (:meth:`.schedule.LocalSchedule.plan`) is a few dozen numpy calls whatever
the number of clients, a fixed cost per round that dominates rounds of one or two clients (the
lower stages of an unlearning request). When the same clients train in the next rounds (full
participation), the engine asks for those rounds at once: each (client, round) is planned as its
own row, and a row's batches depend only on its own key, so every round's slice equals the plan of
that round alone (``tests/engine/test_plan_ahead.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np

from fedshard_lightning.engine.kernels.loop import ClientBatch
from fedshard_lightning.engine.schedule import LocalSchedule

__all__ = ["BatchPlans"]

Plan = tuple[np.ndarray, np.ndarray, np.ndarray]
Request = tuple[Sequence[int], Sequence[int], int, Sequence[int]]  # clients, groups, stage, rounds


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
        self._cut: int | None = None  # first_steps: each round cut to this many steps

    def first_steps(self, steps: int) -> BatchPlans:
        """These plans with each client's round cut to its first ``steps`` steps, kept apart.

        The path probes train a few steps of the first round. Cut from the real round, a round no
        longer than ``steps`` is all there (its partial batch, its clients that end early); kept
        apart, the probe neither takes the plans made ahead for training nor leaves its short
        ones where training would take them.
        """
        other = copy.copy(self)  # the clients' sample arrays are shared, read-only
        other._ahead, other._until, other._cut = {}, {}, steps
        return other

    def plan(
        self, clients: Sequence[int], groups: Sequence[int], stage: int, rounds: Sequence[int]
    ) -> list[Plan]:
        """(global indices [m, S, B], sizes [m, S], steps [m]) of ``clients`` in each of ``rounds``.

        Rounds :meth:`prepare`-d before are taken from there (when all of them are), not planned again.
        """
        if self._ahead:
            key = (stage, tuple(clients), tuple(groups))
            if all((*key, r) in self._ahead for r in rounds):
                return [self._ahead.pop((*key, r)) for r in rounds]
        return self.plan_many([(clients, groups, stage, rounds)])[0]

    def plan_many(self, requests: Sequence[Request]) -> list[list[Plan]]:
        """:meth:`plan` of every ``(clients, groups, stage, rounds)`` request, in one vectorized call.

        Each (client, round) is a row of its own key; a request's slice is cut to its own largest
        step count, where the rows of a request planned alone end (0-padded in both), so every
        plan equals that of :meth:`plan` alone.
        """
        if not requests:
            return []
        cls, grs, sts, rds = [], [], [], []
        for clients, groups, stage, rounds in requests:
            cl = np.asarray(clients, dtype=np.int64)
            m, r = len(cl), len(rounds)
            cls.append(np.tile(cl, r))
            grs.append(np.tile(np.asarray(groups, dtype=np.int64), r))
            sts.append(np.full(m * r, stage, dtype=np.int64))
            rds.append(np.repeat(np.asarray(rounds, dtype=np.int64), m))
        cl_all = np.concatenate(cls)
        pos, sizes, steps = self.schedule.plan(
            self.client_len[cl_all],
            self.seed,
            np.concatenate(sts),
            np.concatenate(grs),
            np.concatenate(rds),
            cl_all,
        )
        off = self.client_off[cl_all]
        # Padding slots read position 0 of their client; clipped for a client without samples.
        gidx = self.all_own[np.minimum(off[:, None, None] + pos, len(self.all_own) - 1)] if pos.size else pos
        out, lo = [], 0
        for clients, _, _, rounds in requests:
            m = len(clients)
            hi = lo + m * len(rounds)
            s = int(steps[lo:hi].max(initial=0))
            out.append(
                [
                    (gidx[a : a + m, :s], sizes[a : a + m, :s], steps[a : a + m])
                    for a in range(lo, hi, max(m, 1))
                ]
                if m
                else [(gidx[lo:lo, :0], sizes[lo:lo, :0], steps[lo:lo])] * len(rounds)
            )
            lo = hi
        return out

    def prepare(self, requests: Sequence[Request]) -> bool:
        """Plan these requests now, in one call, for :meth:`plan` to take; False if over the budget.

        An unlearning request's stages are planned before any of them trains: their keys are
        known, and one call is cheaper than one per stage.
        """
        n = self.client_len
        slots = (
            sum(
                int(self.schedule.plan_steps(n[np.asarray(c, dtype=np.int64)]).max(initial=0))
                * len(c)
                * len(rs)
                for c, _, _, rs in requests
            )
            * self.schedule.batch_size
        )
        if slots > self.budget:
            return False
        for (clients, groups, stage, rounds), plans in zip(requests, self.plan_many(requests)):
            key = (stage, tuple(clients), tuple(groups))
            for r, p in zip(rounds, plans):
                self._ahead[(*key, r)] = p
        return True

    def expect(self, clients: Sequence[int], groups: Sequence[int], stage: int, end: int) -> None:
        """These clients (of these groups) will train together in every round up to ``end`` (exclusive)."""
        self._until[(stage, tuple(clients), tuple(groups))] = end

    def clear(self) -> None:
        """Forget the plans made ahead and the expectations (a new engine call)."""
        self._ahead.clear()
        self._until.clear()

    def __call__(self, batch: ClientBatch) -> Plan:
        """The plan of ``batch``: made ahead, or now (with the rounds :meth:`expect`-ed after it)."""
        if self._cut is not None:
            gidx, sizes, steps = self.plan(batch.clients, batch.groups, batch.stage, [batch.round])[0]
            return gidx[:, : self._cut], sizes[:, : self._cut], np.minimum(steps, self._cut)
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
