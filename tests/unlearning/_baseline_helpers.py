"""Builders shared by the baseline tests: a tiny float64 problem, fresh objects per trainer call."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import Algorithm

K = 6


def make(
    root: Path,
    factory: Callable[..., Algorithm],
    k: int = K,
    unlearned: list[int] | None = None,
    callbacks: list[Any] | None = None,
    **alg: Any,
) -> tuple[FederatedTrainer, MLP, SyntheticDataModule]:
    """A fresh (trainer, model, datamodule) for ``factory(**alg)`` (``unlearned``: see :func:`fit`; ``callbacks``: extra)."""
    alg.setdefault("rounds", 3)
    alg.setdefault("batch_size", 5)
    algorithm = factory(**alg)
    dm = SyntheticDataModule(
        num_clients=k, partition="iid", num_samples=k * 8, num_test=20, shape=(4,), num_classes_=3
    )
    model = MLP(hidden=(5,), lr=0.1, momentum=0.5)
    trainer = FederatedTrainer(
        algorithm=algorithm,
        precision="64-true",
        default_root_dir=str(root),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize="always",
        enable_fairness=False,  # these fits check exactness; a scripted sampler has no replay rounds
        callbacks=callbacks,
    )
    return trainer, model, dm


def fit(
    root: Path, factory: Callable[..., Algorithm], unlearned: list[int] | None = None, **kw: Any
) -> FederatedTrainer:
    """Fit and return the trainer (its algorithm holds the trained state).

    ``unlearned``: train as if these clients had left before training (the retraining reference).
    """
    trainer, model, dm = make(root, factory, **kw)
    trainer.fit(model, dm, exclude_clients=unlearned)
    return trainer


def unlearn(root: Path, run_dir: Path, factory: Callable[..., Algorithm], clients, **kw: Any) -> dict:
    """One request through the trainer, as the CLI does it."""
    trainer, model, dm = make(root, factory, **kw)
    return trainer.unlearn(model, dm, str(run_dir), clients)


def loaded(root: Path, run_dir: Path, factory: Callable[..., Algorithm], **kw: Any) -> Algorithm:
    """The algorithm restored from a run's cache."""
    trainer, model, dm = make(root, factory, **kw)
    trainer._load_run(model, dm, str(run_dir), "audit")
    return trainer.algorithm


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two parameter dicts."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
