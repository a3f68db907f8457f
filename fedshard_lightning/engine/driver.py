"""The engine's one round loop: segments of rounds with the same active groups, run by a round runner.

:meth:`.FederatedEngine.train_groups` and :func:`.stages.train_stages` both end here. The driver
owns what every call shares: which groups train (a segment ends where its first group ends or a
hook stops one), the rounds run and client-steps per group, the stop flags of ``on_round_end``,
the history and the :class:`.TrainResult`. How rounds train is the runner's: the general one
(``engine._GeneralRounds``: a plan per participants, chunks, any local step) or the lean one
(:class:`.lean_rounds.LeanRounds`: a segment's batches, frames and sums made once). One loop, so
the two cannot drift apart in what they count or when they stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from torch import Tensor

from fedshard_lightning.engine.groups import Group, RoundInfo, TrainResult

__all__ = ["RoundHook", "RoundRunner", "drive", "segment_span"]

RoundHook = Callable[[RoundInfo, dict[str, Tensor]], Sequence[bool] | None]


class RoundRunner(Protocol):
    """Trains the rounds the driver hands it; holds the group models between them."""

    def begin(self, active: list[int], start: int) -> None:
        """Start a segment: ``active`` train from round ``start`` until the driver begins another."""

    def run(
        self, rounds: range, history: list[RoundInfo], hook: RoundHook | None, stopped: list[bool]
    ) -> tuple[int, dict[int, int]]:
        """Train the first rounds of ``rounds`` (at least one); the rounds run and each active group's client-steps.

        A round whose ``hook`` stops a group is the last one run.
        """
        ...

    def params(self) -> dict[str, Tensor]:
        """The group models after the last round, stacked [G, ...]."""
        ...


def segment_span(
    groups: Sequence[Group], r: int, stopped: Sequence[bool] | None = None
) -> tuple[list[int], int]:
    """The groups training from round ``r`` (with clients, not stopped) and the round their segment ends."""
    active = [i for i, g in enumerate(groups) if r < g.rounds and g.clients and not (stopped and stopped[i])]
    return active, min((groups[i].rounds for i in active), default=r)


def drive(runner: RoundRunner, groups: Sequence[Group], on_round_end: RoundHook | None = None) -> TrainResult:
    """Every group's rounds, segment by segment, trained by ``runner``; the call's result."""
    t0 = time.perf_counter()
    g_count = len(groups)
    rounds_run = [0] * g_count
    group_steps = [0] * g_count
    stopped = [False] * g_count
    history: list[RoundInfo] = []
    max_rounds = max((g.rounds for g in groups), default=0)
    r = 0
    while r < max_rounds:
        active, end = segment_span(groups, r, stopped)
        if not active:
            break
        runner.begin(active, r)
        while r < end:
            ran, steps = runner.run(range(r, end), history, on_round_end, stopped)
            for i in active:
                rounds_run[i] += ran
                group_steps[i] += steps[i]
            r += ran
            if any(stopped[i] for i in active):
                break
    return TrainResult(
        params=runner.params(),
        client_steps=int(sum(group_steps)),
        group_client_steps=group_steps,
        rounds_run=rounds_run,
        seconds=time.perf_counter() - t0,
        history=history,
    )
