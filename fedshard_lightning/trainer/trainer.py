"""FederatedTrainer: owns Fabric, the loop events, every cache commit and check; drives an algorithm.

The subcommands of the CLI are its methods: :meth:`~FederatedTrainer.fit`,
:meth:`~FederatedTrainer.test`, :meth:`~FederatedTrainer.unlearn`, :meth:`~FederatedTrainer.audit`.
It composes small objects that each own one concern: the run directory with its lock and journal
(:mod:`fedshard_lightning.run.directory`), the fingerprint (:mod:`fedshard_lightning.run.fingerprint`), the
cache commits and loads (:mod:`fedshard_lightning.run.store`), the Fabric launch
(:mod:`fedshard_lightning.trainer.fabric`), request checks and reports (:mod:`fedshard_lightning.trainer.requests`)
and the loggers (:mod:`fedshard_lightning.loggers.run_loggers`). The algorithm is a policy over explicit state;
it never sees the trainer.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.loggers import Logger
from torch import Tensor

from fedshard_lightning.callbacks import FederatedCallback, FLCacheCheckpoint, default_callbacks
from fedshard_lightning.callbacks.dispatch import call_hook
from fedshard_lightning.callbacks.metrics_logger import request_row
from fedshard_lightning.callbacks.view import RunView
from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, RoundInfo
from fedshard_lightning.engine.evaluate import Evaluator
from fedshard_lightning.engine.grad_clip import grad_clip
from fedshard_lightning.engine.optim import state_kept
from fedshard_lightning.errors import CacheError, ConfigError, FedShardError
from fedshard_lightning.flcache.cache import FLCache
from fedshard_lightning.flcache.io import atomic_write_bytes, atomic_write_json, read_json_object
from fedshard_lightning.flcache.schema import schema_of
from fedshard_lightning.loggers.reporter import RunReporter
from fedshard_lightning.loggers.run_loggers import (
    LoggerSettings,
    finish_loggers,
    logged_requests,
    next_log_step,
    run_hparams,
)
from fedshard_lightning.loggers.wandb_segments import close_wandb_run
from fedshard_lightning.module import bind_model, param_dtype
from fedshard_lightning.run import numerics
from fedshard_lightning.run.checkpoint import CHECKPOINT, resolved_config, save_checkpoint, stale_files
from fedshard_lightning.run.deployed import load_model, save_model
from fedshard_lightning.run.directory import (
    Journal,
    check_real_folders,
    existing_run_dir,
    new_run_dir,
    recover_reports,
    resume_hint,
    run_lock,
)
from fedshard_lightning.run.fingerprint import body_fingerprint, readable_body
from fedshard_lightning.run.numerics import keep_caller_state
from fedshard_lightning.run.request_history import check_history
from fedshard_lightning.run.store import RunStore
from fedshard_lightning.trainer.dev_run import check_dev_run, dev_folder, dev_line, train_one_round
from fedshard_lightning.trainer.fabric import all_gather, check_same_seed, launch_fabric
from fedshard_lightning.trainer.options import (
    as_list,
    check_devices,
    check_inputs,
    check_optimizer_state,
    check_options,
    check_tolerance,
    checkpoint_callback,
)
from fedshard_lightning.trainer.requests import (
    check_request,
    request_report,
    request_start_line,
    validate_clients,
    validate_exclude,
)
from fedshard_lightning.trainer.stage_loop import StageLoop
from fedshard_lightning.unlearning.base import Algorithm, check_implemented
from fedshard_lightning.unlearning.context import AlgorithmContext, LoopEvents
from fedshard_lightning.unlearning.contract import check_cost, check_params
from fedshard_lightning.unlearning.planner import Planner, check_planner
from fedshard_lightning.unlearning.reference import certify

__all__ = ["FederatedTrainer", "TrainerEvents", "sample_weighted_average"]


def sample_weighted_average(
    state: dict[str, Tensor], groups: Sequence[Sequence[int]], sizes: Sequence[int]
) -> dict[str, Tensor]:
    """Average of stacked group models ``[G, ...]``, each weighted by its clients' training samples.

    Per-round and per-stage test accuracy both use it, so the two curves describe the same model.
    """
    if len(groups) == 1:  # weight exactly 1.0: the same bits without the arithmetic
        return {k: v[0] for k, v in state.items()}
    w = torch.tensor([float(sum(sizes[c] for c in g)) for g in groups], dtype=torch.float64)
    w = w / w.sum()
    return {k: (v * w.to(v).view(-1, *[1] * (v.ndim - 1))).sum(0) for k, v in state.items()}


class TrainerEvents(LoopEvents):
    """Loop events of one trainer call (``fit``); see the module docstring."""

    def __init__(self, trainer: FederatedTrainer) -> None:
        self.trainer = trainer
        self.global_round = 0
        self.client_steps = 0

    def context(self) -> AlgorithmContext:
        """What the algorithm sees of this trainer's run: engines, client sizes, seed, device, these events."""
        t = self.trainer

        def make_engine(schedule: LocalSchedule, client_fraction: float) -> FederatedEngine:
            engine = FederatedEngine(
                t.module,
                t.datamodule,
                schedule,
                seed=t.seed,
                client_fraction=client_fraction,
                vectorize=t.vectorize,
                max_chunk_clients=t.max_chunk_clients,
                memory_budget_mb=t.memory_budget_mb,
                batch_invariant=t.batch_invariant,
                compile=t.compile,
                gradient_clip_val=t.gradient_clip_val,
                gradient_clip_algorithm=t.gradient_clip_algorithm,
                optimizer_state=t.optimizer_state,
            )
            engine.on_mode = t._print
            engine.on_probe = t._print
            return engine

        return AlgorithmContext(
            make_engine=make_engine,
            client_sizes=t.client_sizes,
            seed=t.seed,
            device=t.device,
            events=self,
            world_size=t.fabric.world_size,
            global_rank=t.fabric.global_rank,
            all_gather=all_gather(t.fabric),
        )

    def stage_start(self, stage: int, groups: Sequence[Group]) -> None:
        """Fire ``on_stage_start``."""
        call_hook(self.trainer.fabric, "on_stage_start", self.trainer.view(), stage=stage, groups=groups)

    def stage_merge(self, stage: int, groups: Any, alphas: Any, rounds: Any) -> None:
        """Fire ``on_stage_merge``."""
        t = self.trainer
        call_hook(
            t.fabric, "on_stage_merge", t.view(), stage=stage, groups=groups, alphas=alphas, rounds=rounds
        )

    def round_end(self, info: RoundInfo, state: dict[str, Tensor], groups: Sequence[Group]) -> None:
        """Measure the round, then fire ``on_round_end``."""
        t = self.trainer
        self.client_steps += info.client_steps
        sizes = t.client_sizes
        active_w = [sum(sizes[c] for c in p) for p in info.participants]
        train_loss = sum(w * loss for w, loss in zip(active_w, info.mean_loss)) / max(sum(active_w), 1)
        metrics: dict[str, float] = {
            "stage": float(info.stage),
            "round": float(info.round),
            "train_loss": float(train_loss),
            "participants": float(sum(len(p) for p in info.participants)),
            "client_steps": float(self.client_steps),
            "round_seconds": info.seconds,
        }
        self.global_round += 1
        if t.eval_every_n_rounds and self.global_round % t.eval_every_n_rounds == 0:
            avg = sample_weighted_average(state, [g.clients for g in groups], sizes)
            acc, loss = t.evaluate(avg)
            metrics.update(test_accuracy=acc, test_loss=loss)
        for name, value in info.metrics.items():  # what training_step logged (engine names win)
            metrics.setdefault(name, value)
        metrics["global_round"] = float(self.global_round)
        t.history.append(metrics)
        call_hook(t.fabric, "on_round_end", t.view(), info=info, metrics=metrics)

    def stage_end(self, stage: int, metrics: dict[str, float] | None = None) -> None:
        """Commit the stage (rank zero), wait for every rank, then fire ``on_stage_end``."""
        self.checkpoint(f"stage-{stage}")
        call_hook(
            self.trainer.fabric, "on_stage_end", self.trainer.view(), stage=stage, metrics=metrics or {}
        )

    def groups_trained(self, stage: int, groups: Sequence[Group], client_steps: int) -> None:
        """Fire ``on_groups_trained`` (progress of unlearn and audit)."""
        t = self.trainer
        call_hook(
            t.fabric, "on_groups_trained", t.view(), stage=stage, groups=groups, client_steps=client_steps
        )

    def checkpoint(self, label: str, complete: bool | None = None) -> None:
        """Commit the algorithm's state now (complete: as the algorithm says, unless told)."""
        t = self.trainer
        complete = t.algorithm.is_complete() if complete is None else complete
        version = t.store.commit(t.algorithm, label, complete, t.algorithm.engine.mode)
        if version is not None:  # the writing process
            call_hook(t.fabric, "on_commit", t.view(), version=version, label=label)
        # At the first commit: a fit killed later is resumed in the environment it started in.
        if t.is_global_zero and t.run_dir is not None and not (t.run_dir / numerics.FILE).exists():
            numerics.record(t.run_dir, numerics.current(t.algorithm, t.module, t.device, t.tf32))
        t.fabric.barrier()
        if version is None and t.store.cache.exists():  # another process wrote it: on disk for this one too
            t.algorithm.committed(t.store.cache, t.store.cache.current())

    def evaluate(self, params: dict[str, Tensor]) -> tuple[float, float]:
        """The trainer's test-set evaluation."""
        return self.trainer.evaluate(params)


