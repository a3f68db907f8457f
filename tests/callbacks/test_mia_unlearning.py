"""Membership inference on digits: exact unlearning (FedShard, FedAvg retraining) lowers the attack F1."""

from __future__ import annotations

import pytest
import torch
from threadpoolctl import threadpool_limits

from fedshard_lightning.callbacks import MembershipAudit
from fedshard_lightning.data import DigitsDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedAvg, FedShard


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a shared, loaded 2-core CPU torch's and OpenMP's threads only spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        yield
    torch.set_num_threads(threads)


LEAVING = [0]


def _fit(root, algorithm):
    # Few samples per client (5% of digits for training: 45 per client), 30 local epochs and a wide
    # MLP: the model memorises its training data (test accuracy ~0.88, training accuracy 1.0), so
    # the leaving client's samples are recognisable until it is unlearned.
    dm = DigitsDataModule(num_clients=2, partition="iid", test_fraction=0.95)
    trainer = FederatedTrainer(
        algorithm=algorithm,
        default_root_dir=str(root),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize="always",
    )
    trainer.fit(MLP(hidden=(256,), lr=0.3), dm)
    return trainer


@pytest.mark.parametrize(
    "make_algorithm",
    [
        lambda: FedShard(rounds="fixed", fixed_rounds=2, batch_size=10, local_epochs=30),
        lambda: FedAvg(rounds=4, batch_size=10, local_epochs=30),
    ],
    ids=["fedshard", "fedavg_retrain"],
)
def test_unlearning_lowers_mia_f1(run_root, make_algorithm):
    with threadpool_limits(limits=1):
        trainer = _fit(run_root, make_algorithm())
        alg = trainer.algorithm
        original = {k: v.clone() for k, v in alg.current_params().items()}
        audit = MembershipAudit(trainer.module, trainer.datamodule, original, LEAVING, seed=0)
        before = audit.f1(original)
        after = audit.f1(alg.unlearn(LEAVING).params)
    print(
        f"\nMIA F1 ({alg.name}): non-unlearned {before:.3f}, after unlearning clients {LEAVING} {after:.3f}"
    )
    assert before > after + 0.1
