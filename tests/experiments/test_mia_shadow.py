"""The calibrated MIA protocol on a tiny federated run: who the shadows train on, what compare writes."""

from __future__ import annotations

import json

import numpy as np
import torch

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.experiments.compare import compare
from fedshard_lightning.experiments.mia_report import calibrated_mia
from fedshard_lightning.experiments.mia_shadow import train_shadows
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedAvg, FedShard


def _data():
    return SyntheticDataModule(
        num_clients=8, partition="iid", num_samples=96, num_test=40, shape=(6,), num_classes_=3
    )


def test_shadows_never_see_the_audited_clients_and_leave_the_state_alone(tmp_path):
    trainer = FederatedTrainer(
        algorithm=FedAvg(rounds=2, batch_size=5),
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
    )
    trainer.fit(MLP(hidden=(8,), lr=0.1), _data())
    alg, dm = trainer.algorithm, trainer.datamodule
    before = {k: v.clone() for k, v in alg.current_params().items()}
    shadows = train_shadows(alg, trainer.module, dm, [1, 6], num_shadows=4, rounds=2, seed=0)
    for k, v in alg.current_params().items():
        assert torch.equal(v, before[k])
    audited = torch.cat([dm.client_indices[c] for c in (1, 6)]).cpu().numpy()
    assert not shadows.train_in[:, audited].any()
    others = np.setdiff1d(np.arange(len(dm.train_y)), audited)
    # complementary pairs: every other example is IN exactly half of the shadows
    assert (shadows.train_in[:, others].sum(axis=0) == 2).all()
    assert all(not {1, 6} & set(c) for c in shadows.clients)
    assert shadows.train_phi.shape == (4, len(dm.train_y)) and shadows.sigma > 0
    res = calibrated_mia(alg, trainer, shadows, [1, 6], seed=0)
    assert len(res["before"].members) == len(audited) == len(res["after"].members)
    assert len(res["before"].nonmembers) == 20 and len(res["after"].nonmembers) == 40  # pooled over 2 models
    assert 0 <= res["before"].auc <= 1 and 0 <= res["after"].tpr_at_1fpr <= 1


def test_compare_writes_the_calibrated_mia(tmp_path):
    res = compare(
        output_dir=str(tmp_path),
        algorithms=[FedShard(rounds="fixed", fixed_rounds=1, batch_size=5), FedAvg(rounds=2, batch_size=5)],
        model=MLP(hidden=(8,), lr=0.1),
        data=_data(),
        clients=[1, 6],
        mia_shadows=2,
        mia_bootstrap=50,
    )
    for r in res["rows"]:
        for key in ("mia_auc_before", "mia_auc_after", "mia_tpr_before", "mia_tpr_after", "mia_f1_before"):
            assert r[key] is not None and 0 <= r[key] <= 1
        assert r["r2_steps"] >= 1
    mia = json.loads((tmp_path / "mia.json").read_text())
    fs = mia["methods"]["fedshard (rounds: fixed)"]
    assert fs["before"]["auc_ci"][0] <= fs["before"]["auc"] <= fs["before"]["auc_ci"][1]
    d = fs["after_auc_minus_fedavg"]
    assert d["ci"][0] <= d["diff"] <= d["ci"][1]
    assert "Membership inference" in (tmp_path / "compare.md").read_text()
    assert (tmp_path / "mia_scores.npz").is_file()


def test_label_offset_removes_a_shift_by_label(monkeypatch):
    """A model more confident on label 0 than the shadows, for members and test alike: AUC 0.5, not 1."""
    from types import SimpleNamespace

    from fedshard_lightning.experiments import mia_shadow
    from fedshard_lightning.experiments.mia_shadow import CalibratedAudit, ShadowSet

    rng = np.random.default_rng(0)
    train_y = np.r_[np.zeros(40, int), rng.integers(0, 3, 80)]  # client 0 holds only label 0
    test_y = rng.integers(0, 3, 200)
    dm = SimpleNamespace(
        client_indices=[torch.arange(40), torch.arange(40, 80), torch.arange(80, 120)],
        train_y=torch.as_tensor(train_y),
        test_y=torch.as_tensor(test_y),
    )
    noise_train, noise_test = rng.normal(0, 1, 120), rng.normal(0, 1, 200)
    shift = np.array([3.0, 0.0, 0.0])
    monkeypatch.setattr(
        mia_shadow,
        "_confidences",
        lambda module, params, dm: (shift[train_y] + noise_train, shift[test_y] + noise_test),
    )
    train_in = np.zeros((2, 120), bool)
    train_in[0, 40:80], train_in[1, 80:] = True, True
    shadows = ShadowSet(np.zeros((2, 120)), np.zeros((2, 200)), train_in, 1.0, [[1], [2]])
    scores = CalibratedAudit(None, dm, shadows, [0]).before({})
    assert abs(scores.auc - 0.5) < 0.15  # without the offset: about 0.98
    raw = shift[train_y[:40]] + noise_train[:40]
    assert mia_shadow.roc_auc(raw, shift[test_y] + noise_test) > 0.8
