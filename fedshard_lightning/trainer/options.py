"""The trainer's options checked at construction, so a bad value fails before anything starts.

Every check names the option and the fix in one line (:class:`~fedshard_lightning.errors.ConfigError`);
the CLI prints that line and exits non-zero.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

import lightning as L
from lightning.fabric.loggers import Logger

from fedshard_lightning.callbacks.flcache_checkpoint import FLCacheCheckpoint
from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.engine.grad_clip import ALGORITHMS
from fedshard_lightning.engine.optim import OptimizerSpec, state_kept
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.unlearning.base import Algorithm

__all__ = [
    "as_list",
    "check_devices",
    "check_gradient_clip",
    "check_inputs",
    "check_optimizer_state",
    "check_options",
    "check_tolerance",
    "checkpoint_callback",
]


def as_list(value: Any) -> list[Any]:
    """None -> [], a list or tuple -> a list, anything else -> a one-item list."""
    return [] if value is None else (list(value) if isinstance(value, (list, tuple)) else [value])


def checkpoint_callback(callbacks: list[Any], enable_checkpointing: bool) -> FLCacheCheckpoint | None:
    """The trainer's one :class:`FLCacheCheckpoint`: the user's, a default one, or none with checkpointing off.

    As Lightning refuses a ``ModelCheckpoint`` beside ``enable_checkpointing=False``, a checkpoint
    callback that would never act is refused, and so are two (which one would set the exports?).
    """
    if not isinstance(enable_checkpointing, bool):
        raise ConfigError(f"trainer.enable_checkpointing={enable_checkpointing!r}: give true or false")
    given = [c for c in callbacks if isinstance(c, FLCacheCheckpoint)]
    if given and not enable_checkpointing:
        raise ConfigError(
            "trainer.enable_checkpointing=false, but trainer.callbacks lists an FLCacheCheckpoint: remove "
            "one of the two (false keeps only the final model)"
        )
    if len(given) > 1:
        raise ConfigError(
            f"trainer.callbacks lists {len(given)} FLCacheCheckpoint callbacks: give one (it sets what every "
            "commit verifies, keeps and exports)"
        )
    if given:
        return given[0]
    return FLCacheCheckpoint() if enable_checkpointing else None


def check_options(
    algorithm: Algorithm | None,
    vectorize: str,
    precision: str,
    eval_every_n_rounds: int,
    memory_budget_mb: float,
    max_chunk_clients: int | None,
    num_threads: int | None,
    seed: int = 0,
    loggers: list[Any] | None = None,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str | None = None,
    optimizer_state: str = "reset",
) -> Algorithm:
    """Check the trainer's options; returns the algorithm (FedShard's defaults when None).

    Counts must be integers here, not later: a float ``max_chunk_clients`` or ``num_threads``
    failed inside Fabric or the engine with a TypeError that named no option.
    """
    if algorithm is None:
        from fedshard_lightning.unlearning import default_algorithm

        algorithm = default_algorithm()
    if not isinstance(algorithm, Algorithm):
        raise ConfigError(f"trainer.algorithm: expected an Algorithm, got {type(algorithm).__name__}")
    if vectorize not in ("auto", "always", "never"):
        raise ConfigError(f"trainer.vectorize={vectorize!r}: choose auto, always or never")
    # Lightning reads the bare "16" and "bf16" as the mixed settings: refused like them, not trained in float32.
    unified = {"16": "16-mixed", "bf16": "bf16-mixed"}.get(str(precision), str(precision))
    if "mixed" in unified or unified.startswith("transformer-engine"):
        alias = f", which Lightning reads as {unified}" if unified != str(precision) else ""
        raise ConfigError(
            f"trainer.precision={precision!r}{alias}: mixed precision is not supported (the engine "
            "trains in the parameters' own dtype, so autocast would change nothing); use 32-true or "
            "64-true (float64)"
        )
    if not _is_int(eval_every_n_rounds) or eval_every_n_rounds < 0:
        raise ConfigError(f"trainer.eval_every_n_rounds={eval_every_n_rounds!r}: must be an integer >= 0")
    number = isinstance(memory_budget_mb, (int, float)) and not isinstance(memory_budget_mb, bool)
    if not number or not 0 < memory_budget_mb < float("inf"):
        raise ConfigError(f"trainer.memory_budget_mb={memory_budget_mb!r}: must be a positive number of MB")
    if max_chunk_clients is not None and (not _is_int(max_chunk_clients) or max_chunk_clients < 1):
        raise ConfigError(f"trainer.max_chunk_clients={max_chunk_clients!r}: must be an integer >= 1 or null")
    if num_threads is not None and (not _is_int(num_threads) or num_threads < 1):
        raise ConfigError(
            f"trainer.num_threads={num_threads!r}: must be an integer >= 1 (or null for torch's default)"
        )
    cores = os.cpu_count() or 1
    if num_threads is not None and num_threads > THREADS_PER_CORE * cores:
        raise ConfigError(
            f"trainer.num_threads={num_threads}: at most {THREADS_PER_CORE * cores} ({THREADS_PER_CORE} per core, "
            f"{cores} cores here); more threads than cores only slow a run down"
        )
    if not _is_int(seed) or not 0 <= seed < 2**32:
        raise ConfigError(f"trainer.seed={seed!r}: give an integer in [0, 2**32), as seed_everything takes")
    check_gradient_clip(gradient_clip_val, gradient_clip_algorithm)
    if optimizer_state not in ("reset", "keep"):
        raise ConfigError(f"trainer.optimizer_state={optimizer_state!r}: choose reset or keep")
    for logger in loggers or []:
        if not isinstance(logger, Logger):
            raise ConfigError(
                f"trainer.loggers: expected lightning.fabric.loggers.Logger instances, got {type(logger).__name__}"
            )
    return algorithm


def check_gradient_clip(val: Any, algorithm: Any) -> None:
    """Lightning's clipping settings: a finite value >= 0 (0 or null: none) and ``norm`` or ``value``."""
    number = isinstance(val, (int, float)) and not isinstance(val, bool)
    if val is not None and (not number or not 0 <= val < float("inf")):
        raise ConfigError(
            f"trainer.gradient_clip_val={val!r}: must be a finite number >= 0 (0 or null: no clipping)"
        )
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ConfigError(f"trainer.gradient_clip_algorithm={algorithm!r}: choose norm or value")


