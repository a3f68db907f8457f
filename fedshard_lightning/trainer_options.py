"""The trainer's options checked at construction, so a bad value fails before anything starts.

Every check names the option and the fix in one line (:class:`~fedshard_lightning.errors.ConfigError`);
the CLI prints that line and exits non-zero.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.unlearning.base import Algorithm

__all__ = ["as_list", "check_inputs", "check_options", "check_tolerance"]


def as_list(value: Any) -> list[Any]:
    """None -> [], a list or tuple -> a list, anything else -> a one-item list."""
    return [] if value is None else (list(value) if isinstance(value, (list, tuple)) else [value])


def check_options(
    algorithm: Algorithm | None,
    vectorize: str,
    precision: str,
    eval_every_n_rounds: int,
    memory_budget_mb: float,
    max_chunk_clients: int | None,
    num_threads: int | None,
) -> Algorithm:
    """Check the trainer's options; returns the algorithm (FedShard's defaults when None)."""
    if algorithm is None:
        from fedshard_lightning.unlearning import default_algorithm

        algorithm = default_algorithm()
    if not isinstance(algorithm, Algorithm):
        raise ConfigError(f"trainer.algorithm: expected an Algorithm, got {type(algorithm).__name__}")
    if vectorize not in ("auto", "always", "never"):
        raise ConfigError(f"trainer.vectorize={vectorize!r}: choose auto, always or never")
    if "mixed" in str(precision):
        raise ConfigError(
            f"trainer.precision={precision!r}: mixed precision is not supported (the engine trains "
            "in the parameters' own dtype, so autocast would change nothing); use 32-true or 64-true "
            "(float64)"
        )
    if eval_every_n_rounds < 0:
        raise ConfigError(f"trainer.eval_every_n_rounds={eval_every_n_rounds}: must be >= 0")
    if isinstance(memory_budget_mb, bool) or not 0 < memory_budget_mb < float("inf"):
        raise ConfigError(f"trainer.memory_budget_mb={memory_budget_mb!r}: must be a positive number of MB")
    if max_chunk_clients is not None and (isinstance(max_chunk_clients, bool) or max_chunk_clients < 1):
        raise ConfigError(f"trainer.max_chunk_clients={max_chunk_clients!r}: must be >= 1 or null")
    if num_threads is not None and (isinstance(num_threads, bool) or num_threads < 1):
        raise ConfigError(f"trainer.num_threads={num_threads}: must be >= 1 (or null for torch's default)")
    return algorithm


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
