"""FederatedTrainer: owns Fabric, the run directory, callbacks and loggers; drives an algorithm.

The subcommands of the CLI are its methods: :meth:`fit`, :meth:`test`, :meth:`unlearn`,
:meth:`audit`. A run directory holds everything a run leaves behind::

    runs/version_3/
        config.yaml            resolved config (CLI runs)
        model.safetensors      the current global model (after every applied unlearning request)
        metrics.json           final metrics of fit
        logs/metrics.csv       per-round metrics (CSV logger)
        cache/                 FLCache (see fedshard_lightning.cache)
        unlearning/0001/report.json, unlearn_report.json, unlearning/journal.jsonl
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.loggers import CSVLogger, Logger
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor

from fedshard_lightning.cache import (
    FLCache,
    atomic_save_tensors,
    atomic_write_bytes,
    atomic_write_json,
    load_tensors,
)
from fedshard_lightning.callbacks import FederatedCallback, FLCacheCheckpoint, MetricsLogger, ProgressBar
from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, RoundInfo, evaluate
from fedshard_lightning.engine.allocator import configure_process
from fedshard_lightning.errors import CacheError, ConfigError, FedShardError, UnlearningRequestError
from fedshard_lightning.module import FederatedModule
from fedshard_lightning.unlearning.base import Algorithm

__all__ = ["FederatedTrainer"]


class FederatedTrainer:
    """Runs federated training and unlearning with Lightning Fabric.

    Args:
        algorithm: The method (default: FedShard).
        accelerator: Fabric accelerator (``cpu``, ``cuda``, ``auto``).
        devices: Fabric devices.
        strategy: Fabric strategy.
        precision: Fabric precision, e.g. ``32-true`` or ``64-true`` (float64, for exactness checks).
        callbacks: Extra federated callbacks; progress, metrics logging and FLCache checkpointing
            are always included.
        loggers: Extra Fabric loggers; a CSV logger into the run directory is always included.
        wandb: Also log to Weights & Biases, offline unless ``wandb_mode`` says otherwise.
        wandb_project: W&B project name.
        wandb_mode: ``offline`` (default, no account or network needed) or ``online``.
        default_root_dir: Folder that receives one sub-folder per run.
        run_name: Name of the run folder (default ``version_N``); never overwritten.
        vectorize: ``auto`` (time both once, keep the faster), ``always`` (stacked clients) or
            ``never`` (per-client loop).
        max_chunk_clients: Most clients trained together; ``None`` derives it from the budget.
        memory_budget_mb: Memory the stacked clients of a chunk may use (estimate).
        eval_every_n_rounds: Test-set evaluation period in rounds (0: only at the end).
        enable_progress_bar: Show a progress bar on terminals.
        seed: Training seed (the CLI fills it from ``seed_everything``).
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
        default_root_dir: str = "runs",
        run_name: str | None = None,
        vectorize: Literal["auto", "always", "never"] = "auto",
        max_chunk_clients: int | None = None,
        memory_budget_mb: float = 2048.0,
        eval_every_n_rounds: int = 1,
        enable_progress_bar: bool = True,
        seed: int = 0,
    ) -> None:
        if algorithm is None:
            from fedshard_lightning.unlearning import default_algorithm

            algorithm = default_algorithm()
        if not isinstance(algorithm, Algorithm):
            raise ConfigError(f"trainer.algorithm: expected an Algorithm, got {type(algorithm).__name__}")
        if vectorize not in ("auto", "always", "never"):
            raise ConfigError(f"trainer.vectorize={vectorize!r}: choose auto, always or never")
        if eval_every_n_rounds < 0:
            raise ConfigError(f"trainer.eval_every_n_rounds={eval_every_n_rounds}: must be >= 0")
        self.algorithm = algorithm
        self.accelerator, self.devices, self.strategy, self.precision = (
            accelerator,
            devices,
            strategy,
            precision,
        )
        cbs = (
            []
            if callbacks is None
            else (list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks])
        )
        self.user_callbacks = cbs
        self.user_loggers = (
            [] if loggers is None else (list(loggers) if isinstance(loggers, (list, tuple)) else [loggers])
        )
        self.wandb, self.wandb_project, self.wandb_mode = wandb, wandb_project, wandb_mode
        self.default_root_dir = default_root_dir
        self.run_name = run_name
        self.vectorize = vectorize
        self.max_chunk_clients = max_chunk_clients
        self.memory_budget_mb = memory_budget_mb
        self.eval_every_n_rounds = eval_every_n_rounds
        self.enable_progress_bar = enable_progress_bar
        self.seed = int(seed)
        self.config_yaml: str | None = None
        self.fabric: L.Fabric | None = None
        self.module: FederatedModule | None = None
        self.datamodule: FederatedDataModule | None = None
        self.run_dir: Path | None = None
        self.cache: FLCache | None = None
        self.theta0: dict[str, Tensor] | None = None
        self.fingerprint: str | None = None
        self.requests: list[dict[str, Any]] = []
        self.history: list[dict[str, float]] = []
        self._global_round = 0
        self._client_steps = 0
        self._test_data: tuple[Tensor, Tensor] | None = None
        self._client_sizes: list[int] = []

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

    # -- setup -----------------------------------------------------------------------------------
    def _new_run_dir(self) -> Path:
        """A new folder under the root, never an existing one; ``cache/`` inside marks it as a run."""
        root = Path(self.default_root_dir)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"trainer.default_root_dir={str(root)!r}: cannot create it ({e.strerror})"
            ) from None
        if self.run_name:
            candidates = iter([root / self.run_name])
        else:
            nums = [
                int(p.name[8:])
                for p in root.iterdir()
                if p.name.startswith("version_") and p.name[8:].isdigit()
            ]
            start = max(nums, default=-1) + 1
            candidates = (root / f"version_{n}" for n in range(start, start + 10_000))
        for path in candidates:
            try:
                path.mkdir()
            except FileExistsError:
                if self.run_name:
                    raise ConfigError(
                        f"trainer.run_name={self.run_name!r}: {path} exists already; choose another name, or "
                        f"resume it with --ckpt_path {path}"
                    ) from None
                continue
            except OSError as e:
                raise ConfigError(
                    f"trainer.default_root_dir={str(root)!r}: cannot create {path} ({e.strerror})"
                ) from None
            (path / "cache").mkdir()  # a fit killed before its first commit can still be resumed
            return path
        raise ConfigError(f"trainer.default_root_dir={str(root)!r}: no free version_N folder name")

    @staticmethod
    def _existing_run_dir(ckpt_path: str | None, command: str) -> Path:
        if not ckpt_path:
            raise ConfigError(f"{command} needs --ckpt_path RUN_DIR (the folder that fit created)")
        path = Path(ckpt_path)
        if not path.is_dir():
            raise CacheError(f"ckpt_path={ckpt_path!r}: no such run directory")
        if not (path / "cache").is_dir() and not (path / "model.safetensors").is_file():
            raise CacheError(
                f"ckpt_path={ckpt_path!r} is not a fedshard_lightning run directory (no cache/ inside)"
            )
        return path

    def _loggers(self) -> list[Logger]:
        logs = self.run_dir / "logs"
        version = ""
        if (logs / "metrics.csv").exists() or self._command != "fit":
            n = 1
            while (logs / f"{self._command}-{n}").exists():
                n += 1
            version = f"{self._command}-{n}"
        loggers: list[Logger] = [CSVLogger(root_dir=str(self.run_dir), name="logs", version=version)]
        if self.wandb:
            loggers.append(self._wandb_logger())
        return loggers + self.user_loggers

    def _wandb_logger(self) -> Logger:
        from lightning.pytorch.loggers import WandbLogger

        wdir = self.run_dir / "wandb_files"
        wdir.mkdir(exist_ok=True)
        for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
            os.environ.setdefault(var, str(wdir))
        os.environ.setdefault("WANDB_MODE", self.wandb_mode)
        os.environ.setdefault("WANDB_SILENT", "true")
        dataset = type(self.datamodule).__name__.removesuffix("DataModule").lower()
        return WandbLogger(
            project=self.wandb_project,
            name=f"{self.algorithm.name}-{dataset}-{self.run_dir.name}",
            group=f"{dataset}",
            job_type=self.algorithm.name,
            save_dir=str(wdir),
            offline=self.wandb_mode == "offline",
            tags=[self.algorithm.name, dataset],
        )

    def _setup(
        self, model: FederatedModule, datamodule: FederatedDataModule, run_dir: Path, command: str = "fit"
    ) -> None:
        if not isinstance(model, FederatedModule):
            raise ConfigError(f"model: expected a FederatedModule subclass, got {type(model).__name__}")
        if not isinstance(datamodule, FederatedDataModule):
            raise ConfigError(
                f"data: expected a FederatedDataModule subclass, got {type(datamodule).__name__}"
            )
        self._launch()
        self.run_dir = run_dir
        self._command = command
        self.cache = FLCache(run_dir / "cache")
        self.module, self.datamodule = model, datamodule
        self._callbacks = self._default_callbacks() + self.user_callbacks
        # Fabric takes loggers and callbacks at construction, but the run directory (where the
        # loggers write) is only known after launch on multi-process runs: attach them now.
        self.fabric._callbacks = self._callbacks
        self.fabric._loggers = self._loggers() if self.fabric.is_global_zero else []
        with self.fabric.rank_zero_first():
            datamodule.prepare_data()
        datamodule.setup("fit")
        self._client_sizes = datamodule.client_sizes  # O(K) to compute: once, not every round
        torch.manual_seed(self.seed)
        model.bind_data(datamodule.input_shape, datamodule.num_classes)
        model = self.fabric.strategy.precision.convert_module(model).to(self.device)
        self.module = model
        datamodule.to(self.device)
        self._test_data = None
        self.algorithm.attach(self)
        self.fingerprint = self._fingerprint()

    def _launch(self) -> None:
        """Create and launch Fabric once (with ``strategy: ddp`` this starts the other processes)."""
        if self.fabric is not None:
            return
        try:
            self.fabric = L.Fabric(
                accelerator=self.accelerator,
                devices=self.devices,
                strategy=self.strategy,
                precision=self.precision,
            )
        except (ValueError, TypeError, RuntimeError, MisconfigurationException) as e:
            raise ConfigError(
                f"trainer.accelerator={self.accelerator!r}, trainer.devices={self.devices!r}, "
                f"trainer.strategy={self.strategy!r}, trainer.precision={self.precision!r}: {e}"
            ) from None
        self.fabric.launch()
        configure_process(self.fabric.device)

    def _default_callbacks(self) -> list[FederatedCallback]:
        user_types = {type(c) for c in self.user_callbacks}
        cbs: list[FederatedCallback] = []
        if self.enable_progress_bar and ProgressBar not in user_types:
            cbs.append(ProgressBar())
        if MetricsLogger not in user_types:
            cbs.append(MetricsLogger())
        if FLCacheCheckpoint not in user_types:
            cbs.append(FLCacheCheckpoint())
        return cbs

    def make_engine(self, schedule: LocalSchedule, client_fraction: float) -> FederatedEngine:
        """An engine over the trainer's model and data with the trainer's vectorization settings."""
        return FederatedEngine(
            self.module,
            self.datamodule,
            schedule,
            seed=self.seed,
            client_fraction=client_fraction,
            vectorize=self.vectorize,
            max_chunk_clients=self.max_chunk_clients,
            memory_budget_mb=self.memory_budget_mb,
        )

    def _fingerprint(self) -> str:
        spec = self.algorithm.engine.spec
        body = {
            "data": self.datamodule.fingerprint(),
            "model": f"{type(self.module).__module__}.{type(self.module).__qualname__}",
            "params": {n: list(p.shape) for n, p in self.module.named_parameters()},
            "dtype": str(self.module.param_dtype),
            "optimizer": [
                spec.cls.__name__,
                [(list(n), sorted((k, repr(v)) for k, v in hp.items())) for n, hp in spec.groups],
            ],
            "algorithm": self.algorithm.hparams(),
            "seed": self.seed,
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def check_manifest(self, cache: FLCache, algorithm_name: str) -> dict[str, Any]:
        """The current manifest, refused when it belongs to another config, data or algorithm."""
        manifest = cache.manifest()
        if manifest.get("algorithm") != algorithm_name:
            raise CacheError(
                f"{cache.root} was written by algorithm {manifest.get('algorithm')!r}, not {algorithm_name!r}; "
                "use the config that created the run"
            )
        if manifest.get("fingerprint") != self.fingerprint:
            raise CacheError(
                f"{cache.root} was made with another config or dataset (fingerprint {manifest.get('fingerprint')} "
                f"!= {self.fingerprint}); use the config that created the run (its config.yaml)"
            )
        self.requests = list(manifest.get("requests", []))
        mode = manifest.get("vectorize_mode")
        if self.vectorize == "auto" and mode in ("stacked", "loop"):
            # Replays must take the run's path: the two paths agree only to rounding (float32 ~1e-7).
            self.algorithm.engine.set_mode(mode)
        return manifest

    def cache_extra(self) -> dict[str, Any]:
        """Trainer-level fields every algorithm puts in its manifest."""
        engine = self.algorithm.engine
        return {
            "requests": self.requests,
            "seed": self.seed,
            "vectorize_mode": engine.mode if engine is not None else None,
            "torch_threads": torch.get_num_threads(),
        }

    # -- events from algorithms ------------------------------------------------------------------
    def _test_tensors(self) -> tuple[Tensor, Tensor]:
        if self._test_data is None:
            self._test_data = self.datamodule.test_data(self.module.param_dtype)
        return self._test_data

    def evaluate(self, params: dict[str, Tensor]) -> tuple[float, float]:
        """Test accuracy and loss of a model given by its parameters."""
        x, y = self._test_tensors()
        return evaluate(self.module, params, x, y)

    def stage_start(self, stage: int, groups: Sequence[Group]) -> None:
        """Fired by algorithms before a stage trains."""
        self.fabric.call("on_stage_start", self, stage=stage, groups=groups)

    def round_end(self, info: RoundInfo, state: dict[str, Tensor], groups: Sequence[Group]) -> None:
        """Fired by algorithms after each round: measure, then call the callbacks."""
        self._client_steps += info.client_steps
        sizes = self._client_sizes
        active_w = [sum(sizes[c] for c in p) for p in info.participants]
        train_loss = sum(w * loss for w, loss in zip(active_w, info.mean_loss)) / max(sum(active_w), 1)
        metrics: dict[str, float] = {
            "stage": float(info.stage),
            "round": float(info.round),
            "train_loss": float(train_loss),
            "participants": float(sum(len(p) for p in info.participants)),
            "client_steps": float(self._client_steps),
            "round_seconds": info.seconds,
        }
        self._global_round += 1
        if self.eval_every_n_rounds and self._global_round % self.eval_every_n_rounds == 0:
            weights = torch.tensor(
                [float(sum(sizes[c] for c in g.clients)) for g in groups],
                dtype=torch.float64,
                device=self.device,
            )
            avg = {
                k: (v * (weights / weights.sum()).to(v).view(-1, *[1] * (v.ndim - 1))).sum(0)
                for k, v in state.items()
            }
            acc, loss = self.evaluate(avg)
            metrics.update(test_accuracy=acc, test_loss=loss)
        metrics["global_round"] = float(self._global_round)
        self.history.append(metrics)
        self.fabric.call("on_round_end", self, info=info, metrics=metrics)

    def stage_end(self, stage: int, metrics: dict[str, float] | None = None) -> None:
        """Fired by algorithms after a complete stage (the FLCache checkpoint is written here)."""
        self.fabric.call("on_stage_end", self, stage=stage, metrics=metrics or {})

    # -- files -----------------------------------------------------------------------------------
    def _write_model(self, params: dict[str, Tensor]) -> None:
        named = dict(self.module.named_parameters())
        with torch.no_grad():
            for k, v in params.items():
                named[k].copy_(v)
        atomic_save_tensors(self.run_dir / "model.safetensors", self.module.state_dict())

    def _print(self, text: str) -> None:
        if self.is_global_zero:
            print(text, flush=True)

    def _finish_loggers(self) -> None:
        for logger in self.fabric.loggers:
            logger.finalize("success")
        if self.wandb:
            import wandb

            if wandb.run is not None:
                wandb.finish()

    # -- subcommands -----------------------------------------------------------------------------
    def fit(
        self, model: FederatedModule, datamodule: FederatedDataModule, ckpt_path: str | None = None
    ) -> dict[str, Any]:
        """Train federated; prints the run directory. ``--ckpt_path RUN_DIR`` resumes an interrupted fit.

        Args:
            model: The model to train.
            datamodule: The federated data.
            ckpt_path: Run directory of an interrupted fit to resume.
        """
        resume = ckpt_path is not None
        self._launch()
        if resume:
            run_dir = self._existing_run_dir(ckpt_path, "fit")
        else:
            run_dir = Path(
                self.fabric.broadcast(str(self._new_run_dir()) if self.is_global_zero else None, src=0)
            )
        self._print(f"run directory: {run_dir}")
        try:
            return self._fit(model, datamodule, run_dir, resume)
        except BaseException:
            # A run that failed before its first cache commit holds nothing worth keeping.
            if not resume and self.is_global_zero and not (run_dir / "cache" / "CURRENT").exists():
                shutil.rmtree(run_dir, ignore_errors=True)
            raise

    def _fit(
        self, model: FederatedModule, datamodule: FederatedDataModule, run_dir: Path, resume: bool
    ) -> dict[str, Any]:
        self._setup(model, datamodule, run_dir)
        if self.config_yaml is not None and self.is_global_zero and not (run_dir / "config.yaml").exists():
            atomic_write_bytes(run_dir / "config.yaml", self.config_yaml.encode())
        t0 = time.perf_counter()
        resumed = False
        if resume and self.cache.exists():
            self.check_manifest(self.cache, self.algorithm.name)
            resumed = self.algorithm.resume(self.cache)
            if resumed:
                self.theta0 = self.algorithm.theta0
        if not resumed:
            self.theta0 = self.algorithm.engine.module_params()
        self.fabric.call("on_fit_start", self)
        params = self.algorithm.fit()
        seconds = time.perf_counter() - t0
        acc, loss = self.evaluate(params)
        metrics = {
            "test_accuracy": acc,
            "test_loss": loss,
            "client_steps": int(self.algorithm.total_client_steps),
            "seconds": seconds,
            "algorithm": self.algorithm.name,
            "num_clients": len(datamodule.client_indices),
            "vectorize_mode": self.algorithm.engine.mode,
            "resumed": resumed,
        }
        if self.is_global_zero:
            self._write_model(params)
            atomic_write_json(run_dir / "metrics.json", metrics)
        self.fabric.call("on_fit_end", self, metrics=metrics)
        self._finish_loggers()
        self._print(
            f"fit done: test_accuracy={acc:.4f} test_loss={loss:.4f} client_steps={metrics['client_steps']} "
            f"seconds={seconds:.1f} -> {run_dir}"
        )
        return metrics

    def _load_run(
        self, model: FederatedModule, datamodule: FederatedDataModule, ckpt_path: str, command: str
    ) -> None:
        run_dir = self._existing_run_dir(ckpt_path, command)
        self._setup(model, datamodule, run_dir, command)
        if not self.cache.exists():
            raise CacheError(
                f"{run_dir} has no committed FLCache (cache/CURRENT); was fit interrupted before stage 1?"
            )
        self.algorithm.load_cache(self.cache)
        self.theta0 = self.algorithm.theta0
        self._recover_files()

    def _recover_files(self) -> None:
        """Re-create files that a crash after a cache commit may have left stale (the cache is the truth)."""
        if not self.is_global_zero:
            return
        params = self.algorithm.current_params()
        path = self.run_dir / "model.safetensors"
        named = dict(self.module.named_parameters())
        stale = True
        if path.is_file():
            try:
                on_disk = load_tensors(path, device=self.device)
                stale = any(k not in on_disk or not torch.equal(on_disk[k], v) for k, v in params.items())
            except CacheError:
                stale = True
        if stale:
            self._write_model(params)
        else:
            with torch.no_grad():
                for k, v in params.items():
                    named[k].copy_(v)
        committed = self._journal_committed()
        for i, report in enumerate(self.requests, start=1):
            rpath = self.run_dir / "unlearning" / f"{i:04d}" / "report.json"
            version = report.get("cache_version") or self._version_with_requests(i)
            if not rpath.is_file():
                report = {**report, "cache_version": version}
                rpath.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(rpath, report)
                atomic_write_json(self.run_dir / "unlearn_report.json", report)
            if i not in committed:
                entry = {
                    "event": "committed",
                    "request": i,
                    "clients": report["clients"],
                    "cache_version": version,
                }
                self._journal({**entry, "recovered": True})

    def _journal_committed(self) -> set[int]:
        path = self.run_dir / "unlearning" / "journal.jsonl"
        done: set[int] = set()
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by a crash
                if isinstance(entry, dict) and entry.get("event") == "committed":
                    done.add(int(entry.get("request", -1)))
        return done

    def _version_with_requests(self, n: int) -> str | None:
        """The oldest cache version whose manifest holds at least ``n`` requests (where request n landed)."""
        for version in self.cache.versions():
            try:
                if len(self.cache.manifest(version).get("requests", [])) >= n:
                    return version
            except CacheError:
                continue
        return None

    def test(
        self, model: FederatedModule, datamodule: FederatedDataModule, ckpt_path: str | None = None
    ) -> dict[str, Any]:
        """Evaluate a finished run's current model on the test set.

        Args:
            model: The model (same config as the run).
            datamodule: The federated data.
            ckpt_path: Run directory (or a model .safetensors file).
        """
        path = Path(ckpt_path) if ckpt_path else None
        if path is not None and path.is_file():
            run_dir = path.parent
            weights = path
        else:
            run_dir = self._existing_run_dir(ckpt_path, "test")
            weights = run_dir / "model.safetensors"
        self.enable_progress_bar = False
        self._setup(model, datamodule, run_dir, "test")
        state = load_tensors(weights, device=self.device)
        try:
            self.module.load_state_dict(state, strict=True)
        except RuntimeError as e:
            first = str(e).splitlines()[0] if str(e) else "shape mismatch"
            raise CacheError(
                f"{weights} does not match the configured model ({first}); use the run's config.yaml"
            ) from None
        params = self.algorithm.engine.module_params()
        acc, loss = self.evaluate(params)
        metrics = {"test_accuracy": acc, "test_loss": loss, "checkpoint": str(weights)}
        self.fabric.call("on_test_end", self, metrics=metrics)
        self._print(f"test: test_accuracy={acc:.4f} test_loss={loss:.4f} ({weights})")
        return metrics

    def _validate_clients(self, clients: Any) -> list[int]:
        if isinstance(clients, (int, str)) or clients is None:
            raise UnlearningRequestError(
                f"clients={clients!r}: give a list of client ids, e.g. --clients '[3, 17]'"
            )
        ids = list(clients)
        if not ids:
            raise UnlearningRequestError("clients=[]: name at least one client id to unlearn")
        k = self.algorithm.num_clients
        for c in ids:
            if isinstance(c, bool) or not isinstance(c, int):
                raise UnlearningRequestError(
                    f"clients: {c!r} is not an integer client id (valid ids: 0..{k - 1})"
                )
            if not 0 <= c < k:
                raise UnlearningRequestError(f"clients: unknown client id {c} (valid ids: 0..{k - 1})")
        dups = sorted({c for c in ids if ids.count(c) > 1})
        if dups:
            raise UnlearningRequestError(f"clients: duplicate ids {dups}; name each client once")
        return sorted(ids)

    def unlearn(
        self, model: FederatedModule, datamodule: FederatedDataModule, ckpt_path: str, clients: list[int]
    ) -> dict[str, Any]:
        """Unlearn clients from a finished run, retraining only what their data touched.

        Args:
            model: The model (same config as the run).
            datamodule: The federated data (same config as the run).
            ckpt_path: Run directory created by fit.
            clients: Client ids to unlearn, e.g. ``[3, 17]``.
        """
        self.enable_progress_bar = False
        with _run_lock(self._existing_run_dir(ckpt_path, "unlearn")):
            return self._unlearn(model, datamodule, ckpt_path, clients)

    def _unlearn(
        self, model: FederatedModule, datamodule: FederatedDataModule, ckpt_path: str, clients: list[int]
    ) -> dict[str, Any]:
        self._load_run(model, datamodule, ckpt_path, "unlearn")
        ids = self._validate_clients(clients)
        done = set(self.algorithm.unlearned)
        if set(ids) <= done:
            for i, req in enumerate(self.requests, start=1):
                if sorted(req["clients"]) == ids:
                    self._print(
                        f"unlearn: clients {ids} were already unlearned by request {i:04d}; nothing to do"
                    )
                    return {**req, "already_applied": True}
            self._print(f"unlearn: clients {ids} were already unlearned; nothing to do")
            return {"clients": ids, "already_applied": True}
        again = sorted(set(ids) & done)
        if again:
            raise UnlearningRequestError(
                f"clients: {again} were already unlearned by an earlier request; leave them out"
            )
        if len(set(self.algorithm.active_clients) - set(ids)) == 0:
            raise UnlearningRequestError(
                "clients: the request would unlearn every remaining client; keep at least one"
            )
        number = len(self.requests) + 1
        self._journal({"event": "started", "request": number, "clients": ids})
        self.fabric.call("on_unlearn_start", self, clients=ids)
        before_acc, before_loss = self.evaluate(self.algorithm.current_params())
        predicted = self.algorithm.predict_cost(ids)
        retrain = self.algorithm.retrain_cost(ids)
        result = self.algorithm.unlearn(ids)
        after_acc, after_loss = self.evaluate(result.params)
        report = {
            "request": number,
            "clients": ids,
            "algorithm": self.algorithm.name,
            "client_steps": int(result.client_steps),
            "predicted_client_steps": int(predicted),
            "retrain_client_steps": int(retrain),
            "speedup_client_steps": (retrain / result.client_steps) if result.client_steps else float("inf"),
            "seconds": result.seconds,
            "server_seconds": result.server_seconds,
            "test_accuracy_before": before_acc,
            "test_accuracy_after": after_acc,
            "test_loss_before": before_loss,
            "test_loss_after": after_loss,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **result.details,
        }
        self.requests.append(report)
        if self.is_global_zero:
            version = self.algorithm.write_cache(self.cache, label=f"unlearn-{number:04d}")
            report["cache_version"] = version
            self._write_model(result.params)
            rdir = self.run_dir / "unlearning" / f"{number:04d}"
            rdir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(rdir / "report.json", report)
            atomic_write_json(self.run_dir / "unlearn_report.json", report)
            self._journal({"event": "committed", "request": number, "clients": ids, "cache_version": version})
        self.fabric.call("on_unlearn_end", self, report=report)
        self._finish_loggers()
        self._print(
            f"unlearn: clients {ids} removed with {report['client_steps']} client-steps "
            f"(retraining: {report['retrain_client_steps']}, {report['speedup_client_steps']:.2f}x), "
            f"{report['seconds']:.2f}s; test_accuracy {before_acc:.4f} -> {after_acc:.4f}; "
            f"report: {self.run_dir / 'unlearn_report.json'}"
        )
        return report

    def _journal(self, entry: dict[str, Any]) -> None:
        if not self.is_global_zero:
            return
        path = self.run_dir / "unlearning" / "journal.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), **entry}
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def audit(
        self, model: FederatedModule, datamodule: FederatedDataModule, ckpt_path: str, tolerance: float = 1e-6
    ) -> dict[str, Any]:
        """Certify exact unlearning: replay the frozen tree without every unlearned client and compare.

        Args:
            model: The model (same config as the run).
            datamodule: The federated data (same config as the run).
            ckpt_path: Run directory created by fit.
            tolerance: Largest accepted max-abs difference (float32 training: about 1e-6; float64: 1e-10).
        """
        self.enable_progress_bar = False
        self._load_run(model, datamodule, ckpt_path, "audit")
        audit_fn = getattr(self.algorithm, "audit", None)
        if audit_fn is None:
            raise ConfigError(f"trainer.algorithm: {self.algorithm.name} does not support audit")
        result = audit_fn(tolerance)
        for line in result["lines"]:
            self._print(line)
        if not result["passed"]:
            raise SystemExit(1)
        return result


@contextlib.contextmanager
def _run_lock(run_dir: Path):
    """Hold an exclusive lock on the run directory while a request reads and commits it.

    Two ``unlearn`` processes on one run would each read the same version and the later commit
    would drop the other's request; the second one now stops at once with a one-line error.
    The lock is ``flock`` on the directory itself (no file is created), taken by the launching
    process only (DDP workers have ``LOCAL_RANK`` or ``RANK`` > 0), and released on exit, even by a kill.
    """
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        fcntl = None
    if rank != 0 or fcntl is None:
        yield
        return
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FedShardError(
                f"ckpt_path={run_dir}: another process is unlearning from this run now; "
                "wait for it to finish, then run this request again"
            ) from None
        yield
    finally:
        os.close(fd)
