"""The loggers of a run: a CSV logger into the run directory, optionally W&B (offline by default).

Runs are compared by their settings, so every logger receives the resolved settings as
hyper-parameters (:func:`run_hparams`: method, dataset, K, rho, merge rate, lr, seed and every
constructor argument of model, data and algorithm). A W&B run is named after its setting
(``fedshard-digits-K32-rho0.5-s0``), grouped by ``wandb_group`` (default: the setting without
method and seed), and its id is stored in ``RUN/wandb.json`` so that later ``unlearn``, ``audit``
and ``test`` commands and a resumed ``fit`` log into the same W&B run. Offline runs live in
``RUN/wandb_files/wandb/offline-run-*``; ``wandb sync RUN/wandb_files/wandb/offline-run-*``
uploads them (a resumed fit replaces or rewinds its interrupted segments: :mod:`~.wandb_resume`).
TensorBoard (``tensorboard: true``, extra ``[tb]``) writes into ``RUN/tensorboard/fit`` (and
``RUN/tensorboard/unlearn-N`` ...), hyper-parameters included: ``tensorboard --logdir RUN``.

Fabric never finalizes loggers, so :func:`finish_loggers` does (and closes the W&B run).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.fabric.loggers import CSVLogger, Logger

from fedshard_lightning.errors import ConfigError
from fedshard_lightning.init_args import init_args
from fedshard_lightning.loggers.wandb_segments import (
    close_stale_run,
    record_fit_segment,
    remember_run,
    wandb_state,
    write_wandb_state,
)

__all__ = [
    "LoggerSettings",
    "OpenedLoggers",
    "finish_loggers",
    "holds_rows",
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

# The hyper-parameter table of TensorBoard shows these scalars beside the settings.
_TB_METRICS = ("test_accuracy", "final/test_accuracy", "unlearn/test_accuracy_after", "unlearn/client_steps")


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    elif isinstance(value, (list, tuple)):
        out[prefix] = str(list(value))
    else:
        out[prefix] = value


def run_hparams(
    module: Any,
    datamodule: Any,
    algorithm: Any,
    seed: int,
    precision: str,
    vectorize: str,
    num_clients: int,
) -> dict[str, Any]:
    """The settings a run is compared by: headline keys first, then every constructor argument, flat.

    ``num_clients`` stands in for K when the datamodule's recorded arguments do not name it.
    """
    model = init_args(module)
    data = init_args(datamodule)
    alg = init_args(algorithm)
    dargs, aargs, margs = data["init_args"], alg["init_args"], model["init_args"]
    out: dict[str, Any] = {
        "method": algorithm.name,
        "dataset": dataset_name(datamodule),
        "num_clients": dargs.get("num_clients", num_clients),
        "partition": dargs.get("partition"),
        "rho": dargs.get("rho"),
        "merge_rate": aargs.get("merge_rate"),
        "lr": margs.get("lr"),
        "seed": seed,
        "precision": precision,
        "vectorize": vectorize,
        "model": model["class_path"].rsplit(".", 1)[-1],
    }
    for name, entry in (("model", model), ("data", data), ("algorithm", alg)):
        _flatten(name, entry["init_args"], out)
    return {k: v for k, v in out.items() if v is not None}


def dataset_name(datamodule: Any) -> str:
    """``DigitsDataModule`` -> ``digits``."""
    return type(datamodule).__name__.removesuffix("DataModule").lower()


def setting_name(hparams: dict[str, Any]) -> str:
    """``digits-K32-rho0.5``: the setting without method and seed, the default W&B group."""
    parts = [str(hparams["dataset"]), f"K{hparams['num_clients']}"]
    if hparams.get("partition", "dirichlet") == "dirichlet" and hparams.get("rho") is not None:
        parts.append(f"rho{hparams['rho']}")
    return "-".join(parts)


def run_name(hparams: dict[str, Any]) -> str:
    """``fedshard-digits-K32-rho0.5-s0``: the setting, readable in a W&B table."""
    return f"{hparams['method']}-{setting_name(hparams)}-s{hparams['seed']}"


def _csv_rows(run_dir: Path) -> list[dict[str, str]]:
    """Every row of the run's CSV files (``logs/metrics.csv``, ``logs/<command>-N/metrics.csv``)."""
    paths = [run_dir / "logs" / "metrics.csv", *sorted(run_dir.glob("logs/*/metrics.csv"))]
    return [row for path in paths for row in _read_csv(path)]


