"""What a callback sees of the run: :class:`RunView`, a read-only snapshot made for each hook call.

A callback observes; it never changes the run. So it receives neither the trainer nor its
collaborators' state to poke at, but this frozen record of what the built-in callbacks read (the
run directory, the algorithm, the data and model, the round history, the logging step) and the
run's writer (:class:`RunWriter`: the loggers, ``log``, ``flush`` and the console line), whose
state (which loggers, the W&B run, the CSV rows of a resumed fit) is the reporter's alone
(:class:`~fedshard_lightning.loggers.reporter.RunReporter`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import lightning as L
from lightning.fabric.loggers import Logger
from torch import Tensor

from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.flcache.cache import FLCache
from fedshard_lightning.unlearning.base import Algorithm

__all__ = ["RunView", "RunWriter"]


class RunWriter(Protocol):
    """Where a callback writes: the run's loggers and its console (the first process only prints)."""

    @property
    def loggers(self) -> Sequence[Logger]:
        """The loggers of this command (CSV first; none on other processes than the first)."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """One row of scalars at ``step`` in every logger."""

    def flush(self) -> None:
        """Write what the loggers hold (the CSV file's new rows)."""

    def print(self, text: str) -> None:
        """One console line, on the first process only."""


@dataclass(frozen=True)
class RunView:
    """A read-only view of the run, passed to every hook of a :class:`~.FederatedCallback`.

    Attributes:
        run_dir: The run directory (``None`` outside a run).
        algorithm: The method; read it (``predict_cost``, ``what_if``, ``current_params``...),
            never change its state.
        module: The model (its parameters are the trainer's working copy).
        datamodule: The federated data.
        client_sizes: Training samples of every client.
        history: The metrics of every round so far in this command.
        log_step_start: The logging step of this command's first row (after the rows a resumed
            fit kept, or after the run's last row for ``unlearn``, ``audit`` and ``test``).
        is_global_zero: True on the process that writes files.
        show_progress: Whether progress lines are wanted (``trainer.enable_progress_bar``).
        cache: The run's FLCache (to read or verify; commits are the trainer's).
        writer: The loggers and the console.
        evaluate: Test accuracy and loss of a model given by its parameters.
    """

    run_dir: Path | None
    algorithm: Algorithm
    module: L.LightningModule
    datamodule: FederatedDataModule
    client_sizes: Sequence[int]
    history: Sequence[Mapping[str, float]]
    log_step_start: int
    is_global_zero: bool
    show_progress: bool
    cache: FLCache | None
    writer: RunWriter
    evaluate: Callable[[dict[str, Tensor]], tuple[float, float]]

    @property
    def loggers(self) -> Sequence[Logger]:
        """The run's loggers (:attr:`RunWriter.loggers`)."""
        return self.writer.loggers

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """One row at ``step`` in every logger."""
        self.writer.log(metrics, step)

    def print(self, text: str) -> None:
        """One console line on the first process."""
        self.writer.print(text)
