"""A new method is policy only: a 40-line algorithm gets commits, resume, checks, unlearn and audit free.

``StagedFedAvg`` below says what trains together (all active clients), from what (the previous
stage's model) and for how long (``stages`` x ``rounds``), and which state it keeps. It writes no
cache code, holds no trainer and takes no lock; the trainer supplies the rest. The second half
checks, one test each, the silent failures that a trainer-owned loop rules out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedshard_lightning.callbacks import FederatedCallback
from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import Group, stack_params, unstack_params
from fedshard_lightning.errors import CacheError, ConfigError, FedShardError
from fedshard_lightning.flcache import FLCache
from fedshard_lightning.models import MLP
from fedshard_lightning.run.directory import run_lock
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FATS, Algorithm, FedAvg, FedEraser, FedShard, UnlearnResult


class StagedFedAvg(Algorithm):
    """FedAvg in ``stages`` stages of ``rounds`` rounds; unlearning retrains from theta^0 without the clients."""

    name = "staged_fedavg"
    state_fields = (*Algorithm.state_fields, "params", "stages_done")

    def __init__(self, stages: int = 2, rounds: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stages, self.rounds = stages, rounds

    def initial_state(self, theta0):
        return {**super().initial_state(theta0), "params": None, "stages_done": 0}

    def is_complete(self) -> bool:
        return self.stages_done == self.stages

    def _stage(self, start, clients, stage, report=True):
        res = self.train(stack_params([start]), [Group(0, tuple(clients), self.rounds)], stage, report=report)
        return unstack_params(res.params, 0), res.client_steps

    def fit(self):
        for stage in range(self.stages_done, self.stages):
            self.params, steps = self._stage(self.params or self.theta0, self.active_clients, stage)
            self.total_client_steps, self.stages_done = self.total_client_steps + steps, stage + 1
            self.events.stage_end(stage)
        return self.params

    def current_params(self):
        return self.params

    def predict_cost(self, clients) -> int:
        group = Group(0, tuple(self.remaining(clients)), self.rounds)
        eng = self.engine
        return sum(
            eng.client_steps_of(eng.participants(s, group, r))
            for s in range(self.stages)
            for r in range(self.rounds)
        )

    retrain_cost = predict_cost

    def unlearn(self, clients) -> UnlearnResult:
        predicted, params, steps = self.predict_cost(clients), self.theta0, 0
        for stage in range(self.stages):
            params, n = self._stage(params, self.remaining(clients), stage, report=False)
            steps += n
        self.params, self.unlearned = params, sorted({*self.unlearned, *clients})
        return UnlearnResult(params, steps, predicted, predicted, 0.0)


# --------------------------------------------------------------------------------------------------
# What the trainer gives it
# --------------------------------------------------------------------------------------------------


def _data(seed: int = 0, k: int = 6) -> SyntheticDataModule:
    return SyntheticDataModule(
        num_clients=k, partition="iid", num_samples=k * 8, num_test=20, shape=(4,), num_classes_=3, seed=seed
    )


def _trainer(root: Path, algorithm: Algorithm | None = None, **kw) -> FederatedTrainer:
    kw = {"precision": "64-true", "enable_progress_bar": False, "vectorize": "always", **kw}
    return FederatedTrainer(
        algorithm=algorithm or StagedFedAvg(batch_size=5), default_root_dir=str(root), **kw
    )


def _model(momentum: float = 0.5) -> MLP:
    return MLP(hidden=(5,), lr=0.1, momentum=momentum)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


class _KillAfterStage(FederatedCallback):
    def on_stage_end(self, trainer, stage, metrics) -> None:
        if stage == 0:
            raise KeyboardInterrupt("killed after stage 0")


def test_commits_unlearn_with_journal_and_audit_come_free(run_root):
    trainer = _trainer(run_root)
    fit = trainer.fit(_model(), _data())
    run = trainer.run_dir
    cache = FLCache(run / "cache")
    assert cache.versions() == ["0001-stage-0", "0002-stage-1"]
    assert cache.manifest()["complete"] and cache.manifest()["client_steps"] == fit["client_steps"] > 0

    report = _trainer(run_root).unlearn(_model(), _data(), str(run), [2])
    journal = (run / "unlearning" / "journal.jsonl").read_text().splitlines()
    assert [line.split('"event": "')[1].split('"')[0] for line in journal] == ["started", "committed"]
    assert (run / "unlearning" / "0001" / "report.json").is_file()
    assert report["client_steps"] == report["predicted_client_steps"] > 0
    reference = _trainer(run_root)
    reference.fit(_model(), _data(), exclude_clients=[2])
    assert _max_diff(FLCache(run / "cache").tensors("params.safetensors"), reference.algorithm.params) == 0.0
    assert _trainer(run_root).audit(_model(), _data(), str(run), tolerance=1e-12)["passed"]
    cache = FLCache(run / "cache")
    digests = {cache.manifest(v)["files"]["theta0.safetensors"] for v in cache.versions()}
    assert len(digests) == 1  # theta0 is one blob, shared by every later commit


def test_resume_after_a_kill_equals_an_uninterrupted_fit(run_root):
    whole = _trainer(run_root)
    whole.fit(_model(), _data())
    killed = _trainer(run_root, callbacks=[_KillAfterStage()])
    with pytest.raises(KeyboardInterrupt):
        killed.fit(_model(), _data())
    assert FLCache(killed.run_dir / "cache").versions() == ["0001-stage-0"]
    metrics = _trainer(run_root).fit(_model(), _data(), ckpt_path=str(killed.run_dir))
    assert metrics["resumed"]
    assert (killed.run_dir / "model.safetensors").read_bytes() == (
        whole.run_dir / "model.safetensors"
    ).read_bytes()


def test_fingerprint_refuses_another_model_hyperparameter_or_algorithm_setting(run_root):
    trainer = _trainer(run_root)
    trainer.fit(_model(), _data())
    with pytest.raises(CacheError, match="another config"):
        _trainer(run_root).unlearn(_model(momentum=0.9), _data(), str(trainer.run_dir), [1])
    with pytest.raises(CacheError, match="another config"):
        _trainer(run_root, StagedFedAvg(batch_size=5, rounds=3)).unlearn(
            _model(), _data(), str(trainer.run_dir), [1]
        )
    assert FLCache(trainer.run_dir / "cache").versions() == ["0001-stage-0", "0002-stage-1"]


def test_a_second_request_waits_for_the_lock(run_root):
    trainer = _trainer(run_root)
    trainer.fit(_model(), _data())
    with run_lock(trainer.run_dir), pytest.raises(FedShardError, match="another process is unlearning"):
        _trainer(run_root).unlearn(_model(), _data(), str(trainer.run_dir), [1])


# --------------------------------------------------------------------------------------------------
# Silent failures that can no longer happen
# --------------------------------------------------------------------------------------------------


class _NeverReports(StagedFedAvg):
    is_complete = Algorithm.is_complete  # says nothing about completeness either

    def fit(self):
        for stage in range(self.stages):
            self.params, steps = self._stage(self.params or self.theta0, self.active_clients, stage)
            self.total_client_steps += steps
        self.stages_done = self.stages
        return self.params


def test_an_algorithm_that_never_reports_a_stage_is_still_committed_and_unlearnable(run_root):
    trainer = _trainer(run_root, _NeverReports(batch_size=5))
    trainer.fit(_model(), _data())
    assert FLCache(trainer.run_dir / "cache").versions() == ["0001-fit"]
    report = _trainer(run_root, _NeverReports(batch_size=5)).unlearn(
        _model(), _data(), str(trainer.run_dir), [0]
    )
    assert report["request"] == 1


def test_client_steps_survive_a_request(run_root):
    """The base state is restored by the trainer: no algorithm can forget ``total_client_steps``."""
    trainer = _trainer(run_root)
    steps = trainer.fit(_model(), _data())["client_steps"]
    _trainer(run_root).unlearn(_model(), _data(), str(trainer.run_dir), [3])
    assert FLCache(trainer.run_dir / "cache").manifest()["client_steps"] == steps


@pytest.mark.parametrize(
    "make",
    [lambda: StagedFedAvg(batch_size=5), lambda: FedShard(rounds="fixed", fixed_rounds=2, batch_size=5)],
)
def test_a_reused_instance_trains_like_a_fresh_one(run_root, make):
    algorithm = make()
    _trainer(run_root, algorithm).fit(_model(), _data(seed=0))
    second = _trainer(run_root, algorithm).fit(_model(), _data(seed=1))
    fresh = _trainer(run_root, make()).fit(_model(), _data(seed=1))
    assert second["client_steps"] == fresh["client_steps"] > 0
    assert second["test_accuracy"] == fresh["test_accuracy"]


def test_what_if_changes_neither_the_state_nor_the_run(run_root):
    trainer = _trainer(run_root)
    trainer.fit(_model(), _data())
    alg = trainer.algorithm
    before, versions = alg.state_dict(), FLCache(trainer.run_dir / "cache").versions()
    new, result = alg.what_if(before, [1, 4])
    assert new["unlearned"] == [1, 4] and result.client_steps > 0
    assert alg.unlearned == [] and _max_diff(alg.params, before["params"]) == 0.0
    assert FLCache(trainer.run_dir / "cache").versions() == versions and trainer.requests == []


class _Curves(FederatedCallback):
    def __init__(self) -> None:
        self.rounds, self.stages = [], {}

    def on_round_end(self, trainer, info, metrics) -> None:
        self.rounds.append(metrics)

    def on_stage_end(self, trainer, stage, metrics) -> None:
        self.stages[stage] = metrics


def test_per_round_and_per_stage_accuracy_weight_shards_alike(run_root):
    """Both weight shards by training samples, so a stage's accuracy is its last round's (client weights differ)."""
    data = SyntheticDataModule(
        num_clients=8,
        partition="dirichlet",
        rho=0.3,
        min_client_size=3,
        num_samples=160,
        num_test=200,
        shape=(4,),
        num_classes_=3,
    )
    curves = _Curves()
    _trainer(run_root, FedShard(rounds="fixed", fixed_rounds=2, batch_size=5), callbacks=[curves]).fit(
        _model(), data
    )
    for stage, metrics in curves.stages.items():
        last = [m for m in curves.rounds if m["stage"] == stage][-1]
        assert metrics["test_loss"] == pytest.approx(last["test_loss"], abs=1e-12)
        assert metrics["test_accuracy"] == last["test_accuracy"]


@pytest.mark.parametrize(
    "make", [lambda: FedAvg(rounds=2, batch_size=5), lambda: FATS(rounds=3, sample_size=3, batch_size=5)]
)
def test_every_exact_method_gets_the_generic_audit(run_root, make):
    trainer = _trainer(run_root, make())
    trainer.fit(_model(), _data())
    _trainer(run_root, make()).unlearn(_model(), _data(), str(trainer.run_dir), [2])
    result = _trainer(run_root, make()).audit(_model(), _data(), str(trainer.run_dir), tolerance=1e-12)
    assert result["passed"] and result["max_abs_diff"] == 0.0


def test_an_approximate_method_refuses_audit(run_root):
    trainer = _trainer(run_root, FedEraser(rounds=2, batch_size=5, local_epochs=2))
    trainer.fit(_model(), _data())
    with pytest.raises(ConfigError, match="does not support audit"):
        _trainer(run_root, FedEraser(rounds=2, batch_size=5, local_epochs=2)).audit(
            _model(), _data(), str(trainer.run_dir)
        )


def test_fedshard_refuses_to_exclude_clients_up_front(run_root):
    with pytest.raises(ConfigError, match="exclude_clients"):
        _trainer(run_root, FedShard(rounds="fixed", fixed_rounds=2, batch_size=5)).fit(
            _model(), _data(), exclude_clients=[1]
        )