def _ints(rows: list[dict[str, str]], column: str) -> list[int]:
    out = []
    for row in rows:
        with contextlib.suppress(TypeError, ValueError):
            out.append(int(float(row.get(column) or "")))
    return out


def next_log_step(run_dir: Path) -> int:
    """The step after every row the run has logged, so a request's row follows the fit's curves.

    W&B keeps its last step in ``RUN/wandb.json``; without W&B the CSV files (always written)
    say it, so CSV, TensorBoard and the user's loggers number rows the same way either way.
    """
    return max(
        int(wandb_state(run_dir).get("step", 0)), max(_ints(_csv_rows(run_dir), "step"), default=-1) + 1
    )


def logged_requests(run_dir: Path) -> set[int]:
    """Numbers of the unlearning requests that have a row in the run's CSV files.

    A process killed between a request's cache commit and its row leaves the request applied
    but unlogged; the next ``unlearn`` logs it then (:meth:`~fedshard_lightning.trainer.trainer.FederatedTrainer.unlearn`).
    """
    return set(_ints(_csv_rows(run_dir), "unlearn/request"))


def _wandb_logger(run_dir: Path, settings: LoggerSettings, hparams: dict[str, Any]) -> Logger:
    from lightning.pytorch.loggers import WandbLogger

    wdir = run_dir / "wandb_files"
    wdir.mkdir(exist_ok=True)
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        os.environ.setdefault(var, str(wdir))
    os.environ.setdefault("WANDB_MODE", settings.wandb_mode)
    os.environ.setdefault("WANDB_SILENT", "true")
    close_stale_run()
    state = wandb_state(run_dir)
    if not state.get("id"):
        name = run_name(hparams)
        state = {
            "id": secrets.token_hex(4),  # W&B run ids are short [a-z0-9] strings
            "name": name,
            "project": settings.wandb_project,
            "group": settings.wandb_group or setting_name(hparams),
            "step": 0,
        }
        write_wandb_state(run_dir, state)
    remember_run(state["id"])
    logger = WandbLogger(
        project=state.get("project", settings.wandb_project),
        name=state["name"],
        id=state["id"],
        resume="allow",
        group=state["group"],
        job_type=hparams["method"],
        save_dir=str(wdir),
        offline=settings.wandb_mode == "offline",
        tags=[str(hparams["method"]), str(hparams["dataset"])],
    )
    # Lightning passes anonymous=None to wandb.init, which then warns on every run that the
    # setting has no effect; leaving the key out says the same without the warning.
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and init.get("anonymous") is None:
        init.pop("anonymous", None)
    return logger


def tensorboard_logger(run_dir: Path, version: str, purge_step: int | None = None) -> Logger:
    """A TensorBoard logger writing ``RUN/tensorboard/<version>``, whose hyper-parameters need no fake metric.

    ``purge_step``: a resumed fit hides the points its interrupted run logged from that step on
    (the stage it had not committed, trained again), as the CSV drops those rows.

    Raises:
        ConfigError: tensorboard is not installed (tensorboardX alone cannot write the
            hyper-parameter table: ``torch.utils.tensorboard`` needs tensorboard).
    """
    from lightning.fabric.loggers import tensorboard as tb

    if not tb._TENSORBOARD_AVAILABLE:
        alone = " (tensorboardX alone is not enough)" if tb._TENSORBOARDX_AVAILABLE else ""
        raise ConfigError(
            f"trainer.tensorboard=true: the tensorboard package is not available{alone}; "
            "pip install 'fedshard-lightning[tb]' (or pip install tensorboard)"
        )

    class RunTensorBoardLogger(tb.TensorBoardLogger):
        """Writes the settings with the names of the run's metrics (Fabric's would log a placeholder value)."""

        def log_hyperparams(self, params: dict[str, Any], metrics: Any = None, step: Any = None) -> None:
            from torch.utils.tensorboard.summary import hparams

            flat = self._sanitize_params(tb._flatten_dict(dict(params)))
            writer = self.experiment._get_file_writer()
            for summary in hparams(flat, dict.fromkeys(_TB_METRICS, 0.0)):
                writer.add_summary(summary)

    # flush_secs: a killed run keeps its curves (SummaryWriter's default waits two minutes).
    return RunTensorBoardLogger(
        root_dir=str(run_dir),
        name="tensorboard",
        version=version,
        default_hp_metric=False,
        flush_secs=5,
        purge_step=purge_step,
    )


