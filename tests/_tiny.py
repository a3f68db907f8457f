"""Tiny synthetic federated runs shared by the exactness, numerics and run-directory tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedshard_lightning.callbacks import FederatedCallback
from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard


def tiny_data(
    shape: tuple[int, ...] = (10,), k: int = 8, per_client: int = 20, classes: int = 4, **kw: Any
) -> SyntheticDataModule:
    """K clients with Dirichlet(0.5) skew (``partition="iid"`` in ``kw`` for equal sizes)."""
    kw.setdefault("partition", "dirichlet")
    kw.setdefault("rho", 0.5)
    kw.setdefault("min_client_size", 5)
    return SyntheticDataModule(
        num_clients=k,
        num_samples=k * per_client,
        num_test=40,
        shape=shape,
        num_classes_=classes,
        as_uint8=len(shape) == 3,
        **kw,
    )


def small_synthetic() -> SyntheticDataModule:
    """The callback and logger tests' data: 8 Dirichlet(0.5) clients of 6 features, 112 samples."""
    return SyntheticDataModule(
        num_clients=8,
        partition="dirichlet",
        rho=0.5,
        min_client_size=4,
        num_samples=112,
        num_test=40,
        shape=(6,),
    )


def tiny_model(cls: type = MLP) -> torch.nn.Module:
    """A seeded model: an MLP with momentum, or ``cls(lr=0.05)`` (CNNs, ResNets)."""
    torch.manual_seed(0)
    return MLP(hidden=(16,), lr=0.1, momentum=0.5) if cls is MLP else cls(lr=0.05)


def tiny_trainer(root: Path | str, rounds: int = 2, **kw: Any) -> FederatedTrainer:
    """FedShard with fixed rounds, batch 5, quiet, in ``root``."""
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("eval_every_n_rounds", 0)
    return FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=rounds, batch_size=5),
        default_root_dir=str(root),
        **kw,
    )


class StopAfter(FederatedCallback):
    """Stops the fit once stage ``stage`` is committed, as a kill would."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def on_stage_end(self, trainer: Any, stage: int, metrics: dict[str, float]) -> None:
        if stage == self.stage:
            raise KeyboardInterrupt
