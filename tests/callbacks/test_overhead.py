"""The observability around the engine stays complete but cheap.

One test evaluation per round for all groups of the round, one CSV row per round with the file
written per stage (not per round), cache commits only at stage ends, and a live progress line
that is redrawn at most every ``refresh_every_s``.
"""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
from _tiny import small_synthetic
from lightning.fabric.loggers import CSVLogger

from fedshard_lightning import FederatedTrainer
from fedshard_lightning.callbacks import MetricsLogger, ProgressBar
from fedshard_lightning.engine.evaluate import evaluate
from fedshard_lightning.models import MLP
from fedshard_lightning.run.store import RunStore
from fedshard_lightning.trainer.trainer import sample_weighted_average
from fedshard_lightning.unlearning import FedAvg, FedShard


def _fit(root, algorithm, **kw):
    data = small_synthetic()
    trainer = FederatedTrainer(
        algorithm=algorithm, default_root_dir=str(root), vectorize="always", enable_progress_bar=False, **kw
    )
    return trainer, trainer.fit(MLP(hidden=(8,), lr=0.1), data)


@pytest.fixture
def counts(monkeypatch):
    """Count test evaluations, cache commits and CSV file writes (each still runs)."""
    n = {"evaluate": 0, "commit": 0, "csv_save": 0, "models": []}
    evaluate_real, commit_real, save_real = FederatedTrainer.evaluate, RunStore.commit, CSVLogger.save

    def evaluate_counted(self, params):
        n["evaluate"] += 1
        n["models"].append({k: v.clone() for k, v in params.items()})
        return evaluate_real(self, params)

    def commit_counted(self, *args, **kwargs):
        n["commit"] += 1
        return commit_real(self, *args, **kwargs)

    def save_counted(self):
        n["csv_save"] += 1
        return save_real(self)

    monkeypatch.setattr(FederatedTrainer, "evaluate", evaluate_counted)
    monkeypatch.setattr(RunStore, "commit", commit_counted)
    monkeypatch.setattr(CSVLogger, "save", save_counted)
    return n


def test_fedshard_fit_evaluates_once_per_round_and_commits_once_per_stage(run_root, counts):
    trainer, metrics = _fit(run_root, FedShard(rounds="fixed", fixed_rounds=2, batch_size=4))
    stages = trainer.algorithm.planned_stages
    rounds = trainer.history
    assert stages == 3 and len(rounds) == 2 * stages  # stage 1 trains 4 groups together, each round
    # One evaluation per round (of the sample-weighted average of all its groups), one per stage
    # summary, one at the end: never one per group.
    assert counts["evaluate"] == len(rounds) + stages + 1
    assert all("test_accuracy" in r for r in rounds)
    # The per-round value is the evaluation of the groups' sample-weighted average (reference:
    # re-evaluate the model it was computed from with the plain evaluator).
    first = counts["models"][0]
    x, y = trainer._test_data
    assert rounds[0]["test_accuracy"] == evaluate(trainer.module, first, x, y)[0]
    assert counts["commit"] == stages, "FLCache is written at stage ends only"
    # One CSV row per round; the file was written per stage (and at the end), not per round.
    with open(trainer.run_dir / "logs" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("round")]
    assert [float(r["test_accuracy"]) for r in rows] == [r["test_accuracy"] for r in rounds]
    assert counts["csv_save"] <= stages + 2 < len(rounds) + stages
    assert metrics["test_accuracy"] == evaluate(trainer.module, trainer.algorithm.current_params(), x, y)[0]


def test_fedavg_fit_commits_once(run_root, counts):
    _fit(run_root, FedAvg(rounds=5, batch_size=4))
    assert counts["commit"] == 1
    assert counts["evaluate"] == 5 + 1


def test_sample_weighted_average_matches_a_numpy_formula():
    import numpy as np
    import torch

    state = {"w": torch.tensor([[1.0, 2.0], [3.0, 5.0], [7.0, 11.0]])}
    out = sample_weighted_average(state, [[0], [1, 2], [3]], [2, 1, 3, 4])
    want = (np.array([2, 4, 4])[:, None] * state["w"].numpy()).sum(0) / 10
    assert np.allclose(out["w"].numpy(), want, rtol=0, atol=1e-6)
    one = {"w": torch.randn(1, 3, 4)}
    alone = sample_weighted_average(one, [[0, 1]], [2, 5])["w"]
    assert torch.equal(alone, one["w"][0])  # the average of one model is that model, bit for bit


def test_metrics_logger_writes_files_when_flush_is_due(run_root, counts):
    _fit(run_root, FedAvg(rounds=4, batch_size=4), callbacks=[MetricsLogger(flush_every_s=0.0)])
    assert counts["csv_save"] >= 4  # every round, when asked to


class _FakeProgress:
    def __init__(self) -> None:
        self.updates = 0

    def update(self, *args, **kwargs) -> None:
        self.updates += 1

    def stop(self) -> None:
        pass


@pytest.mark.parametrize(("refresh", "want"), [(3600.0, 3), (0.5, 11), (0.0, 11)])
def test_live_progress_redraws_at_most_every_refresh_interval(refresh, want, monkeypatch):
    import fedshard_lightning.callbacks.progress as progress

    now = [0.0]  # the test's clock, a second per round: the count never depends on the machine's speed
    monkeypatch.setattr(progress, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    bar = ProgressBar(force=True, refresh_every_s=refresh)
    trainer = SimpleNamespace(is_global_zero=True, algorithm=None)
    bar.on_fit_start(trainer)
    bar._progress = fake = _FakeProgress()
    bar.on_stage_start(trainer, 1, [SimpleNamespace(rounds=10, clients=(0, 1))])
    for r in range(10):
        now[0] += 1.0
        bar.on_round_end(trainer, SimpleNamespace(round=r), {"train_loss": 1.0, "client_steps": 2.0 * r})
    # stage start, then the first round (nothing shown yet) and the stage's last round always
    assert fake.updates == want
    assert bar._round == 10