def _free_segment(run_dir: Path, version: str) -> bool:
    """Whether ``logs/<version>`` may take this command's rows: absent, or left empty by a failed one.

    A command that failed (disk full) or was killed between creating its CSV folder and writing a
    row left the folder empty; skipping it had shifted every later ``unlearn-N`` to hold request
    N-1. A TensorBoard segment of that name keeps it taken (its events would mix).
    """
    folder = run_dir / "logs" / version
    if (run_dir / "tensorboard" / version).exists():
        return False
    try:
        return not folder.exists() or (folder.is_dir() and not any(folder.iterdir()))
    except OSError:
        return False


@dataclass(frozen=True)
class LoggerSettings:
    """Which loggers a run writes to, besides the CSV logger that every run has (the trainer's options)."""

    wandb: bool = False
    wandb_project: str = "fedshard-lightning"
    wandb_mode: str = "offline"
    wandb_group: str | None = None
    tensorboard: bool = False
    user_loggers: tuple[Logger, ...] = ()


@dataclass(frozen=True)
class OpenedLoggers:
    """What :func:`open_loggers` made: the loggers, the rows a resumed fit found, its W&B logger.

    Attributes:
        loggers: CSV first, then W&B, TensorBoard and the user's.
        csv_history: The rows of ``logs/metrics.csv`` when a fit resumes (else empty).
        wandb_logger: The W&B logger, if any (a resumed fit may replay the CSV into it).
        deferred: The W&B run is opened only once the resume is accepted
            (:func:`~fedshard_lightning.loggers.wandb_resume.open_resumed_fit_run`).
    """

    loggers: list[Logger]
    csv_history: list[dict[str, str]]
    wandb_logger: Logger | None
    deferred: bool


def open_loggers(
    run_dir: Path, command: str, resume: bool, hparams: dict[str, Any], settings: LoggerSettings
) -> OpenedLoggers:
    """CSV into ``run_dir/logs``, W&B and TensorBoard when asked, the user's; each gets the run's hyper-parameters.

    ``fit`` writes ``logs/metrics.csv`` (a resumed fit appends to it, so the curves of the stages
    before an interruption stay); later commands write ``logs/<command>-N/metrics.csv``. One row
    per round (never per step); the file is written by :class:`~.callbacks.MetricsLogger` at every
    stage end, every few seconds and when the run ends or stops, so a killed run keeps its curves.
    """
    logs = run_dir / "logs"
    csv_history = _read_csv(logs / "metrics.csv") if command == "fit" and resume else []
    version = ""
    if command != "fit" or ((logs / "metrics.csv").exists() and not resume):
        n = 1
        while not _free_segment(run_dir, f"{command}-{n}"):
            n += 1
        version = f"{command}-{n}"
    loggers: list[Logger] = [
        CSVLogger(root_dir=str(run_dir), name="logs", version=version, flush_logs_every_n_steps=2**62)
    ]
    wandb_logger = None
    if settings.wandb:
        wandb_logger = _wandb_logger(run_dir, settings, hparams)
        loggers.append(wandb_logger)
    if settings.tensorboard:
        purge = _resume_step(csv_history) if resume else None
        loggers.append(tensorboard_logger(run_dir, version or "fit", purge))
    loggers += settings.user_loggers
    # A resumed fit's W&B run opens once the resume is accepted (wandb_resume.open_resumed_fit_run).
    deferred = wandb_logger if command == "fit" and resume else None
    for logger in (lg for lg in loggers if lg is not deferred):
        with contextlib.suppress(NotImplementedError):  # Fabric's CSVLogger: config.yaml holds them
            logger.log_hyperparams(hparams)
    if wandb_logger is not None and command == "fit" and deferred is None:
        record_fit_segment(run_dir, wandb_logger)
    return OpenedLoggers(loggers, csv_history, wandb_logger, deferred is not None)


