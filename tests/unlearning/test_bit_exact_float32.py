"""float32 audits are bit-exact (max|diff| == 0.0) for MLP, FedAvgCNN and ResNetGN, stacked and loop."""

from __future__ import annotations

import pytest
import torch

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.models import MLP, FedAvgCNN, ResNetGN
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard


def _fresh(cls, shape):
    dm = SyntheticDataModule(
        num_clients=8,
        partition="dirichlet",
        rho=0.5,
        min_client_size=5,
        num_samples=160,
        num_test=40,
        shape=shape,
        num_classes_=4,
        as_uint8=len(shape) == 3,
    )
    torch.manual_seed(0)
    return (MLP(hidden=(16,), lr=0.1, momentum=0.5) if cls is MLP else cls(lr=0.05)), dm


def _trainer(root, vectorize):
    return FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=5),
        default_root_dir=str(root),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize=vectorize,
    )


@pytest.mark.parametrize("vectorize", ["always", "never"])
@pytest.mark.parametrize(("cls", "shape"), [(MLP, (10,)), (FedAvgCNN, (1, 28, 28)), (ResNetGN, (3, 16, 16))])
def test_float32_audit_is_bit_exact(tmp_path, cls, shape, vectorize):
    tr = _trainer(tmp_path, vectorize)
    tr.fit(*_fresh(cls, shape))
    run = str(tr.run_dir)
    for clients in ([3], [0, 6]):
        _trainer(tmp_path, vectorize).unlearn(*_fresh(cls, shape), run, clients)
        res = _trainer(tmp_path, vectorize).audit(*_fresh(cls, shape), run, tolerance=0.0)
        assert res["passed"] and res["max_abs_diff"] == 0.0