def check_optimizer_state(setting: str, spec: OptimizerSpec) -> None:
    """Refuse ``keep`` for a client optimizer that keeps no state (plain SGD): there is nothing to carry."""
    if setting == "keep" and not state_kept(spec):
        raise ConfigError(
            f"trainer.optimizer_state=keep: the client optimizer {spec.cls.__name__} keeps no state between "
            "steps (plain SGD); leave optimizer_state at reset, or use momentum or Adam"
        )


#: Most intra-op threads per core: beyond it threads only contend (a typo once asked for 100,000).
THREADS_PER_CORE = 4


def check_devices(accelerator: Any, devices: Any) -> None:
    """Refuse more devices than this machine has, before any process is started.

    ``devices: 1000`` on CPU started at least 166 worker processes, which outlived their killed
    launcher and left the machine unable to fork. CPU devices are processes: at most one per core.
    """
    wanted: int | None = None
    if _is_int(devices):
        wanted = devices
    elif isinstance(devices, str) and devices.strip().isdigit():
        wanted = int(devices)
    elif isinstance(devices, str) and "," in devices:
        wanted = len([d for d in devices.split(",") if d.strip()])
    elif isinstance(devices, (list, tuple)):
        wanted = len(devices)
    if wanted is None or wanted < 1:
        return  # "auto", -1 ("all of them"): Fabric picks what exists
    kind = str(accelerator)
    if kind == "auto":
        import torch

        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        have, what = os.cpu_count() or 1, "CPU cores"
    elif kind in ("cuda", "gpu"):
        import torch

        have, what = torch.cuda.device_count(), "CUDA GPUs"
    else:
        return  # another accelerator: its own count is Fabric's to check
    if wanted > have:
        raise ConfigError(
            f"trainer.devices={devices!r}: this machine has {have} {what} (accelerator {accelerator}); "
            f"give at most {have}"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy ints too


def check_inputs(model: Any, datamodule: Any) -> None:
    """The model is a LightningModule and the data a FederatedDataModule, or one line says so."""
    if not isinstance(model, L.LightningModule):
        raise ConfigError(
            f"model: expected a lightning.LightningModule (forward, training_step, configure_optimizers), "
            f"got {type(model).__name__}"
        )
    if not isinstance(datamodule, FederatedDataModule):
        raise ConfigError(f"data: expected a FederatedDataModule subclass, got {type(datamodule).__name__}")


def check_tolerance(tolerance: Any) -> float:
    """``audit``'s tolerance: a finite number >= 0 (0 asks for bit-exactness)."""
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not 0 <= tolerance < float("inf")
    ):
        raise ConfigError(f"tolerance={tolerance!r}: must be a finite number >= 0 (0 asks for bit-exactness)")
    return float(tolerance)
