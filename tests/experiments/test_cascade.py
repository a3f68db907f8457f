"""Cascaded leaving and uf-DPA (paper Appendix G.5) end to end on tiny settings."""

from __future__ import annotations

import json

import pytest
import torch
from threadpoolctl import threadpool_limits

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.experiments import cascade as cascade_module
from fedshard_lightning.experiments import poisoning as poisoning_module
from fedshard_lightning.experiments.cascade import cascade, minority_clients
from fedshard_lightning.experiments.poisoning import poisoning
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedAvg, FedShard


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a shared, loaded 2-core CPU torch's and OpenMP's threads only spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        yield
    torch.set_num_threads(threads)


K = 8


def _data(partition="label_split"):
    return SyntheticDataModule(
        num_clients=K,
        partition=partition,
        label_split_fraction=0.75,
        num_samples=16 * K,
        num_test=60,
        shape=(6,),
        num_classes_=4,
        noise=1.5,
    )


def _methods():
    return [
        FedShard(rounds="fixed", fixed_rounds=2, batch_size=8),
        FedAvg(rounds=3, batch_size=8),
    ]


def _common(tmp_path, name):
    return dict(
        output_dir=str(tmp_path / name),
        model=MLP(hidden=(8,), lr=0.2),
        data=_data(),
        vectorize="always",
        precision="64-true",
    )


def test_minority_is_the_smaller_label_group():
    dm = _data()
    dm.setup()
    assert minority_clients(dm) == [6, 7]
    labels = {c: set(dm.train_y[dm.client_indices[c]].tolist()) for c in range(K)}
    assert all(labels[c] <= {0, 1} for c in range(6)) and all(labels[c] <= {2, 3} for c in (6, 7))


def test_cascade_end_to_end(tmp_path):
    out = cascade(algorithms=_methods(), initial_leavers=1, **_common(tmp_path, "c"))
    saved = json.loads((tmp_path / "c" / "cascade.json").read_text())
    assert saved["summary"] == out["summary"]
    assert set(saved["methods"]) == {"fedshard", "fedavg"}
    assert saved["settings"]["minority_clients"] == [6, 7]
    assert {"y_star", "cost_weight", "cost_unit", "initial_leavers"} <= set(saved["settings"])
    for name, res in saved["methods"].items():
        for key in (
            "initial_leavers",
            "cascaded_leavers",
            "cascaded_clients",
            "cascaded_minority",
            "cascaded_majority",
            "remaining_clients",
            "iterations",
            "M_p_first_request",
        ):
            assert key in res, (name, key)
        assert res["initial_leavers"] == saved["methods"]["fedshard"]["initial_leavers"]
        assert len(res["initial_leavers"]) == 1 and res["initial_leavers"][0] in (6, 7)
        assert res["cascaded_leavers"] == len(res["cascaded_clients"])
        assert res["M_p_first_request"] >= 4.0
        first = res["iterations"][0]
        assert first["leaving"] == res["initial_leavers"] and first["client_steps"] > 0
        assert 0 < first["Z"] <= 0.01 * 1.0001
        for a, b in zip(res["iterations"], res["iterations"][1:]):
            assert b["leaving"] == a["decide_to_leave"]


@pytest.mark.parametrize(("y_star", "expected"), [(1.5, 0), (-2.0, K - 1)])
def test_cascade_payoff_rule_extremes(tmp_path, y_star, expected):
    # Y* above any possible drop: nobody leaves. Y* below -1: leaving always pays, everyone goes.
    out = cascade(
        algorithms=[FedShard(rounds="fixed", fixed_rounds=1, batch_size=8)],
        initial_leavers=1,
        y_star=y_star,
        **_common(tmp_path, f"y{y_star}"),
    )
    res = out["methods"]["fedshard"]
    assert res["cascaded_leavers"] == expected
    assert res["cascaded_majority"] + res["cascaded_minority"] == expected
    if expected:
        assert res["iterations"][-1]["dissolved"] is True


def test_poisoning_end_to_end(tmp_path):
    out = poisoning(algorithms=_methods(), threshold=0.05, **_common(tmp_path, "p"))
    saved = json.loads((tmp_path / "p" / "poisoning.json").read_text())
    assert saved["settings"]["attackers"] == [6, 7]
    assert set(saved["summary"]) == {"fedshard", "fedavg"}
    for res in saved["methods"].values():
        for key in ("attack_precision", "poisoned_clients", "M_p", "delta_acc", "delta_acc_remaining_mean"):
            assert key in res
        assert 0.0 <= res["attack_precision"] <= 1.0
        assert res["attack_precision"] == len(res["poisoned_clients"]) / 6
        assert set(res["poisoned_clients"]) <= set(range(6))
        assert all(res["delta_acc"][c] > 0.05 for c in res["poisoned_clients"])
        assert res["M_p"] >= 4.0 and len(res["delta_acc"]) == K
    assert out["summary"] == saved["summary"]


def test_experiments_refuse_other_partitions(tmp_path):
    with pytest.raises(ConfigError, match="label_split"):
        poisoning(output_dir=str(tmp_path / "x"), data=_data("iid"))


@pytest.mark.parametrize("module", [cascade_module, poisoning_module])
def test_cli_help(module, capsys):
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--output_dir" in out and "--algorithms" in out and "--config" in out


def test_cascade_cut_by_max_iterations_counts_who_decided_to_leave(tmp_path):
    # Reference (the payoff rule): a client that decided to leave is a cascaded leaver, whether or
    # not the cap leaves time to unlearn it; a cut cascade says so.
    def run(max_iterations):
        out = cascade(
            algorithms=[FedShard(rounds="fixed", fixed_rounds=2, batch_size=8)],
            initial_leavers=2,
            y_star=-0.01,
            max_iterations=max_iterations,
            **_common(tmp_path, f"m{max_iterations}"),
        )
        return out["methods"]["fedshard"]

    full = run(20)
    assert len(full["iterations"]) >= 3 and not full["stopped_at_max_iterations"]
    for cap in (0, 1):
        cut = run(cap)
        decided = sorted(c for it in full["iterations"][: cap + 1] for c in it["decide_to_leave"])
        assert cut["cascaded_clients"] == decided and cut["cascaded_leavers"] == len(decided)
        assert cut["stopped_at_max_iterations"] is True
        assert cut["iterations"][-1]["stopped_at_max_iterations"] is True
        assert cut["remaining_clients"] == K - 2 - len(decided)
