"""The loggers of a run: CSV into the run directory, optionally W&B and TensorBoard.

:mod:`~fedshard_lightning.loggers.run_loggers` (which loggers a command opens, their settings and
results), :mod:`~fedshard_lightning.loggers.wandb_segments` (the offline W&B runs of a fit) and
:mod:`~fedshard_lightning.loggers.wandb_resume` (how a resumed fit reopens its W&B run).
"""

from fedshard_lightning.loggers.run_loggers import (
    finish_loggers,
    log_result,
    log_wandb_report,
    logged_requests,
    next_log_step,
    restore_csv_history,
    run_hparams,
    run_loggers,
    run_name,
    setting_name,
    tensorboard_logger,
    wandb_state,
)

__all__ = [
    "finish_loggers",
    "log_result",
    "log_wandb_report",
    "logged_requests",
    "next_log_step",
    "restore_csv_history",
    "run_hparams",
    "run_loggers",
    "run_name",
    "setting_name",
    "tensorboard_logger",
    "wandb_state",
]