def _read_csv(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def _resume_step(rows: list[dict[str, str]]) -> int:
    """The step a resumed fit logs from: after the last stage summary (a committed stage), else 0."""
    ends = [
        int(float(r["step"]))
        for r in rows
        if any(v not in ("", None) for k, v in r.items() if k.startswith("stage/"))
    ]
    return max(ends, default=-1) + 1


def restore_csv_history(loggers: Sequence[Logger], rows: list[dict[str, str]]) -> tuple[int, int, int]:
    """Write back the rows of the stages an interrupted fit committed; (next step, rounds, client-steps kept).

    Rows after the last stage summary (``stage/...`` columns, logged once the stage's commit
    happened) belong to a stage the resumed fit trains again, so they are dropped, not repeated.
    The round rows' ``client_steps`` column is cumulative: the resumed fit counts on from the
    last kept round's value, as the uninterrupted fit did. ``loggers``: the CSV logger, and the
    W&B logger when the interrupted fits' offline segments were superseded
    (:func:`~fedshard_lightning.loggers.wandb_segments.supersede_fit_segments`).
    """
    with warnings.catch_warnings():  # "previous log files will be deleted": we write them back
        warnings.filterwarnings("ignore", message="Experiment logs directory")
        for logger in loggers:
            _ = logger.experiment
    last = _resume_step(rows) - 1
    if last < 0:
        return 0, 0, 0
    kept = [r for r in rows if r.get("step") not in ("", None) and int(float(r["step"])) <= last]
    rounds = steps = 0
    for r in kept:
        values = {k: float(v) for k, v in r.items() if k != "step" and v not in ("", None)}
        if "round" in values:
            rounds += 1
            steps = int(values.get("client_steps", steps))
        for logger in loggers:
            logger.log_metrics(values, step=int(float(r["step"])))
    for logger in loggers:
        logger.save()
    return last + 1, rounds, steps


def holds_rows(folder: Path) -> bool:
    """Whether a CSV folder has files already (then it is not this command's to remove)."""
    try:
        return folder.is_dir() and any(folder.iterdir())
    except OSError:
        return True


def finish_loggers(
    loggers: list[Logger], wandb: bool, run_dir: Path | None = None, step: int | None = None
) -> None:
    """Finalize every logger; finish the W&B run and remember its last step in ``RUN/wandb.json``."""
    for logger in loggers:
        logger.finalize("success")
    if wandb:
        import wandb as wandb_module

        if wandb_module.run is not None:
            write_offline_readable(wandb_module.run)
            wandb_module.finish()
        if run_dir is not None and step is not None and (run_dir / "wandb.json").is_file():
            state = wandb_state(run_dir)
            state["step"] = max(int(state.get("step", 0)), step)
            write_wandb_state(run_dir, state)


def write_offline_readable(run: Any) -> None:
    """An offline W&B run's config and summary as ``config.json`` and ``summary.json`` beside its ``.wandb`` file.

    The ``.wandb`` file is a log of protobuf records that only ``wandb sync`` (or a parser) reads;
    these two files let a person or a script see what the run holds before it is uploaded. Media
    in the summary (a table, a histogram) appear as W&B's own descriptions of them.
    """
    if not getattr(run, "offline", False):
        return

    def plain(value: Any) -> Any:
        return dict(value) if hasattr(value, "keys") else str(value)

    folder = Path(run.dir).parent
    summary = {key: run.summary[key] for key in run.summary.keys()}  # noqa: SIM118 (Summary has keys(), no iteration)
    for name, payload in (("config.json", dict(run.config)), ("summary.json", summary)):
        (folder / name).write_text(json.dumps(payload, indent=2, default=plain) + "\n")


def log_wandb_report(
    loggers: Sequence[Logger],
    prefix: str,
    tables: dict[str, tuple[Sequence[str], list[list[Any]]]],
    images: dict[str, Path],
    summary: dict[str, Any],
    headline: Sequence[str] = (),
    histograms: dict[str, Sequence[float]] | None = None,
    commit: bool = True,
) -> None:
    """A report into every W&B run among ``loggers`` (nothing when W&B is off).

    ``commit=False`` leaves the tables, images and histograms to the next ``log`` call's history
    row, so that a report logged just before a row of scalars keeps one W&B row per CSV row.

    Tables, images and histograms are logged as ``PREFIX/NAME``; every number or string of ``summary`` goes
    to the run summary as ``PREFIX/KEY``, and the ``headline`` keys also without the prefix, so
    that the W&B runs table can sort runs by them.
    """
    for logger in loggers:
        if type(logger).__name__ != "WandbLogger":  # W&B is imported only where it is used
            continue
        import wandb
        from lightning.pytorch.loggers import WandbLogger

        if not isinstance(logger, WandbLogger):
            continue

        run = logger.experiment
        payload: dict[str, Any] = {
            f"{prefix}/{name}": wandb.Table(columns=list(cols), data=rows)
            for name, (cols, rows) in tables.items()
        }
        payload.update({f"{prefix}/{name}": wandb.Image(str(path)) for name, path in images.items()})
        payload.update(
            {f"{prefix}/{name}": wandb.Histogram(list(values)) for name, values in (histograms or {}).items()}
        )
        run.log(payload, commit=commit)
        for key in headline:
            if summary.get(key) is not None:
                run.summary[key] = summary[key]
        for key, value in summary.items():
            if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                run.summary[f"{prefix}/{key}"] = value
