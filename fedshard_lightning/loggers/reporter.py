"""The reporter of a trainer's commands: the one owner of the console and the loggers' state.

Which loggers a command writes to, the W&B run a resumed fit opens late, the CSV rows that fit
found and replays: all of it lives here, changed only through :class:`RunReporter`'s methods.
Callbacks see it as a :class:`~fedshard_lightning.callbacks.view.RunWriter` (``loggers``,
``log``, ``flush``, ``print``); the trainer opens it for each command and asks it to restore,
report and close.

The loggers live in Fabric (``fabric.log_dict`` writes to them), set and replaced by this object only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger, Logger

from fedshard_lightning.loggers.run_loggers import (
    LoggerSettings,
    finish_loggers,
    holds_rows,
    open_loggers,
    restore_csv_history,
)
from fedshard_lightning.loggers.wandb_resume import open_resumed_fit_run

__all__ = ["RunReporter"]


class RunReporter:
    """The console line and the loggers of one trainer, opened anew for each command.

    Args:
        fabric: The trainer's launched Fabric (its loggers are this reporter's to set).
    """

    def __init__(self, fabric: Fabric) -> None:
        self._fabric = fabric
        self._settings = LoggerSettings()
        self._hparams: dict[str, Any] = {}
        self._csv_history: list[dict[str, str]] = []
        self._wandb_logger: Logger | None = None
        self._deferred = False

    # -- what callbacks use (RunWriter) ----------------------------------------------------------
    @property
    def loggers(self) -> Sequence[Logger]:
        """The loggers of the current command (CSV first; none on other processes than the first)."""
        return self._fabric.loggers

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """One row of scalars at ``step`` in every logger."""
        self._fabric.log_dict(metrics, step=step)

    def flush(self) -> None:
        """Write what the loggers hold (the CSV file's new rows)."""
        for logger in self._fabric.loggers:
            logger.save()

    def print(self, text: str) -> None:
        """One console line, on the first process only."""
        if self._fabric.is_global_zero:
            print(text, flush=True)

    # -- what the trainer uses -------------------------------------------------------------------
    @property
    def csv_history(self) -> list[dict[str, str]]:
        """The CSV rows a resumed fit found in ``logs/metrics.csv`` (empty otherwise)."""
        return list(self._csv_history)

    def open(
        self, run_dir: Path, command: str, resume: bool, hparams: dict[str, Any], settings: LoggerSettings
    ) -> None:
        """Open the loggers of ``command`` on ``run_dir`` (first process; the others log nothing).

        A resumed fit's W&B run is not opened yet: :meth:`open_resumed_fit` does, once the resume
        is accepted.
        """
        self._settings, self._hparams = settings, dict(hparams)
        self._csv_history, self._wandb_logger, self._deferred = [], None, False
        if not self._fabric.is_global_zero:
            self._fabric._loggers = []
            return
        opened = open_loggers(run_dir, command, resume, hparams, settings)
        self._csv_history, self._wandb_logger = opened.csv_history, opened.wandb_logger
        self._deferred = opened.deferred
        self._fabric._loggers = opened.loggers

    def open_resumed_fit(self, run_dir: Path, resumed: bool, finished: bool) -> bool:
        """Open the deferred W&B run of a resumed fit; whether the CSV's kept rows must be replayed into it.

        ``resumed``: the restored state is trained on; ``finished``: it was complete. Drops the
        W&B logger when its run already holds every row. Nothing to do (False) without a
        deferred W&B run.
        """
        if not (self._deferred and self._fabric.is_global_zero):
            return False
        self._deferred = False
        logger = self._wandb_logger
        keep, replay = open_resumed_fit_run(
            logger, self._csv_history, self._hparams, run_dir, resumed, finished
        )
        if not keep:
            self._fabric._loggers = [lg for lg in self._fabric._loggers if lg is not logger]
            self._wandb_logger = None
        return replay

    def restore_rows(self, replay_wandb: bool) -> tuple[int, int, int]:
        """Write back the rows of the stages an interrupted fit committed (CSV, and W&B with ``replay_wandb``).

        Returns (next step, rounds, client-steps kept):
        :func:`~fedshard_lightning.loggers.run_loggers.restore_csv_history`.
        """
        loggers = list(self._fabric.loggers[:1])  # the CSV first
        if replay_wandb and self._wandb_logger is not None:
            loggers.append(self._wandb_logger)
        return restore_csv_history(loggers, self._csv_history)

    def log_result(self, run_dir: Path, row: Mapping[str, float], step: int) -> None:
        """``audit`` / ``test`` on a run: one row at ``step`` in every logger, then close them.

        A read-only run (which ``test`` must be able to read) gets no row: nothing is written there.
        A write that fails (disk full) leaves no partial file: the CSV folder this command started is
        removed again, and the error names the file (``f.write`` raises ENOSPC without a name).
        """
        loggers = self._fabric.loggers
        segments = [
            Path(lg.log_dir)
            for lg in loggers
            if isinstance(lg, CSVLogger) and not holds_rows(Path(lg.log_dir))
        ]
        try:
            if os.access(run_dir, os.W_OK):
                self.log(row, step)
                step += 1
            finish_loggers(loggers, self._settings.wandb, run_dir, step)
        except OSError as e:
            for folder in segments:
                shutil.rmtree(folder, ignore_errors=True)
            if e.filename is None and e.errno is not None and segments:
                raise OSError(
                    e.errno, e.strerror or os.strerror(e.errno), str(segments[0] / "metrics.csv")
                ) from None
            raise
