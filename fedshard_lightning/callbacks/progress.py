"""Progress of a fit: ``stage k/P · round r/T · clients · client-steps/s · ETA``.

A long run must be watchable wherever it runs. On a terminal a rich live line is updated once
per round; when stderr is not a terminal (SLURM, nohup, CI, a pipe) one plain line is printed per
stage instead, so a log file shows how far the run got and how long it still needs, and within a
long stage (a FedAvg baseline is one stage; a CIFAR stage takes hours on a CPU) one round line at
most every ``plain_every_s`` seconds, so the log never goes quiet for longer. All work
happens per round or per stage, never per local step, and the live line is redrawn at most every
``refresh_every_s`` (rich draws from its own thread), so thousands of short rounds cost nothing.

The ETA assumes the remaining stages cost what the finished ones did on average (FedShard's
stages train every client for a similar number of rounds); before the first stage ends it
projects the current stage from its rounds so far.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.line_fit import fit_line
from fedshard_lightning.callbacks.view import RunView

__all__ = ["ProgressBar", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: short enough for a progress line."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_rate(rate: float) -> str:
    """``900``, ``3.5``, ``0.4``: two significant digits below 10, so a slow run never shows ``0``."""
    if rate >= 10:
        return f"{rate:.0f}"
    if rate >= 0.01:
        return f"{rate:.2g}"
    return "0" if rate <= 0 else "<0.01"


class ProgressBar(FederatedCallback):
    """Live progress on terminals, one log line per stage elsewhere.

    Args:
        force: Show the live display even when stderr is not a terminal.
        plain: Print the plain per-stage lines even on a terminal (for logs of interactive runs).
        refresh_every_s: Shortest time between two updates of the live line within a stage.
        plain_every_s: Off a terminal, shortest time between two plain lines within a stage.
    """

    def __init__(
        self,
        force: bool = False,
        plain: bool = False,
        refresh_every_s: float = 0.2,
        plain_every_s: float = 30.0,
    ) -> None:
        self.force, self.plain = force, plain
        self.refresh_every_s = float(refresh_every_s)
        self.plain_every_s = float(plain_every_s)
        self._printed = 0.0
        self._shown = float("-inf")  # nothing shown yet: the first round is (perf_counter counts from boot)
        self._progress: Any = None
        self._task: Any = None
        self._t0 = 0.0
        self._stage_t0 = 0.0
        self._stages_done = 0
        self._stage = 0
        self._planned: int | None = None
        self._rounds = 0
        self._round = 0
        self._groups = 0
        self._clients = 0
        self._steps = 0.0
        self._steps_at_stage = 0.0

    # -- state -----------------------------------------------------------------------------------
    def _live(self) -> bool:
        return self.force or sys.stderr.isatty()

    def _stage_label(self) -> str:
        return f"stage {self._stage}/{self._planned}" if self._planned else f"stage {self._stage}"

    def _rate(self) -> float:
        elapsed = time.perf_counter() - self._t0
        return self._steps / elapsed if elapsed > 0 else 0.0

    def eta(self) -> float | None:
        """Seconds the fit still needs (estimate), or None when nothing is known yet."""
        now = time.perf_counter()
        in_stage = now - self._stage_t0
        stage_left = 0.0
        if 0 < self._round < self._rounds:
            stage_left = in_stage / self._round * (self._rounds - self._round)
        if self._stages_done:
            per_stage = (self._stage_t0 - self._t0) / self._stages_done
        elif self._round:
            per_stage = in_stage + stage_left
        else:
            return None
        later = max((self._planned or self._stage) - self._stage, 0)
        return stage_left + later * per_stage

    def _parts(self, status: str = "", elapsed: bool = False) -> list[tuple[str, int]]:
        """The line's parts in order, ranked by what a narrow terminal leaves out first (highest)."""
        eta = self.eta()
        return [
            (self._stage_label(), 0),
            (f"round {self._round}/{self._rounds}", 0),
            (f"{self._groups} group(s), {self._clients} clients", 4),
            (f"{format_rate(self._rate())} client-steps/s", 3),
            (status, 1),
            (f"ETA {format_seconds(eta) if eta is not None else '?'}", 0),
            (f"elapsed {format_seconds(time.perf_counter() - self._t0)}" if elapsed else "", 2),
        ]

    def _line(self) -> str:
        return " · ".join(text for text, _ in self._parts() if text)

    def live_line(self, width: int, status: str = "") -> str:
        """The terminal's line, with the loss and the elapsed time, fitted to ``width`` columns."""
        return fit_line(self._parts(status, elapsed=True), width - 1)

    def _show(self, status: str = "", **fields: Any) -> None:
        width = getattr(getattr(self._progress, "console", None), "width", 80)
        self._progress.update(self._task, description=self.live_line(width, status), **fields)

    # -- hooks -----------------------------------------------------------------------------------
    def on_fit_start(self, run: RunView) -> None:
        """Start the clock; learn P from the algorithm when it plans its stages."""
        self._t0 = self._stage_t0 = self._printed = time.perf_counter()
        self._stages_done, self._steps = 0, 0.0
        planned = getattr(run.algorithm, "planned_stages", None)
        self._planned = planned if isinstance(planned, int) and planned > 0 else None

    def on_stage_start(self, run: RunView, stage: int, groups: Any) -> None:
        """A new stage: its rounds and clients; open the live display on the first."""
        self._stage, self._round = stage, 0
        self._stage_t0 = time.perf_counter()
        self._steps_at_stage = self._steps
        self._rounds = max((g.rounds for g in groups), default=0)
        self._groups = len(groups)
        self._clients = sum(len(g.clients) for g in groups)
        if not run.is_global_zero or not self._live():
            return
        if self._progress is None:
            from rich.console import Console
            from rich.progress import Progress, TextColumn

            self._progress = Progress(  # no bar: "round r/T" is the bar, the line stays readable
                TextColumn("{task.description}"), console=Console(stderr=True), transient=False
            )
            self._progress.start()
            self._task = self._progress.add_task("", total=None)
        self._show(total=self._rounds, completed=0)

    def on_round_end(self, run: RunView, info: Any, metrics: dict[str, float]) -> None:
        """Advance: the round, the throughput and the ETA, with the loss and accuracy."""
        self._round = int(info.round) + 1
        self._steps = float(metrics.get("client_steps", self._steps))
        now = time.perf_counter()
        if (
            self._round < self._rounds
            and now - self._printed >= self.plain_every_s
            and run.is_global_zero
            and (self.plain or not self._live())
        ):
            self._printed = now
            print(f"fit: {self._line()} · elapsed {format_seconds(now - self._t0)}", flush=True)
        if self._progress is None or (
            self._round < self._rounds and now - self._shown < self.refresh_every_s
        ):
            return
        self._shown = now
        acc = metrics.get("test_accuracy")
        status = f"loss {metrics.get('train_loss', float('nan')):.3f}" + (
            f" acc {acc:.3f}" if acc is not None else ""
        )
        self._show(status, completed=self._round)

    def on_stage_end(self, run: RunView, stage: int, metrics: dict[str, float]) -> None:
        """Count the stage; off a terminal print its line (with elapsed time and ETA)."""
        self._stages_done += 1
        self._stage_t0 = time.perf_counter()
        self._round = self._rounds
        if run.is_global_zero and (self.plain or not self._live()):
            self._printed = self._stage_t0
            eta = self.eta()
            acc = metrics.get("test_accuracy")
            print(
                f"fit: {self._stage_label()} done · {self._rounds} round(s) · {self._groups} group(s), "
                f"{self._clients} clients · {format_rate(self._rate())} client-steps/s · "
                + (f"test_accuracy {acc:.4f} · " if isinstance(acc, (int, float)) else "")
                + f"elapsed {format_seconds(self._stage_t0 - self._t0)} · "
                f"ETA {format_seconds(eta) if eta is not None else '?'}",
                flush=True,
            )

    def on_fit_end(self, run: RunView, metrics: dict[str, float]) -> None:
        """Stop the live display."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
