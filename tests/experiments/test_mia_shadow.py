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