class FederatedTrainer:
    """Runs federated training and unlearning with Lightning Fabric.

    Args:
        algorithm: The method (default: FedShard).
        accelerator: Fabric accelerator (``cpu``, ``cuda``, ``auto``).
        devices: Fabric devices.
        strategy: Fabric strategy.
        precision: Fabric precision, e.g. ``32-true`` or ``64-true`` (float64, for exactness checks);
            ``*-mixed`` is refused (the engine does not autocast).
        callbacks: Extra federated callbacks; progress, metrics, stage-merge, FLCache checkpointing
            and fairness logging are included unless listed here with settings of their own
            (FLCache commits are the trainer's own; :class:`~fedshard_lightning.callbacks.FLCacheCheckpoint`
            sets what each commit verifies, keeps and exports).
        loggers: Extra Fabric loggers; a CSV logger into the run directory is always included.
        wandb: Also log to Weights & Biases, offline unless ``wandb_mode`` says otherwise.
        wandb_project: W&B project name.
        wandb_mode: ``offline`` (default, no account or network needed) or ``online``.
        wandb_group: W&B group of the run (default: the setting without method and seed, e.g.
            ``digits-K32-rho0.5``); give one experiment's runs the same group to compare them.
        tensorboard: Also log to TensorBoard, into ``RUN/tensorboard`` (needs the ``[tb]`` extra).
        default_root_dir: Folder that receives one sub-folder per run.
        run_name: Name of the run folder (default ``version_N``); never overwritten.
        vectorize: ``auto`` (time both once, keep the faster), ``always`` (stacked clients) or
            ``never`` (per-client loop).
        max_chunk_clients: Most clients trained together; ``None`` derives it from the budget.
        memory_budget_mb: Memory the stacked clients of a chunk may use (estimate).
        eval_every_n_rounds: Test-set evaluation period in rounds (0: only at the end).
        enable_progress_bar: Show a progress bar on terminals.
        enable_checkpointing: Keep the FLCache that unlearning retrains from (default), through the
            trainer's :class:`~fedshard_lightning.callbacks.FLCacheCheckpoint` (``checkpoint_callback``).
            False, as in Lightning: the fit keeps only its final model (``model.safetensors``,
            ``model.ckpt``); it still commits each stage while it trains, so a killed fit resumes,
            and empties the cache once it is complete. ``unlearn`` and ``audit`` then refuse.
        enable_fairness: Log M_e and M_p after every fit and unlearn
            (:class:`~fedshard_lightning.callbacks.FairnessLogger`; list one in ``callbacks`` to
            configure it).
        num_threads: Intra-op CPU threads during this trainer's calls (``None``: torch's
            default); the caller's count is back after each call. Recorded in config.yaml and,
            with the device and torch version, in ``RUN/numerics.json``; unlearn and audit reuse
            fit's count (docs/unlearning.md).
        seed: Training seed in [0, 2**32) (the CLI fills it from ``seed_everything``). A call
            seeds torch with it and gives the caller its own generator state back afterwards.
        batch_invariant: Give every client the same float32 bits whoever shares its computation,
            so unlearning audits bit-exact (default; costs time on launch-bound GPU MLPs, see the
            "invariance cost" column in docs/gpu.md). False lets stacked calls shrink as clients
            finish.
        compile: ``torch.compile`` the stacked step (equal to eager in float64; other float32 bits,
            so unlearn and audit use fit's setting; no speed-up measured).
        tf32: TF32 tensor cores on CUDA: ``null`` keeps torch's defaults (convolutions in TF32,
            matmuls in IEEE float32), ``true`` TF32 in both, ``false`` IEEE float32 in both.
            Every setting is deterministic and audits bit-exact; each gives other bits, so the
            flags are recorded in ``RUN/numerics.json`` and reused by unlearn and audit.
        gradient_clip_val: Clip each client's gradients before each local step, as Lightning's
            Trainer does, by this norm (or value); null or 0: no clipping. Each client is clipped by
            its own gradients only (a norm over all clients would couple them). Recorded with the
            run: unlearn and audit refuse another setting.
        gradient_clip_algorithm: ``norm`` (default) or ``value``. A model's own
            ``configure_gradient_clipping`` is called with both, on one client's gradients at a
            time (on the per-client loop).
        optimizer_state: ``reset`` (default, the usual federated convention: each client's optimizer
            starts fresh every round) or ``keep`` (a stateful optimizer such as Adam carries each
            client's state from its last round to its next within a stage; trains on the per-client
            loop; recorded with the run, and refused for an optimizer without state).
        fast_dev_run: ``fit`` trains one round of one stage on a few clients, prints one line and
            saves nothing (no run folder, cache or model), to find bugs before a long run.
    """

    def __init__(
        self,
        algorithm: Algorithm | None = None,
        accelerator: str = "cpu",
        devices: int | str = 1,
        strategy: str = "auto",
        precision: str = "32-true",
        callbacks: list[FederatedCallback] | FederatedCallback | None = None,
        loggers: list[Logger] | Logger | None = None,
        wandb: bool = False,
        wandb_project: str = "fedshard-lightning",
        wandb_mode: Literal["offline", "online"] = "offline",
        wandb_group: str | None = None,
        tensorboard: bool = False,
        default_root_dir: str = "runs",
        run_name: str | None = None,
        vectorize: Literal["auto", "always", "never"] = "auto",
        max_chunk_clients: int | None = None,
        memory_budget_mb: float = 2048.0,
        eval_every_n_rounds: int = 1,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        enable_fairness: bool = True,
        num_threads: int | None = None,
        seed: int = 0,
        batch_invariant: bool = True,
        compile: bool = False,
        tf32: bool | None = None,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] | None = None,
        fast_dev_run: bool = False,
        optimizer_state: Literal["reset", "keep"] = "reset",
    ) -> None:
        algorithm = check_options(
            algorithm,
            vectorize,
            precision,
            eval_every_n_rounds,
            memory_budget_mb,
            max_chunk_clients,
            num_threads,
            seed,
            as_list(loggers),
            gradient_clip_val,
            gradient_clip_algorithm,
            optimizer_state,
        )
        check_devices(accelerator, devices)
        self.algorithm = algorithm
        self.accelerator, self.devices, self.strategy, self.precision = (
            accelerator,
            devices,
            strategy,
            precision,
        )
        self.user_callbacks = as_list(callbacks)
        self.checkpoint_callback: FLCacheCheckpoint | None = checkpoint_callback(
            self.user_callbacks, enable_checkpointing
        )
        self.user_loggers = as_list(loggers)
        self.wandb, self.wandb_project, self.wandb_mode = wandb, wandb_project, wandb_mode
        self.wandb_group, self.tensorboard = wandb_group, bool(tensorboard)
        self.log_step_start = 0
        self.default_root_dir, self.run_name = default_root_dir, run_name
        self.vectorize = vectorize
        self.max_chunk_clients = None if max_chunk_clients is None else int(max_chunk_clients)
        self.memory_budget_mb = memory_budget_mb
        self.eval_every_n_rounds, self.enable_progress_bar = eval_every_n_rounds, enable_progress_bar
        self.enable_fairness = bool(enable_fairness)
        self.num_threads = None if num_threads is None else int(num_threads)
        self.seed = int(seed)
        self.batch_invariant, self.compile = bool(batch_invariant), bool(compile)
        self.tf32 = None if tf32 is None else bool(tf32)
        self.gradient_clip_val = None if gradient_clip_val is None else float(gradient_clip_val)
        self.gradient_clip_algorithm = gradient_clip_algorithm or "norm"
        self.fast_dev_run = bool(fast_dev_run)
        self.optimizer_state = optimizer_state
        self.numerics_notes: list[str] = []
        self.config_yaml: str | None = None
        self.fabric: L.Fabric | None = None
        self.reporter: RunReporter | None = None  # the console and loggers, once launched
        self.module: L.LightningModule | None = None
        self.datamodule: FederatedDataModule | None = None
        self.run_dir: Path | None = None
        self.store: RunStore | None = None
        self.history: list[dict[str, float]] = []
        self.client_sizes: list[int] = []
        self._test_data: tuple[Tensor, Tensor] | None = None
        self._evaluator: Evaluator | None = None

    # -- properties ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The Fabric device."""
        return self.fabric.device

    @property
    def is_global_zero(self) -> bool:
        """True on the process that writes files."""
        return self.fabric is None or self.fabric.is_global_zero

    @property
    def callbacks(self) -> list[FederatedCallback]:
        """Callbacks in firing order."""
        return self._callbacks

    @property
    def cache(self) -> FLCache | None:
        """The run's FLCache (read it; commits go through :attr:`store`)."""
        return self.store.cache if self.store is not None else None

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Reports of the run's applied unlearning requests."""
        return self.store.requests if self.store is not None else []

    # -- setup -----------------------------------------------------------------------------------
    def _launch(self, warn: bool = True) -> None:
        """Create and launch Fabric once (with ``strategy: ddp`` this starts the other processes).

        ``warn``: check the threads against the cores now (a fit); test, unlearn and audit take
        fit's count and check that one instead.
        """
        if self.fabric is not None:
            return
        self.fabric = launch_fabric(
            self.accelerator, self.devices, self.strategy, self.precision, self.num_threads, self.tf32, warn
        )
        self.reporter = RunReporter(self.fabric)
        if self.fabric.world_size > 1:  # before anything is created or trained
            check_same_seed(self.fabric, self.seed)

    def _setup(
        self, model: L.LightningModule, datamodule: FederatedDataModule, run_dir: Path, command: str
    ) -> None:
        check_inputs(model, datamodule)
        self._launch(warn=command == "fit")
        self.run_dir, self._command = run_dir, command
        self.module, self.datamodule = model, datamodule
        # Fabric takes loggers and callbacks at construction, but the run directory (where the
        # loggers write) is only known after launch on multi-process runs: attach them now.
        self._callbacks = default_callbacks(
            self.user_callbacks, self.enable_progress_bar, self.enable_fairness, self.checkpoint_callback
        )
        self.fabric._callbacks = self._callbacks
        resume = command == "fit" and (run_dir / "cache" / "CURRENT").exists()
        hparams = (
            run_hparams(
                model,
                datamodule,
                self.algorithm,
                self.seed,
                self.precision,
                self.vectorize,
                len(self.client_sizes),
            )
            if self.fabric.is_global_zero
            else {}
        )
        settings = LoggerSettings(
            self.wandb,
            self.wandb_project,
            self.wandb_mode,
            self.wandb_group,
            self.tensorboard,
            tuple(self.user_loggers),
        )
        self.reporter.open(run_dir, command, resume, hparams, settings)
        with self.fabric.rank_zero_first():
            datamodule.prepare_data()
        datamodule.setup("fit")
        self.client_sizes = [int(n) for n in datamodule.client_sizes]  # O(K): once, not every round
        torch.manual_seed(self.seed)
        bind_model(model, datamodule.input_shape, datamodule.num_classes)
        self.module = self.fabric.strategy.precision.convert_module(model).to(self.device)
        datamodule.to(self.device)
        # The test tensors and the evaluator's module copy are set up here, with the data, so the
        # first round's evaluation costs what every later one does (2.3 ms less on the digits MLP).
        self._test_data = datamodule.test_data(param_dtype(self.module))
        self._evaluator = Evaluator(self.module)
        self._evaluator.prepare()
        self.history = []
        self._events = TrainerEvents(self)
        check_planner(self.algorithm) if isinstance(self.algorithm, Planner) else check_implemented(
            self.algorithm
        )
        self.algorithm.setup(self._events.context())
        check_optimizer_state(self.optimizer_state, self.algorithm.engine.spec)
        body = readable_body(self.module, datamodule, self.algorithm, self.seed)  # the data hashed once
        clip = grad_clip(self.module, self.gradient_clip_val, self.gradient_clip_algorithm)
        body["gradient_clip"] = clip.record() if clip is not None else {"val": None}
        body["optimizer_state"] = self.optimizer_state
        self.store = RunStore(
            FLCache(run_dir / "cache"),
            body_fingerprint(body),
            self.seed,
            write=self.is_global_zero,
            body=body,
        )

    def evaluate(self, params: dict[str, Tensor]) -> tuple[float, float]:
        """Test accuracy and loss of a model given by its parameters."""
        if self._test_data is None:
            self._test_data = self.datamodule.test_data(param_dtype(self.module))
        if self._evaluator is None:
            self._evaluator = Evaluator(self.module)
        return self._evaluator(params, *self._test_data)

    def _set_params(self, params: dict[str, Tensor]) -> None:
        named = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        with torch.no_grad():
            for k, v in params.items():
                named[k].copy_(v)

    def _write_model(self, params: dict[str, Tensor]) -> None:
        """The deployed model: ``model.safetensors`` and the Lightning checkpoint ``model.ckpt``."""
        self._set_params(params)
        save_model(self.run_dir / "model.safetensors", self.module.state_dict())
        if self.save_ckpt:
            save_checkpoint(self.run_dir / CHECKPOINT, self.module)
        else:  # an older export would stand for another model
            (self.run_dir / CHECKPOINT).unlink(missing_ok=True)

    @property
    def save_ckpt(self) -> bool:
        """Whether the deployed model is also written as ``model.ckpt`` (the checkpoint callback's ``save_ckpt``)."""
        return self.checkpoint_callback is None or self.checkpoint_callback.save_ckpt

    def _print(self, text: str) -> None:
        if self.is_global_zero:
            print(text, flush=True)

    def record_config(self, text: str) -> None:
        """The command line's resolved config (YAML): fit writes it into the run directory as ``config.yaml``."""
        self.config_yaml = text

    def view(self) -> RunView:
        """What callbacks see of the run now (read-only; made for each hook call)."""
        return RunView(
            run_dir=self.run_dir,
            algorithm=self.algorithm,
            module=self.module,
            datamodule=self.datamodule,
            client_sizes=self.client_sizes,
            history=self.history,
            log_step_start=self.log_step_start,
            is_global_zero=self.is_global_zero,
            show_progress=self.enable_progress_bar,
            cache=self.cache,
            writer=self.reporter,
            evaluate=self.evaluate,
        )

    def _dev_run(
        self, model: L.LightningModule, datamodule: FederatedDataModule, ckpt_path: str | None
    ) -> dict[str, Any]:
        """``fast_dev_run``: one round on a few clients in a folder removed afterwards (:mod:`.dev_run`)."""
        check_dev_run(ckpt_path)
        self.wandb, self.tensorboard, self.user_loggers = False, False, []
        self._launch()
        try:
            with dev_folder(self.fabric) as folder:
                self._setup(model, datamodule, folder, "fit")
                result = train_one_round(self.algorithm.engine, self.client_sizes, self.evaluate)
                self._print(dev_line(result))
                return result
        finally:
            self.run_dir = None

    # -- subcommands -----------------------------------------------------------------------------
    @keep_caller_state
    def fit(
        self,
        model: L.LightningModule,
        datamodule: FederatedDataModule,
        ckpt_path: str | None = None,
        exclude_clients: list[int] | None = None,
    ) -> dict[str, Any]:
        """Train federated; prints the run directory. ``--ckpt_path RUN_DIR`` resumes an interrupted fit.

        Args:
            model: The model to train.
            datamodule: The federated data.
            ckpt_path: Run directory of an interrupted fit to resume.
            exclude_clients: Train as if these clients had left before training (the reference
                that exact unlearning must equal).
        """
        if self.fast_dev_run:
            return self._dev_run(model, datamodule, ckpt_path)
        resume = ckpt_path is not None
        self._launch()
        if resume:
            run_dir = existing_run_dir(ckpt_path, "fit")
        else:
            made = (
                str(new_run_dir(self.default_root_dir, self.run_name, self.config_yaml))
                if self.is_global_zero
                else None
            )
            run_dir = Path(self.fabric.broadcast(made, src=0))
        try:
            with run_lock(run_dir):  # one process trains a run: a second resume stops in one line
                self._setup(model, datamodule, run_dir, "fit")
                self.store.claim(resume)
                if resume:
                    self.store.refuse_final_only("fit")
                self._print(f"run directory: {run_dir}")  # once accepted: a refused fit leaves none
                return self._run_fit(run_dir, resume, exclude_clients or [])
        except BaseException as e:
            # A run that failed before its first cache commit holds nothing worth keeping.
            if not resume and self.is_global_zero and not (run_dir / "cache" / "CURRENT").exists():
                shutil.rmtree(run_dir, ignore_errors=True)
                with contextlib.suppress(AttributeError):  # its line must not suggest resuming it
                    e.removed_run_dir = str(run_dir)
            elif self.is_global_zero and not isinstance(e, (FedShardError, OSError)):  # OSError: one line
                sys.stderr.write(f"{resume_hint(run_dir, self.config_yaml is not None)}\n")
            raise

    def _load_run(
        self, model: L.LightningModule, datamodule: FederatedDataModule, ckpt_path: str, command: str
    ) -> None:
        run_dir = existing_run_dir(ckpt_path, command)
        self._setup(model, datamodule, run_dir, command)
        self._restore_run(run_dir, command)
        self.log_step_start = next_log_step(run_dir)

    @keep_caller_state
    def test(
        self, model: L.LightningModule, datamodule: FederatedDataModule, ckpt_path: str
    ) -> dict[str, Any]:
        """Evaluate a finished run's current model on the test set.

        Args:
            model: The model (same config as the run).
            datamodule: The federated data.
            ckpt_path: Run directory (or a model .safetensors file).
        """
        return self._run_test(model, datamodule, ckpt_path)

    @keep_caller_state
    def unlearn(
        self,
        model: L.LightningModule,
        datamodule: FederatedDataModule,
        ckpt_path: str,
        clients: list[int] | int,
    ) -> dict[str, Any]:
        """Unlearn clients from a finished run, retraining only what their data touched.

        Args:
            model: The model (same config as the run).
            datamodule: The federated data (same config as the run).
            ckpt_path: Run directory created by fit (the CLI reads its config.yaml first).
            clients: Client ids to unlearn, e.g. ``[3, 17]``, or one id (``7``).
        """
        with run_lock(existing_run_dir(ckpt_path, "unlearn")):
            self._load_run(model, datamodule, ckpt_path, "unlearn")
            self.cache.verify()  # every blob of the version it builds on, not only those the load read
            return self._apply_request(clients)

    @keep_caller_state
    def audit(
        self,
        model: L.LightningModule,
        datamodule: FederatedDataModule,
        ckpt_path: str,
        tolerance: float = 0.0,
        reference: bool = True,
        reference_tolerance: float | None = None,
    ) -> dict[str, Any]:
        """Certify exact unlearning: recompute the model without every unlearned client and compare.

        Two recomputations: the run's own engine (must give the same bits) and an independent
        reference (the per-client loop kernel with its own averaging; docs/unlearning.md).

        Args:
            model: The model (same config as the run).
            datamodule: The federated data (same config as the run).
            ckpt_path: Run directory created by fit (the CLI reads its config.yaml first).
            tolerance: Largest accepted max-abs difference from the engine's replay; 0 (bit-exact)
                by default, since the engine is batch-invariant (docs/unlearning.md).
            reference: Also train the independent reference (FedShard, FedAvg, FATS).
            reference_tolerance: Largest accepted relative difference from the reference; null:
                1e-9 in float64, 5e-2 in float32, 2e-1 in half precision.

        Returns:
            The verdict: ``passed`` (False when either check fails; the CLI then exits with status
            1), ``bit_equal``, ``max_abs_diff``, ``final_max_abs_diff``, ``dtype``,
            ``reference_max_abs_diff``, ``reference_rel_diff`` and the printed ``lines``
            (FedShard adds ``shards``).
        """
        tolerance = check_tolerance(tolerance)
        if reference_tolerance is not None:
            try:
                reference_tolerance = check_tolerance(reference_tolerance)
            except ConfigError:
                raise ConfigError(
                    f"reference_tolerance={reference_tolerance!r}: must be a finite number >= 0, or null for the "
                    "dtype's default"
                ) from None
        with run_lock(existing_run_dir(ckpt_path, "audit")):
            self._load_run(model, datamodule, ckpt_path, "audit")
            return self._run_audit(tolerance, bool(reference), reference_tolerance)

    # -- the commands' bodies ---------------------------------------------------------------------
    def _run_fit(self, run_dir: Path, resume: bool, exclude: list[int]) -> dict[str, Any]:
        """``fit`` after setup: resume or reset the state, train, commit what no stage committed, write files.

        A resumed run continues from the restored state (``Algorithm.resumable``); any other fit
        resets the state first, so a reused algorithm instance trains like a fresh one. When the
        algorithm reported no final ``stage_end``, the finished state is committed here.
        """
        config = run_dir / "config.yaml"
        # new_run_dir wrote the CLI's config before any data was read; once the data has resolved the
        # model's shapes, the run records them (a resumed run's own config stays as it is)
        if (
            self.config_yaml is not None
            and self.is_global_zero
            and (not config.exists() or config.read_text() == self.config_yaml)
        ):
            resolved = resolved_config(self.config_yaml, self.module)
            if not config.exists() or resolved != self.config_yaml:
                atomic_write_bytes(config, resolved.encode())
        t0 = time.perf_counter()
        alg, resumed, finished = self.algorithm, False, False
        if resume and self.store.cache.exists():
            manifest = self.store.restore(alg, self.device, self.vectorize)
            # A CURRENT rolled back past a request would otherwise resume as a run never unlearned; the
            # stages to come would extend a broken manifest chain without a word.
            self.store.cache.history()
            check_history(run_dir, self.store.cache, manifest)
            if self.store.requests:
                raise CacheError(
                    f"{self.store.cache.root}: this run has unlearning requests already; it cannot be resumed"
                )
            resumed = alg.resumable(manifest)
            finished = resumed and bool(manifest.get("complete"))
            if resumed:  # the stages to come must round like the committed ones (threads, ...)
                self._reproduce_numerics(run_dir)
        # W&B too when its segment takes the others' place (wandb_resume)
        replay = self.reporter.open_resumed_fit(run_dir, resumed, finished)
        if resumed and self.fabric.loggers and self.is_global_zero:
            events = self._events
            self.log_step_start, events.global_round, events.client_steps = self.reporter.restore_rows(replay)
        if not resumed:
            alg.reset(alg.engine.module_params(), exclude=validate_exclude(exclude, alg.num_clients))
            self.store.requests, self.store.complete_committed = [], False
        kept = state_kept(alg.engine.spec)
        if (
            kept and self.optimizer_state == "reset"
        ):  # never silently: a user of Adam may expect its moments kept
            self._print(
                f"note: the client optimizer {alg.engine.spec.cls.__name__} keeps state ({', '.join(kept)}); each "
                "client starts every round with a fresh optimizer, so that state is reset every round "
                "(trainer.optimizer_state keep carries it between rounds)"
            )
        call_hook(self.fabric, "on_fit_start", self.view())
        try:
            if finished:
                params = check_params(alg, alg.current_params(), "current_params")
            elif isinstance(alg, Planner):  # the trainer runs a planner's loop
                params = StageLoop(alg, self._events).fit()
            else:
                params = check_params(alg, alg.fit(), "fit")
        except BaseException:
            for logger in self.fabric.loggers:  # rows are written in batches: keep the stopped fit's
                with contextlib.suppress(OSError):
                    logger.save()
            close_wandb_run(self.wandb)  # its segment is complete: a resume in this process writes a new one
            raise
        if not self.store.complete_committed:  # the algorithm reported no final stage: commit it here
            self._events.checkpoint("fit", complete=True)  # fit returned: the state is final
        seconds = time.perf_counter() - t0
        acc, loss = self.evaluate(params)
        metrics = {
            "test_accuracy": acc,
            "test_loss": loss,
            "client_steps": int(alg.total_client_steps),
            "seconds": seconds,
            "algorithm": alg.name,
            "num_clients": len(self.client_sizes),
            "vectorize_mode": alg.engine.mode,
            "resumed": resumed,
        }
        recorded = read_json_object(run_dir / "metrics.json") if finished else None
        if recorded is not None:  # a complete run resumed: nothing trained, so fit's own record stands
            self._print(f"fit: {run_dir} was already complete; nothing was trained (its metrics.json stands)")
            metrics = recorded
        if self.is_global_zero:
            if recorded is None or stale_files(run_dir, params, self.device, self.save_ckpt):
                self._write_model(params)
            if recorded is None:
                atomic_write_json(run_dir / "metrics.json", metrics)
            if read_json_object(run_dir / numerics.FILE) is None:  # recorded at the first commit
                numerics.record(run_dir, numerics.current(alg, self.module, self.device, self.tf32))
            for name, text in alg.run_files().items():
                (run_dir / name).write_text(text)
        call_hook(self.fabric, "on_fit_end", self.view(), metrics=metrics)
        if self.checkpoint_callback is None:  # enable_checkpointing false: the final model only
            freed = self.store.drop_cache(alg)
            self._print(
                f"kept only the final model (trainer.enable_checkpointing false): removed the FLCache "
                f"({freed / 2**20:.1f} MiB); unlearn and audit need it"
            )
            self.fabric.barrier()
        finish_loggers(self.fabric.loggers, self.wandb, run_dir, self.log_step_start + len(self.history) + 1)
        total = time.perf_counter() - t0  # with the callbacks' work at the end (replay, plots) and logging
        self._print(
            f"fit done: test_accuracy={acc:.4f} test_loss={loss:.4f} client_steps={metrics.get('client_steps')} "
            f"seconds={seconds:.1f} (total {total:.1f} with callbacks and logging) -> {run_dir}"
        )
        return metrics

    def _reproduce_numerics(self, run_dir: Path) -> None:
        """Take fit's numerical environment, print its notes, and warn if fit's threads now oversubscribe the CPU.

        The launch checked the threads the processes had then; fit's count (:func:`numerics.reproduce`)
        comes later, in every process. A one-process fit with 2 threads resumed by 2 processes on 2
        cores ran 4 threads unwarned: its last 3 stages took 186 s, the whole 2-process fit 17 s.
        """
        before = torch.get_num_threads()
        reproduced = numerics.reproduce(run_dir, self.algorithm, self.module, self.device, self.tf32)
        if reproduced.compile is not None:  # engines made from now on compile as fit's did
            self.compile = reproduced.compile
        if reproduced.tf32_changed:
            self.tf32 = reproduced.tf32
        self.numerics_notes = reproduced.notes
        for note in self.numerics_notes:
            self._print(f"warning: numerics: {note}")
        threads, world = torch.get_num_threads(), self.fabric.world_size
        # A resumed fit's launch checked these threads already; test, unlearn and audit launch unchecked.
        checked_at_launch = getattr(self, "_command", None) == "fit" and threads == before
        if not checked_at_launch and self.device.type == "cpu":
            crowded = numerics.oversubscription_warning(threads * world)
            if crowded and self.is_global_zero:
                sys.stderr.write(
                    f"{crowded.split('; try')[0]} ({threads} thread(s), fit's count, kept for the same bits, in each of "
                    f"{world} process(es)); run it with fewer processes (--trainer.devices) or on a quieter machine\n"
                )

    def _restore_run(self, run_dir: Path, command: str) -> None:
        """After setup: restore a finished run's state (fingerprint checked), then repair what a crash left.

        The cache is the truth: ``model.safetensors`` is rewritten when it differs from the cache's
        current model, and reports or journal lines of committed requests are re-created.
        """
        self.store.refuse_final_only(command)
        if not self.store.cache.exists():
            current = self.store.cache.root / "CURRENT"
            if current.exists() or current.is_symlink():  # there, but not a regular file
                raise CacheError(
                    f"{current} is not a regular file: the run directory is damaged; restore it from a backup"
                )
            raise CacheError(
                f"{run_dir} has no committed FLCache (cache/CURRENT); was fit interrupted before stage 1?"
            )
        manifest = self.store.restore(self.algorithm, self.device, self.vectorize)
        self.store.cache.history()  # every older manifest there and unchanged: unlearn builds on the chain
        check_history(run_dir, self.store.cache, manifest)  # before the model file is written from it
        self._reproduce_numerics(run_dir)
        if not manifest.get("complete"):
            raise CacheError(
                f"{self.store.cache.root}: {self.algorithm.progress()}; "
                "resume it with fit --ckpt_path RUN_DIR first"
            )
        if not self.is_global_zero:
            return
        # The cache is the truth: re-create what a crash after a commit may have left stale.
        params = self.algorithm.current_params()
        stale = stale_files(run_dir, params, self.device, self.save_ckpt)
        if stale:
            self._write_model(params)  # never silently: a reader learns that the file had drifted
            self._print(
                f"note: {' and '.join(str(run_dir / n) for n in stale)} differed from the cache or was missing "
                "(or was a symbolic link); rewrote it from the cache"
            )
        else:
            self._set_params(params)
        recover_reports(run_dir, self.store.cache, self.store.requests, Journal(run_dir))

    def _log_lost_requests(self) -> int:
        """Log the rows of committed requests whose process was killed before logging them; how many.

        Each takes the next step, in request order, so the rows stay in the order of the requests.
        """
        if not self.is_global_zero:
            return 0
        logged = logged_requests(self.run_dir)
        lost = [r for r in self.store.requests if int(r.get("request", 0)) not in logged]
        for report in lost:
            self.reporter.log(request_row(report), step=self.log_step_start)
            self.log_step_start += 1
        return len(lost)

    def _apply_request(self, clients: Any) -> dict[str, Any]:
        """One request on a loaded run (the caller holds the run lock): check, journal, unlearn, commit, report.

        The new state comes from the algorithm's pure ``what_if``; it becomes the algorithm's state
        and is committed as one cache version before the model file, the report and the journal's
        ``committed`` line are written (a crash in between is repaired by the next load).
        """
        alg, store = self.algorithm, self.store
        ids = validate_clients(clients, alg.num_clients)
        noop, message = check_request(ids, alg.unlearned, store.requests, alg.num_clients)
        self._log_lost_requests()
        if noop is not None:  # close the loggers (and the W&B run) whether or not a late row was logged
            finish_loggers(self.fabric.loggers, self.wandb, self.run_dir, self.log_step_start)
            self._print(message)
            return noop
        number = len(store.requests) + 1
        journal = Journal(self.run_dir, enabled=self.is_global_zero)
        journal.append({"event": "started", "request": number, "clients": ids})
        call_hook(self.fabric, "on_unlearn_start", self.view(), clients=ids)
        before = self.evaluate(alg.current_params())
        predicted = check_cost(alg, alg.predict_cost(ids), "predict_cost()")
        retrain = check_cost(alg, alg.retrain_cost(ids), "retrain_cost()")
        self._print(request_start_line(self.run_dir, number, ids, predicted, retrain))
        state, result = alg.what_if(alg.state_dict(), ids)
        alg.load_state_dict(state)
        report = request_report(
            number, ids, alg.name, result, predicted, retrain, before, self.evaluate(result.params)
        )
        store.requests.append(report)
        if self.is_global_zero:
            report["cache_version"] = store.commit(alg, f"unlearn-{number:04d}", True, alg.engine.mode)
            call_hook(
                self.fabric,
                "on_commit",
                self.view(),
                version=report["cache_version"],
                label=f"unlearn-{number:04d}",
            )
            try:
                self._write_request_files(journal, number, ids, result.params, report)
            except OSError as e:  # the request is in the cache: its one line must not ask to redo it
                e.committed_request = number
                raise
        call_hook(self.fabric, "on_unlearn_end", self.view(), report=report)
        finish_loggers(self.fabric.loggers, self.wandb, self.run_dir, self.log_step_start + 1)
        self._print(
            f"unlearn: clients {ids} removed with {report['client_steps']} client-steps "
            f"(retraining: {report['retrain_client_steps']}, {report['speedup_client_steps']:.2f}x), "
            f"{report['seconds']:.2f}s; test_accuracy {before[0]:.4f} -> {report['test_accuracy_after']:.4f}; "
            f"report: {self.run_dir / 'unlearn_report.json'}"
        )
        return report

    def _write_request_files(
        self, journal: Journal, number: int, ids: list[int], params: Any, report: dict[str, Any]
    ) -> None:
        """After the commit: the model, the reports and the journal's line (the next load repairs any of them)."""
        self._write_model(params)
        rdir = self.run_dir / "unlearning" / f"{number:04d}"
        rdir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(rdir / "report.json", report)
        atomic_write_json(self.run_dir / "unlearn_report.json", report)
        journal.append(
            {
                "event": "committed",
                "request": number,
                "clients": ids,
                "cache_version": report["cache_version"],
            }
        )

    def _run_test(self, model: Any, datamodule: Any, ckpt_path: str | None) -> dict[str, Any]:
        """``test``: on a run directory, the cache's current model; on a lone ``.safetensors`` file, that file.

        A run directory is evaluated from the cache's current model (checksums verified, under the
        run lock), repairing a stale or damaged ``model.safetensors`` from it; a run that kept only
        its final model, or a lone file, is evaluated from the file after its hash, names, shapes and
        dtypes are checked against the configured model.
        """
        path = Path(ckpt_path) if ckpt_path else None
        lone_file = path is not None and path.is_file()
        if lone_file:
            run_dir, weights = path.parent, path
            check_real_folders(run_dir)  # its logs/ are written beside the file
        else:
            run_dir = existing_run_dir(ckpt_path, "test")
            weights = run_dir / "model.safetensors"
        self.enable_progress_bar = False
        if not lone_file and (run_dir / "cache" / "CURRENT").is_file():
            with run_lock(run_dir):
                self._load_run(model, datamodule, str(run_dir), "test")
                self.cache.verify()  # every blob of the version it reports: those the load did not read
                metrics = self._test_metrics(self.algorithm.current_params(), weights)
                row = {f"test/{k}": metrics[k] for k in ("test_accuracy", "test_loss")}
                self.reporter.log_result(run_dir, row, self.log_step_start)
                return metrics
        if not lone_file and not weights.is_file():
            raise CacheError(
                f"{run_dir} has no committed FLCache (cache/CURRENT) and no model file; was fit interrupted "
                "before stage 1? resume it with fit --ckpt_path RUN_DIR"
            )
        self._setup(model, datamodule, run_dir, "test")  # a model file: its hash, names, shapes and dtypes
        self.module.load_state_dict(load_model(weights, schema_of(self.module.state_dict()), self.device))
        metrics = self._test_metrics(self.algorithm.engine.module_params(), weights)
        finish_loggers(self.fabric.loggers, self.wandb)  # a lone model file: its folder is no run
        return metrics

    def _test_metrics(self, params: dict[str, Tensor], weights: Path) -> dict[str, Any]:
        acc, loss = self.evaluate(params)
        metrics = {"test_accuracy": acc, "test_loss": loss, "checkpoint": str(weights)}
        call_hook(self.fabric, "on_test_end", self.view(), metrics=metrics)
        self._print(f"test: test_accuracy={acc:.4f} test_loss={loss:.4f} ({weights})")
        return metrics

    def _run_audit(
        self, tolerance: float, reference: bool = True, reference_tolerance: float | None = None
    ) -> dict[str, Any]:
        """``audit`` once the run is loaded: print both checks and the verdict; a failure names the likely cause.

        The checks are :func:`~fedshard_lightning.unlearning.reference.certify`'s: bit-equality with the
        run's own engine and the difference from the independent reference. The result says whether
        both passed (``passed``); the CLI turns a failure into exit status 1.
        """
        call_hook(self.fabric, "on_audit_start", self.view())
        result = certify(self.algorithm, tolerance, reference, reference_tolerance)
        call_hook(self.fabric, "on_audit_end", self.view(), result=result)
        if result["engine_passed"] and not result["passed"]:
            result["lines"].append(
                "likely cause: the engine replays its own model, but the independent reference trains another: "
                "a fault in the engine's training or averaging, or a reference tolerance too tight for this dtype"
            )
        elif not result["passed"]:
            dtype = next(self.module.parameters()).dtype
            notes = list(self.numerics_notes)
            if dtype not in (torch.float32, torch.float64):  # the stacked step is invariant in these only
                notes.append(
                    f"dtype {dtype}: exactness is certified in float32 and float64 only (in half precision some CPU "
                    "kernels round an element by its position in the stacked call); use 32-true, or audit with --tolerance"
                )
            cause = (
                "; ".join(notes)
                if notes
                else "no difference in the recorded numerical environment: were the cache, the model or the "
                "training samples changed (the run's fingerprint covers the data's labels and partition, not "
                "the sample values), or was fit run with trainer.batch_invariant false?"
            )
            result["lines"].append(f"likely cause: {cause}")
        for line in result["lines"]:
            self._print(line)
        row = {
            "audit/passed": float(result["passed"]),
            "audit/max_abs_diff": result["max_abs_diff"],
            "audit/bit_equal": float(result["bit_equal"]),
        }
        if "reference_rel_diff" in result:
            row["audit/reference_max_abs_diff"] = result["reference_max_abs_diff"]
            row["audit/reference_rel_diff"] = result["reference_rel_diff"]
        self.reporter.log_result(self.run_dir, row, self.log_step_start)
        return result  # a failure is the CLI's exit status 1, never a SystemExit from a Python call
