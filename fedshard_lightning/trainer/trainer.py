"""FederatedTrainer: owns Fabric, the loop events, every cache commit and check; drives an algorithm.

The subcommands of the CLI are its methods: :meth:`~FederatedTrainer.fit`,
:meth:`~FederatedTrainer.test`, :meth:`~FederatedTrainer.unlearn`, :meth:`~FederatedTrainer.audit`.
It composes small objects that each own one concern: the run directory with its lock and journal
(:mod:`fedshard_lightning.run.directory`), the fingerprint (:mod:`fedshard_lightning.run.fingerprint`), the
cache commits and loads (:mod:`fedshard_lightning.run.store`), the loop events
(:mod:`fedshard_lightning.trainer.loop`), request checks and reports (:mod:`fedshard_lightning.trainer.requests`)
and the loggers (:mod:`fedshard_lightning.loggers.run_loggers`). The algorithm is a policy over explicit state;
it never sees the trainer.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.loggers import Logger
from torch import Tensor

from fedshard_lightning.callbacks import FederatedCallback, FLCacheCheckpoint, default_callbacks
from fedshard_lightning.callbacks.view import RunView
from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.engine.evaluate import Evaluator
from fedshard_lightning.engine.grad_clip import grad_clip
from fedshard_lightning.errors import ConfigError, FedShardError
from fedshard_lightning.flcache.cache import FLCache
from fedshard_lightning.loggers.reporter import RunReporter
from fedshard_lightning.loggers.run_loggers import LoggerSettings, next_log_step, run_hparams
from fedshard_lightning.module import bind_model, param_dtype
from fedshard_lightning.run.checkpoint import CHECKPOINT, save_checkpoint
from fedshard_lightning.run.deployed import save_model
from fedshard_lightning.run.directory import existing_run_dir, new_run_dir, resume_hint, run_lock
from fedshard_lightning.run.fingerprint import body_fingerprint, readable_body
from fedshard_lightning.run.numerics import keep_caller_state
from fedshard_lightning.run.store import RunStore
from fedshard_lightning.trainer.commands import run_audit, run_test
from fedshard_lightning.trainer.dev_run import check_dev_run, dev_folder, dev_line, train_one_round
from fedshard_lightning.trainer.loop import TrainerEvents, check_same_seed, launch_fabric, load_run, run_fit
from fedshard_lightning.trainer.options import (
    as_list,
    check_devices,
    check_inputs,
    check_optimizer_state,
    check_options,
    check_tolerance,
    checkpoint_callback,
)
from fedshard_lightning.trainer.requests import apply_request
from fedshard_lightning.unlearning.base import Algorithm, check_implemented
from fedshard_lightning.unlearning.planner import Planner, check_planner

__all__ = ["FederatedTrainer"]


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
                return run_fit(self, run_dir, resume, exclude_clients or [])
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
        load_run(self, run_dir, command)
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
        return run_test(self, model, datamodule, ckpt_path)

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
            return apply_request(self, clients)

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
            return run_audit(self, tolerance, bool(reference), reference_tolerance)
