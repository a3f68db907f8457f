"""A rich progress bar that shows stage, round and clients."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedshard_lightning.callbacks.base import FederatedCallback

__all__ = ["ProgressBar"]


class ProgressBar(FederatedCallback):
    """Progress over rounds of the current stage; silent when stderr is not a terminal.

    Args:
        force: Show the bar even when stderr is not a terminal.
    """

    def __init__(self, force: bool = False) -> None:
        self.force = force
        self._progress: Progress | None = None
        self._task: Any = None

    def _enabled(self, trainer: Any) -> bool:
        return (self.force or sys.stderr.isatty()) and trainer.is_global_zero

    def on_stage_start(self, trainer: Any, stage: int, groups: Any) -> None:
        """Open a bar for the stage's rounds."""
        if not self._enabled(trainer):
            return
        if self._progress is None:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._progress.start()
        total = max((g.rounds for g in groups), default=0)
        clients = sum(len(g.clients) for g in groups)
        self._task = self._progress.add_task(
            f"stage {stage}: {len(groups)} group(s), {clients} clients", total=total, status=""
        )

    def on_round_end(self, trainer: Any, info: Any, metrics: dict[str, float]) -> None:
        """Advance and show the round's loss and accuracy."""
        if self._progress is None or self._task is None:
            return
        acc = metrics.get("test_accuracy")
        status = f"loss {metrics.get('train_loss', float('nan')):.3f}" + (
            f" acc {acc:.3f}" if acc is not None else ""
        )
        self._progress.update(self._task, advance=1, status=status)

    def on_stage_end(self, trainer: Any, stage: int, metrics: dict[str, float]) -> None:
        """Close the stage's bar."""
        if self._progress is not None and self._task is not None:
            task = self._progress.tasks[-1]
            self._progress.update(self._task, completed=task.total)
            self._task = None

    def on_fit_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        """Stop the live display."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
