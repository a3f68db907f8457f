"""The loggers of a run: CSV into the run directory, optionally W&B and TensorBoard.

:class:`~fedshard_lightning.loggers.reporter.RunReporter` (the one owner of a command's console and
loggers), :mod:`~fedshard_lightning.loggers.run_loggers` (which loggers a command opens, their settings and
results), :mod:`~fedshard_lightning.loggers.wandb_segments` (the offline W&B runs of a fit) and
:mod:`~fedshard_lightning.loggers.wandb_resume` (how a resumed fit reopens its W&B run).
"""

from fedshard_lightning.loggers.reporter import RunReporter
from fedshard_lightning.loggers.run_loggers import (
    LoggerSettings,
    finish_loggers,
    log_wandb_report,
    logged_requests,
    next_log_step,
    open_loggers,
    restore_csv_history,
    run_hparams,
    run_name,
    setting_name,
    tensorboard_logger,
    wandb_state,
)

__all__ = [
    "LoggerSettings",
    "RunReporter",
    "finish_loggers",
    "log_wandb_report",
    "logged_requests",
    "next_log_step",
    "open_loggers",
    "restore_csv_history",
    "run_hparams",
    "run_name",
    "setting_name",
    "tensorboard_logger",
    "wandb_state",
]
