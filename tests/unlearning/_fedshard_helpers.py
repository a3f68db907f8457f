"""Builders shared by the FedShard tests: one config, fresh objects per trainer call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard


def make(
    root: Path,
    k: int = 8,
    per_client: int = 12,
    precision: str = "64-true",
    seed: int = 0,
    data_kw: dict | None = None,
    **alg: Any,
):
    """A fresh (trainer, model, datamodule) triple for one config."""
    alg.setdefault("rounds", "fixed")
    alg.setdefault("fixed_rounds", 2)
    alg.setdefault("batch_size", 5)
    dkw = dict(
        num_clients=k, partition="iid", num_samples=k * per_client, num_test=40, shape=(6,), num_classes_=3
    )
    dkw.update(data_kw or {})
    dm = SyntheticDataModule(**dkw)
    model = MLP(hidden=(8,), lr=0.1, momentum=0.5)
    trainer = FederatedTrainer(
        algorithm=FedShard(**alg),
        precision=precision,
        default_root_dir=str(root),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize="always",
        seed=seed,
    )
    return trainer, model, dm


def fit(root: Path, **kw: Any) -> Path:
    trainer, model, dm = make(root, **kw)
    trainer.fit(model, dm)
    return trainer.run_dir


def unlearn(root: Path, run_dir: Path, clients, **kw: Any) -> dict:
    trainer, model, dm = make(root, **kw)
    return trainer.unlearn(model, dm, str(run_dir), clients)


def audit(root: Path, run_dir: Path, tolerance: float = 1e-10, **kw: Any) -> dict:
    trainer, model, dm = make(root, **kw)
    trainer._load_run(model, dm, str(run_dir), "audit")
    return trainer.algorithm.audit(tolerance)


def loaded(root: Path, run_dir: Path, **kw: Any):
    trainer, model, dm = make(root, **kw)
    trainer._load_run(model, dm, str(run_dir), "audit")
    return trainer.algorithm


def stage_models(alg) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in m.items()} for m in alg.models]
