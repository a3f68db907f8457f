"""A sequence of engine calls known in advance: an unlearning request's replay, stage after stage.

A request retrains the affected shards of stage 1, then those of stage 2 from their children's
retrained models, and so on: one engine call per stage, each a handful of small rounds. Which
clients train, in which groups, stages and rounds, follows from the frozen tree before any of it
trains, so :func:`train_stages` does per request what one call per stage did per stage:

* the batches of every stage are planned in one vectorized call (:meth:`.BatchPlans.prepare`);
* the rounds' records, with their check for non-finite losses, are made after the last stage
  (the first non-finite loss raises the error the stage's own call would have raised).

Host work between two stages costs more than its own time: it cools the caches the next stage
trains with (one step of one client after 1.6 MB of numpy work took 306 us instead of 75). Each job
runs through the engine's one driver (:func:`.driver.drive`) with the lean round runner, as its
``train_groups`` call would; the results are those of one such call per stage
(``tests/engine/test_lean_rounds.py``, ``tests/unlearning``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from fedshard_lightning.engine.driver import segment_span
from fedshard_lightning.engine.groups import Group, TrainResult
from fedshard_lightning.engine.lean_frames import LeanEngine
from fedshard_lightning.engine.lean_rounds import lean_eligible, run_lean
from fedshard_lightning.engine.plan_ahead import Request

__all__ = ["finish", "lean_requests", "train_stages"]


def train_stages(
    engine: LeanEngine,
    jobs: Sequence[tuple[int, Sequence[Group]]],
    init_of: Callable[[int, list[TrainResult]], dict[str, Tensor]],
) -> list[TrainResult]:
    """Unwatched ``train_groups`` calls of ``(stage, groups)`` jobs, job j from ``init_of(j, results)``.

    On the lean path (every job eligible) the batches are planned up front and the records made at
    the end; otherwise each job is one ``train_groups`` call.
    """
    results: list[TrainResult] = []
    deferred: list[Callable[[], object]] = []
    lean = False
    for j, (stage, groups) in enumerate(jobs):
        init = init_of(j, results)
        if j == 0 and engine.lean_rounds:
            engine.decide(init, groups, stage)
            lean = all(lean_eligible(engine, g) for _, g in jobs)
            if lean:
                engine.local.plans.clear()
                engine.local.plans.prepare([q for st, g in jobs for q in lean_requests(engine, g, st)])
        if lean:
            results.append(run_lean(engine, init, groups, stage, deferred=deferred))
        else:
            results.append(engine.train_groups(init, groups, stage))
    finish(deferred)
    return results


def lean_requests(engine: LeanEngine, groups: Sequence[Group], stage: int) -> list[Request]:
    """The batch plans an unwatched lean :func:`.driver.drive` of these groups asks for: its segments' clients and rounds."""
    requests: list[Request] = []
    r, last = 0, max((g.rounds for g in groups), default=0)
    while r < last:
        active, end = segment_span(groups, r)
        if not active:
            break
        parts = [engine.participants(stage, groups[i], r) for i in active]
        clients = [int(c) for p in parts for c in p]
        requests.append(
            (clients, [groups[i].key for i, p in zip(active, parts) for _ in p], stage, range(r, end))
        )
        r = end
    return requests


def finish(deferred: list[Callable[[], object]]) -> None:
    """Make the records the lean runner deferred, in order: the first non-finite loss raises here."""
    for make in deferred:
        make()
    deferred.clear()
