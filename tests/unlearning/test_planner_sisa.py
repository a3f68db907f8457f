"""A new method is a short planner: SISA in 35 lines gets fit, resume, unlearn, costs and audit.

``SISA`` says what trains (shard s: the clients ``c % shards == s``, alone, in stage s), from
what (theta^0), how the state changes (the shard's row is replaced) and what the model is (the
live shards weighted by their samples). It holds no trainer, commits nothing, counts no cost
and never records who was unlearned: the trainer's loop does all of that. The second half tries
the seven mistakes that a method written against the attribute-state interface could make; each
stops in one line where it is made, or cannot be written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedshard_lightning.callbacks import FederatedCallback
from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import Group, stack_params
from fedshard_lightning.errors import ContractError
from fedshard_lightning.flcache import FLCache
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning.planner import Planner, StagePlan


class SISA(Planner):
    """SISA-style: shard s holds the clients c % shards == s and trains alone (stage s); the model averages them."""

    name = "sisa"

    def __init__(self, shards: int = 3, rounds: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shards, self.rounds = shards, rounds

    def initial_state(self, theta0):
        return {"models": stack_params([theta0] * self.shards), "trained": 0}

    def _plan(self, state, shard, leaving=()):
        clients = tuple(c for c in self.active(state, leaving) if c % self.shards == shard)
        return StagePlan(shard, (Group(shard, clients, self.rounds),), stack_params([state.theta0]))

    def next_stage(self, state):
        return self._plan(state, state.trained) if state.trained < self.shards else None

    def plan_unlearn(self, state, clients):
        return [self._plan(state, s, clients) for s in sorted({c % self.shards for c in clients})]

    def absorb(self, state, plan, result):
        s = plan.groups[0].key
        models = {k: torch.cat([v[:s], result.params[k], v[s + 1 :]]) for k, v in state.models.items()}
        return state.replace(models=models, trained=max(state.trained, s + 1))

    def current_params(self, state):
        sizes, active = self.ctx.client_sizes, self.active(state)
        w = torch.tensor([sum(sizes[c] for c in active if c % self.shards == s) for s in range(self.shards)])
        w = w.double() / w.sum()
        return {k: torch.einsum("s,s...->...", w.to(v), v) for k, v in state.models.items()}


def _data(k: int = 6) -> SyntheticDataModule:
    return SyntheticDataModule(
        num_clients=k, partition="iid", num_samples=k * 8, num_test=20, shape=(4,), num_classes_=3
    )


def _trainer(root: Path, algorithm: Planner | None = None, **kw) -> FederatedTrainer:
    kw = {
        "precision": "64-true",
        "enable_progress_bar": False,
        "vectorize": "always",
        "enable_fairness": False,
        **kw,
    }
    return FederatedTrainer(algorithm=algorithm or SISA(batch_size=4), default_root_dir=str(root), **kw)


def _model() -> MLP:
    return MLP(hidden=(5,), lr=0.1, momentum=0.5)


def _fit(root: Path, algorithm: Planner | None = None, **kw) -> FederatedTrainer:
    trainer = _trainer(root, algorithm, **kw)
    trainer.fit(_model(), _data())
    return trainer


def _unlearn(root: Path, run: Path, clients, algorithm: Planner | None = None) -> dict:
    return _trainer(root, algorithm).unlearn(_model(), _data(), str(run), clients)


class _KillAfterStage(FederatedCallback):
    def on_stage_end(self, trainer, stage, metrics) -> None:
        if stage == 0:
            raise KeyboardInterrupt("killed after stage 0")


def test_the_method_is_35_lines_or_fewer():
    import inspect

    assert len(inspect.getsource(SISA).splitlines()) <= 35


def test_fit_commits_every_stage_and_unlearn_costs_what_its_plans_predict(run_root):
    trainer = _fit(run_root)
    fit_steps = trainer.algorithm.total_client_steps
    cache = FLCache(trainer.run_dir / "cache")
    assert cache.versions() == ["0001-stage-0", "0002-stage-1", "0003-stage-2"]
    assert cache.manifest()["complete"] and cache.manifest()["client_steps"] == fit_steps > 0

    report = _unlearn(run_root, trainer.run_dir, [1, 3])  # shards 1 and 0; shard 2 stays
    assert report["client_steps"] == report["predicted_client_steps"] > 0
    assert report["retrain_client_steps"] > report["client_steps"]  # retraining: all three shards
    assert FLCache(trainer.run_dir / "cache").manifest()["unlearned"] == [1, 3]  # recorded by the loop
    reference = _trainer(run_root)
    reference.fit(_model(), _data(), exclude_clients=[1, 3])
    assert report["retrain_client_steps"] == reference.algorithm.total_client_steps
    cached = FLCache(trainer.run_dir / "cache").tensors("models.safetensors")
    assert all(torch.equal(cached[k], reference.algorithm.state.models[k]) for k in cached)
    result = _trainer(run_root).audit(_model(), _data(), str(trainer.run_dir))
    assert result["passed"] and result["max_abs_diff"] == 0.0


def test_resume_after_a_kill_equals_an_uninterrupted_fit(run_root):
    whole = _fit(run_root)
    killed = _trainer(run_root, callbacks=[_KillAfterStage()])
    with pytest.raises(KeyboardInterrupt):
        killed.fit(_model(), _data())
    assert FLCache(killed.run_dir / "cache").versions() == ["0001-stage-0"]
    assert _trainer(run_root).fit(_model(), _data(), ckpt_path=str(killed.run_dir))["resumed"]
    assert (killed.run_dir / "model.safetensors").read_bytes() == (
        whole.run_dir / "model.safetensors"
    ).read_bytes()


def test_what_if_is_a_fold_that_leaves_the_state_and_the_run_alone(run_root):
    trainer = _fit(run_root)
    alg, versions = trainer.algorithm, FLCache(trainer.run_dir / "cache").versions()
    before = alg.state_dict()
    snapshot = {k: v.clone() for k, v in before.models.items()}
    new, result = alg.what_if(before, [0])
    assert new.unlearned == (0,) and before.unlearned == () and alg.state is before
    assert all(torch.equal(before.models[k], snapshot[k]) for k in snapshot)
    assert result.client_steps == result.predicted_client_steps == alg.predict_cost([0]) > 0
    assert FLCache(trainer.run_dir / "cache").versions() == versions


# --------------------------------------------------------------------------------------------------
# The seven mistakes: each stops where it is made, or cannot be written
# --------------------------------------------------------------------------------------------------


def test_1_a_planner_cannot_skip_the_commit_it_has_no_loop_to_skip_it_in(run_root):
    """The loop commits after every stage (see above); a method that takes the loop over is refused."""

    class OwnLoop(SISA):
        def fit(self):
            return self.current_params()

    with pytest.raises(ContractError, match=r"OwnLoop defines fit\(\); a Planner leaves the loop"):
        _fit(run_root, OwnLoop(batch_size=4))


class HiddenState(SISA):
    def absorb(self, state, plan, result):
        self.last_shard = plan.groups[0].key  # lost at the next resume or what-if
        return super().absorb(state, plan, result)


class UndeclaredField(SISA):
    def absorb(self, state, plan, result):
        return super().absorb(state, plan, result).replace(last_shard=plan.groups[0].key)


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (
            HiddenState,
            r"HiddenState\.absorb\(\) set self\.last_shard; .* declare 'last_shard' in initial_state",
        ),
        (UndeclaredField, r"'last_shard' is not a field of the state; declare it in initial_state"),
    ],
)
def test_2_state_outside_the_declared_fields_stops_in_the_first_absorb(run_root, cls, match):
    with pytest.raises(ContractError, match=match):
        _fit(run_root, cls(batch_size=4))


class InPlace(SISA):
    def absorb(self, state, plan, result):
        if not state.unlearned:
            return super().absorb(state, plan, result)
        for k, v in state.models.items():  # the fit's tensors, shared with every what-if and the cache
            v[plan.groups[0].key] = result.params[k][0]
        return state


def test_3_writing_a_state_tensor_in_place_stops_when_absorb_returns(run_root):
    trainer = _fit(run_root, InPlace(batch_size=4))
    versions = FLCache(trainer.run_dir / "cache").versions()
    with pytest.raises(
        ContractError, match=r"InPlace\.absorb\(\) wrote the state's tensor models\.\S+ in place"
    ):
        _unlearn(run_root, trainer.run_dir, [2], InPlace(batch_size=4))
    assert FLCache(trainer.run_dir / "cache").versions() == versions  # nothing committed


class RecordsUnlearned(SISA):
    def absorb(self, state, plan, result):
        return super().absorb(state, plan, result).replace(unlearned=(2,))


def test_4_the_loop_records_unlearned_clients_and_no_method_can(run_root):
    """SISA never mentions ``unlearned`` and its requests are recorded (test above); writing it is refused."""
    with pytest.raises(ContractError, match=r"unlearned is the loop's record"):
        _fit(run_root, RecordsUnlearned(batch_size=4))


class NumpyState(SISA):
    def absorb(self, state, plan, result):
        return super().absorb(state, plan, result).replace(trained=np.array(plan.groups[0].key + 1))


def test_5_a_state_value_the_cache_cannot_store_stops_in_absorb(run_root):
    with pytest.raises(
        ContractError, match=r"NumpyState\.absorb\(\): the state field 'trained' is a ndarray"
    ):
        _fit(run_root, NumpyState(batch_size=4))


class OwnCost(SISA):
    def predict_cost(self, clients):
        return 1.5


class FloatRounds(SISA):
    def _plan(self, state, shard, leaving=()):
        plan = super()._plan(state, shard, leaving)
        return StagePlan(plan.stage, (Group(shard, plan.groups[0].clients, 2.5),), plan.init)


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (OwnCost, r"OwnCost defines predict_cost\(\); .* derives them from its plans"),
        (FloatRounds, r"FloatRounds\.next_stage\(\): Group\(.*rounds=2\.5\): key and rounds must be ints"),
    ],
)
def test_6_costs_are_derived_so_a_method_cannot_return_a_float_one(run_root, cls, match):
    with pytest.raises(ContractError, match=match):
        _fit(run_root, cls(batch_size=4))


class StackedParams(SISA):
    def current_params(self, state):
        return dict(state.models)


def test_7_stacked_shard_models_as_the_model_stop_at_current_params(run_root):
    with pytest.raises(ContractError, match=r"StackedParams\.current_params\(\) returned \S+ of shape \(3, "):
        _fit(run_root, StackedParams(batch_size=4))
