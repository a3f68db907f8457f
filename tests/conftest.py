"""Shared fixtures: tiny data, tiny models, isolated run and W&B directories."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Tiny models gain nothing from intra-op threads, and several pytest processes (or pytest beside
# other work) on a 2-core machine oversubscribe the cores: one thread keeps tests fast everywhere.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolate(tmp_path, monkeypatch):
    """Restore global torch state; keep W&B offline and the ``auto`` path decisions inside the test."""
    from fedshard_lightning.engine.path_choice import agreed_signatures, decided_paths

    dtype = torch.get_default_dtype()
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", str(tmp_path / "fedshard_cache"))
    decided_paths().clear()
    agreed_signatures().clear()
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # Every fit logs M_e; M_p's replay (about 12x a FedShard fit) runs where a test asks for it
    # (tests/callbacks/test_fairness_logger.py), not in every fit of the suite.
    monkeypatch.setenv("FEDSHARD_REPLAY_BUDGET_S", "0")
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture
def run_root(tmp_path) -> Path:
    """A fresh default_root_dir."""
    path = tmp_path / "runs"
    path.mkdir()
    return path


os.environ.setdefault("PYTHONHASHSEED", "0")
