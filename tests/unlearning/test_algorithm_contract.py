"""A user's Algorithm that breaks the contract stops in one line naming the class and the method.

Each broken variant below is what a researcher writing their first method might do; before the
checks of ``unlearning/contract.py`` each ended in a traceback far from the cause (the evaluator,
the cache's JSON, the request report) or, for ``seconds``, in a silent 0 in every table.
"""

from __future__ import annotations

import time

import pytest
from _cli import cli

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import Group, stack_params, unstack_params
from fedshard_lightning.errors import ContractError
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import Algorithm, UnlearnResult


class Retrain(Algorithm):
    """FedAvg for ``rounds`` rounds; unlearning retrains the remaining clients (times nothing itself)."""

    name = "retrain"
    state_fields = (*Algorithm.state_fields, "params")

    def __init__(self, rounds: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rounds = rounds

    def initial_state(self, theta0):
        return {**super().initial_state(theta0), "params": None}

    def _train(self, clients, report=True):
        res = self.train(
            stack_params([self.theta0]), [Group(0, tuple(clients), self.rounds)], 0, report=report
        )
        return unstack_params(res.params, 0), res.client_steps

    def fit(self):
        self.params, self.total_client_steps = self._train(self.active_clients)
        self.events.stage_end(0)
        return self.params

    def current_params(self):
        return self.params

    def predict_cost(self, clients) -> int:
        g = Group(0, tuple(self.remaining(clients)), self.rounds)
        return sum(self.engine.client_steps_of(self.engine.participants(0, g, r)) for r in range(self.rounds))

    retrain_cost = predict_cost

    def unlearn(self, clients) -> UnlearnResult:
        predicted = self.predict_cost(clients)
        self.params, steps = self._train(self.remaining(clients), report=False)
        self.unlearned = sorted({*self.unlearned, *clients})
        return UnlearnResult(self.params, steps, predicted, predicted, 0.0)


class NoUnlearn(Retrain):
    unlearn = Algorithm.unlearn


class FitReturnsNone(Retrain):
    def fit(self):
        super().fit()


class FitDropsAName(Retrain):
    def fit(self):
        return dict(list(super().fit().items())[1:])


class UnlearnReturnsDict(Retrain):
    def unlearn(self, clients):
        return vars(super().unlearn(clients))


class FloatCost(Retrain):
    def predict_cost(self, clients):
        return super().predict_cost(clients) / 2


class SetState(Retrain):
    state_fields = (*Retrain.state_fields, "seen")

    def initial_state(self, theta0):
        return {**super().initial_state(theta0), "seen": {1, 2}}


class IntKeyState(SetState):
    def initial_state(self, theta0):
        return {**super().initial_state(theta0), "seen": {"rounds": {0: 2}}}


def _data() -> SyntheticDataModule:
    return SyntheticDataModule(
        num_clients=4, partition="iid", num_samples=32, num_test=12, shape=(4,), num_classes_=3
    )


def _trainer(root, alg: Algorithm, **kw) -> FederatedTrainer:
    return FederatedTrainer(
        algorithm=alg,
        default_root_dir=str(root),
        precision="64-true",
        enable_progress_bar=False,
        vectorize="never",
        **kw,
    )


def _fit(root, alg: Algorithm) -> FederatedTrainer:
    # no M_p replay: it would run the broken unlearning already at the end of fit
    trainer = _trainer(root, alg, enable_fairness=False)
    trainer.fit(MLP(hidden=(5,), lr=0.1), _data())
    return trainer


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (NoUnlearn, r"NoUnlearn does not define unlearn\(\)"),
        (FitReturnsNone, r"FitReturnsNone\.fit\(\) must return the model's parameters .* got NoneType"),
        (FitDropsAName, r"FitDropsAName\.fit\(\) returned other names than the model's: missing \['net"),
        (SetState, r"SetState's state field 'seen' is neither a dict of tensors nor JSON"),
        (
            IntKeyState,
            r"IntKeyState's state field 'seen' .* \(the key 0 would come back from the cache as '0'\)",
        ),
    ],
)
def test_a_broken_fit_is_one_line(run_root, cls, match):
    with pytest.raises(ContractError, match=match):
        _fit(run_root, cls(batch_size=4))


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (UnlearnReturnsDict, r"UnlearnReturnsDict\.unlearn\(\) must return an UnlearnResult.* got dict"),
        (FloatCost, r"FloatCost\.predict_cost\(\) must be an int \(client-steps, >= 0\), got 6\.0 \(float\)"),
    ],
)
def test_a_broken_request_is_one_line_and_commits_nothing(run_root, cls, match):
    trainer = _fit(run_root, cls(batch_size=4))
    with pytest.raises(ContractError, match=match):
        _trainer(run_root, cls(batch_size=4)).unlearn(
            MLP(hidden=(5,), lr=0.1), _data(), str(trainer.run_dir), [1]
        )
    assert not (trainer.run_dir / "unlearn_report.json").exists()


def test_a_result_without_seconds_gets_the_wall_time_of_unlearn(run_root):
    """The report's (and compare's ``t``) seconds had been the algorithm's 0.0."""
    trainer = _fit(run_root, Retrain(batch_size=4))
    t = time.perf_counter()
    report = _trainer(run_root, Retrain(batch_size=4)).unlearn(
        MLP(hidden=(5,), lr=0.1), _data(), str(trainer.run_dir), [1]
    )
    assert 0.0 < report["seconds"] < time.perf_counter() - t
    alg = trainer.algorithm
    _, result = alg.what_if(alg.state_dict(), [2])
    assert result.seconds > 0.0


def test_the_cli_prints_one_line_and_exits_2(tmp_path, monkeypatch):
    (tmp_path / "user_broken_alg.py").write_text(
        "from fedshard_lightning.unlearning import Algorithm\n\n\nclass Half(Algorithm):\n    def fit(self):\n"
        "        return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = cli(
        [
            "fit",
            "--trainer.algorithm",
            "user_broken_alg.Half",
            "--trainer.default_root_dir",
            str(tmp_path / "runs"),
            "--trainer.enable_progress_bar",
            "false",
            "--data.num_clients",
            "4",
        ]
    )
    assert code == 2
    assert err.splitlines() == [
        "error: trainer.algorithm: Half does not define current_params(), predict_cost(), retrain_cost(), unlearn(); "
        "an Algorithm subclass defines all of fit(), current_params(), predict_cost(), retrain_cost(), unlearn() "
        "(docs/extending.md)"
    ]
