"""Client alpha (probe round, SPEC section 4) and per-client accuracy against plain loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _angles import numpy_signed_angles
from threadpoolctl import threadpool_limits

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import Group, predict_logits
from fedshard_lightning.metrics import PROBE_STAGE, client_alphas, client_probe_updates, per_client_accuracy
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on a shared, loaded 2-core CPU torch's and OpenMP's threads only spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        yield
    torch.set_num_threads(threads)


K = 6


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    dm = SyntheticDataModule(
        num_clients=K,
        partition="dirichlet",
        rho=0.5,
        min_client_size=4,
        num_samples=90,
        num_test=30,
        shape=(5,),
        num_classes_=3,
        holdout_fraction=0.25,
    )
    trainer = FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=4, local_epochs=2),
        precision="64-true",
        default_root_dir=str(tmp_path_factory.mktemp("runs")),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize="always",
    )
    trainer.fit(MLP(hidden=(7,), lr=0.1, momentum=0.5), dm)
    return trainer


def test_client_alphas_match_a_per_client_loop_and_numpy(fitted):
    alg = fitted.algorithm
    ref = alg.current_params()
    assert next(iter(ref.values())).dtype == torch.float64
    alphas = client_alphas(fitted)
    assert alphas.shape == (K,) and alphas.dtype == torch.float64
    # The same probe, one client at a time through the engine.
    rows = []
    for c in range(K):
        init = {k: v.unsqueeze(0).clone() for k, v in ref.items()}
        res = alg.engine.train_groups(init, [Group(c, (c,), 1)], stage=PROBE_STAGE)
        rows.append(torch.cat([(res.params[k][0] - ref[k]).reshape(-1) for k in sorted(ref)]))
    loop = torch.stack(rows)
    batched = client_probe_updates(fitted)
    torch.testing.assert_close(batched, loop, rtol=0, atol=1e-12)
    sizes = np.asarray(fitted.datamodule.client_sizes, dtype=np.float64)
    expected = numpy_signed_angles(loop.numpy(), sizes)
    np.testing.assert_allclose(alphas.numpy(), expected, rtol=0, atol=1e-7)
    assert (alphas.abs() > 0).all() and len(set(np.sign(expected))) == 2
    # Deterministic, reference given explicitly, and independent of the stage keys of training.
    torch.testing.assert_close(client_alphas(alg, ref), alphas, rtol=0, atol=0)
    assert PROBE_STAGE > 1_000_000


def test_client_alphas_from_another_reference(fitted):
    theta0 = fitted.algorithm.theta0
    a0 = client_alphas(fitted, theta0)
    assert not torch.allclose(a0, client_alphas(fitted))
    sub = client_alphas(fitted, theta0, clients=[1, 3, 4])
    assert sub.shape == (3,)


@pytest.mark.parametrize("split", ["train", "holdout"])
def test_per_client_accuracy_matches_a_loop(fitted, split):
    dm, module = fitted.datamodule, fitted.module
    params = fitted.algorithm.current_params()
    acc = per_client_accuracy(module, params, dm, split=split)
    parts = dm.client_indices if split == "train" else dm.holdout_indices
    expected = []
    for idx in parts:
        x, y = dm.gather(idx, torch.float64)
        expected.append((predict_logits(module, params, x).argmax(-1) == y).double().mean().item())
    assert acc.shape == (K,) and acc.dtype == torch.float64
    np.testing.assert_allclose(acc.numpy(), np.asarray(expected), rtol=0, atol=1e-15)
    assert 0 < float(acc.mean()) <= 1


def test_per_client_accuracy_rejects_unknown_split(fitted):
    with pytest.raises(ValueError, match="split"):
        per_client_accuracy(fitted.module, fitted.algorithm.current_params(), fitted.datamodule, split="test")


def test_client_alphas_leave_batchnorm_statistics_out(tmp_path):
    """SPEC section 4: the update is over the trainable parameters; running statistics are not in it."""
    from _models import BNDropoutCNN

    dm = SyntheticDataModule(
        num_clients=K, partition="dirichlet", rho=0.5, min_client_size=5, num_samples=96, num_test=30,
        shape=(1, 8, 8), num_classes_=3, as_uint8=True,
    )  # fmt: skip
    trainer = FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=5),
        precision="64-true",
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize="always",
    )
    torch.manual_seed(0)
    trainer.fit(BNDropoutCNN(lr=0.1), dm)
    alg = trainer.algorithm
    trainable = sorted(n for n, p in trainer.module.named_parameters() if p.requires_grad)
    ref = alg.current_params()
    assert set(ref) > set(trainable)  # the state carries the BatchNorm buffers too
    rows = []
    for c in range(K):
        init = {k: v.unsqueeze(0).clone() for k, v in ref.items()}
        res = alg.engine.train_groups(init, [Group(c, (c,), 1)], stage=PROBE_STAGE)
        rows.append(torch.cat([(res.params[k][0] - ref[k]).reshape(-1) for k in trainable]))
    loop = torch.stack(rows).numpy()
    assert client_probe_updates(trainer).shape == loop.shape
    sizes = np.asarray(trainer.datamodule.client_sizes, dtype=np.float64)
    np.testing.assert_allclose(
        client_alphas(trainer).numpy(), numpy_signed_angles(loop, sizes), rtol=0, atol=1e-7
    )
