"""Progress of the work after a fit: ``unlearn``, ``audit``, the fairness replay and ``compare``.

Each is measured in client-steps, whose total is known (or estimated) before the work starts: a
request's predicted cost, the fit's client-steps for an audit's replay, the predicted costs of
the replayed requests. On a terminal a rich line is updated (``stage k/P · shards · client-steps/s
· ETA``); when stdout is not a terminal (SLURM, nohup, CI) one plain line is printed per stage of
the retraining, per replayed request and per compared method, so a log file shows how far the
work got and how long it still needs. Per-round methods (FATS, FedEraser, FedRecover) print at
most one line per tenth of the work, or every 30 seconds.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.line_fit import fit_line
from fedshard_lightning.callbacks.progress import format_rate, format_seconds
from fedshard_lightning.callbacks.view import RunView

__all__ = ["TaskProgress", "TaskProgressCallback"]

#: Seconds between two plain lines of a task that reports many small pieces of work.
PLAIN_EVERY_S = 30.0

#: Columns of the live line's bar.
BAR_WIDTH = 20


class TaskProgress:
    """One task's progress: a live line on a terminal, plain lines in a log.

    Args:
        task: Prefix of every line (``unlearn``, ``audit``, ``replay``, ``compare``).
        total: Client-steps the task is expected to take (None: unknown).
        items: Number of pieces (compare's methods) for an ETA when the client-steps are unknown.
        live: Show the rich live line (default: when stderr is a terminal).
        plain: Print plain lines (default: when stdout is not a terminal).
    """

    def __init__(
        self,
        task: str,
        total: float | None,
        live: bool | None = None,
        plain: bool | None = None,
        items: int | None = None,
    ) -> None:
        self.task = task
        self.total = float(total) if total else None
        self.items, self.items_done = items, 0
        self.done = 0.0
        self.t0 = self._last_line = time.perf_counter()
        self.first: tuple[float, float] | None = None  # (time, client-steps) of the first work reported
        self._decile = -1
        self.live = sys.stderr.isatty() if live is None else live
        self.plain = (not sys.stdout.isatty()) if plain is None else plain
        self._progress: Any = None
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=BAR_WIDTH),
                console=Console(stderr=True),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(task, total=self.total or items)

    def eta(self) -> float | None:
        """Seconds still needed at the measured rate (None before any work or without a total).

        The rate is measured from the first report on, once there is a second: the first piece of
        work also paid the start-up (kernel choice, batch plans), which would inflate every ETA.
        """
        now = time.perf_counter()
        elapsed = now - self.t0
        if not self.total and self.items and self.items_done:
            return elapsed / self.items_done * max(self.items - self.items_done, 0)
        if not self.total or self.done <= 0 or elapsed <= 0:
            return None
        if self.first is not None and self.done > self.first[1] and now > self.first[0]:
            rate = (self.done - self.first[1]) / (now - self.first[0])
        else:
            rate = self.done / elapsed
        return max(self.total - self.done, 0.0) / rate

    def _parts(self, note: str) -> list[tuple[str, int]]:
        """The line's parts in order, ranked by what a narrow terminal leaves out first (highest)."""
        elapsed = time.perf_counter() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        total = f"/{self.total:.0f}" if self.total else ""
        eta = self.eta()
        return [
            (f"{self.task}: {note}", 0),
            (f"{self.done:.0f}{total} client-steps", 1),
            (f"{format_rate(rate)} client-steps/s", 3),
            (f"elapsed {format_seconds(elapsed)}", 2),
            (f"ETA {format_seconds(eta) if eta is not None else '?'}", 0),
        ]

    def line(self, note: str) -> str:
        """``task: note · done/total client-steps · rate · elapsed · ETA``."""
        return " · ".join(text for text, _ in self._parts(note))

    def live_line(self, note: str, width: int) -> str:
        """:meth:`line` fitted to ``width`` columns (the bar takes its own)."""
        return fit_line(self._parts(note), width - BAR_WIDTH - 2)

    def update(self, steps: float, note: str, force: bool = True, item: bool = False) -> None:
        """Add ``steps`` done (and one piece with ``item``); show ``note``.

        Without ``force`` a plain line waits for a new tenth of the total or 30 seconds.
        """
        self.done += float(steps)
        self.items_done += int(item)
        if self.first is None and self.done > 0:
            self.first = (time.perf_counter(), self.done)
        text = self.line(note)
        if self._progress is not None:
            completed = self.done if self.total else self.items_done
            width = getattr(self._progress.console, "width", 80)
            self._progress.update(self._task, description=self.live_line(note, width), completed=completed)
        if not self.plain:
            return
        decile = int(10 * self.done / self.total) if self.total else -1
        now = time.perf_counter()
        if force or decile > self._decile or now - self._last_line >= PLAIN_EVERY_S:
            self._decile, self._last_line = decile, now
            print(text, flush=True)

    def close(self) -> None:
        """Remove the live line (the task prints its own result)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _where(algorithm: Any, stage: int, groups: Any) -> str:
    """``stage 2/3 · 1 shard(s), 4 clients`` (FedShard) or ``round 5/20 · 8 clients`` (per-round methods)."""
    clients = sum(len(g.clients) for g in groups)
    planned = getattr(algorithm, "planned_stages", None)
    rounds = getattr(algorithm, "rounds", None)
    if isinstance(planned, int) and planned > 0:
        return f"stage {stage}/{planned} · {len(groups)} shard(s), {clients} clients"
    if isinstance(rounds, int) and groups and max(g.rounds for g in groups) < rounds:
        return f"round {stage + 1}/{rounds} · {clients} clients"
    return f"{len(groups)} group(s), {clients} clients"


class TaskProgressCallback(FederatedCallback):
    """Progress of ``unlearn`` and ``audit``: one update per engine call of the retraining.

    Args:
        live: Force the live line on or off (default: when stderr is a terminal).
        plain: Force the plain lines on or off (default: when stdout is not a terminal).
    """

    def __init__(self, live: bool | None = None, plain: bool | None = None) -> None:
        self.live, self.plain = live, plain
        self.progress: TaskProgress | None = None

    def _start(self, run: RunView, task: str, total: float | None) -> None:
        if run.is_global_zero:
            self.progress = TaskProgress(task, total, self.live, self.plain)

    def _stop(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def on_unlearn_start(self, run: RunView, clients: list[int]) -> None:
        """Total: the request's predicted client-steps."""
        self._start(run, "unlearn", run.algorithm.predict_cost(clients))

    def on_audit_start(self, run: RunView) -> None:
        """Total: retraining without the unlearned clients (what the audit's replay costs)."""
        alg = run.algorithm
        try:
            total = alg.retrain_cost([])
        except NotImplementedError:
            total = getattr(alg, "total_client_steps", None)
        self._start(run, "audit", total)

    def on_groups_trained(self, run: RunView, stage: int, groups: Any, client_steps: int) -> None:
        """One engine call of the retraining finished."""
        if self.progress is not None:
            alg = run.algorithm
            per_round = not isinstance(getattr(alg, "planned_stages", None), int)
            self.progress.update(client_steps, _where(alg, stage, groups), force=not per_round)

    def on_unlearn_end(self, run: RunView, report: dict[str, Any]) -> None:
        """Close the line."""
        self._stop()

    def on_audit_end(self, run: RunView, result: dict[str, Any]) -> None:
        """Close the line."""
        self._stop()
