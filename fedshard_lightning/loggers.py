"""The loggers of a run: a CSV logger into the run directory, optionally W&B (offline by default).

Fabric never finalizes loggers, so :func:`finish_loggers` does (and closes the W&B run).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.fabric.loggers import CSVLogger, Logger

__all__ = ["finish_loggers", "run_loggers"]


def _wandb_logger(run_dir: Path, project: str, mode: str, algorithm: str, dataset: str) -> Logger:
    from lightning.pytorch.loggers import WandbLogger

    wdir = run_dir / "wandb_files"
    wdir.mkdir(exist_ok=True)
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        os.environ.setdefault(var, str(wdir))
    os.environ.setdefault("WANDB_MODE", mode)
    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbLogger(
        project=project,
        name=f"{algorithm}-{dataset}-{run_dir.name}",
        group=f"{dataset}",
        job_type=algorithm,
        save_dir=str(wdir),
        offline=mode == "offline",
        tags=[algorithm, dataset],
    )


def run_loggers(trainer: Any, run_dir: Path, command: str) -> list[Logger]:
    """CSV into ``run_dir/logs`` (``fit`` first, later commands in ``logs/<command>-N``), W&B when asked, the user's."""
    logs = run_dir / "logs"
    version = ""
    if (logs / "metrics.csv").exists() or command != "fit":
        n = 1
        while (logs / f"{command}-{n}").exists():
            n += 1
        version = f"{command}-{n}"
    loggers: list[Logger] = [CSVLogger(root_dir=str(run_dir), name="logs", version=version)]
    if trainer.wandb:
        dataset = type(trainer.datamodule).__name__.removesuffix("DataModule").lower()
        loggers.append(
            _wandb_logger(run_dir, trainer.wandb_project, trainer.wandb_mode, trainer.algorithm.name, dataset)
        )
    return loggers + trainer.user_loggers


def finish_loggers(loggers: list[Logger], wandb: bool) -> None:
    """Finalize every logger; finish the W&B run."""
    for logger in loggers:
        logger.finalize("success")
    if wandb:
        import wandb as wandb_module

        if wandb_module.run is not None:
            wandb_module.finish()
