"""Every baseline behind the one interface: fit, two unlearning requests, cache round-trips (SPEC section 9)."""

from __future__ import annotations

import pytest
import torch
from _baseline_helpers import fit, loaded, make, max_diff, unlearn

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache import FLCache
from fedshard_lightning.unlearning import FATS, FedAvg, FedEraser, FedRecover, RapidRetrain

METHODS = {
    "fedavg": (FedAvg, {}),
    "fats": (FATS, {"sample_size": 3}),
    "federaser": (FedEraser, {"local_epochs": 2}),
    "fedrecover": (
        FedRecover,
        {"rounds": 5, "warmup_rounds": 1, "correction_period": 2, "final_tuning_rounds": 1},
    ),
    "rapid_retrain": (RapidRetrain, {"unlearn_rounds": 2}),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_fit_unlearn_twice_and_cache_round_trip(run_root, method):
    factory, kw = METHODS[method]
    trainer = fit(run_root, factory, **kw)
    run = trainer.run_dir
    fitted = trainer.algorithm.current_params()
    assert trainer.algorithm.total_client_steps > 0
    assert max_diff(loaded(run_root, run, factory, **kw).current_params(), fitted) == 0

    reports = []
    for clients, gone in (([1], [1]), ([0, 4], [0, 1, 4])):
        t, model, dm = make(run_root, factory, **kw)
        rep = t.unlearn(model, dm, str(run), clients)
        reports.append(rep)
        assert rep["client_steps"] == rep["predicted_client_steps"], rep
        assert rep["seconds"] >= 0 and rep["server_seconds"] >= 0
        assert rep["retrain_client_steps"] > 0
        after = loaded(run_root, run, factory, **kw)
        assert after.unlearned == gone
        assert max_diff(after.current_params(), t.algorithm.current_params()) == 0
    assert reports[1]["request"] == 2
    manifest = FLCache(run / "cache").manifest()
    for key in ("fingerprint", "algorithm", "complete", "unlearned", "client_steps", "hparams"):
        assert key in manifest
    assert manifest["algorithm"] == factory.name and manifest["complete"] is True
    assert [r["clients"] for r in manifest["requests"]] == [[1], [0, 4]]
    assert manifest["seed"] == 0


def test_fedavg_persists_request_log(run_root):
    run = fit(run_root, FedAvg).run_dir
    unlearn(run_root, run, FedAvg, [1])
    assert len(FLCache(run / "cache").manifest().get("requests", [])) == 1


@pytest.mark.parametrize("method", ["fats", "federaser", "rapid_retrain"])
def test_cache_of_another_config_is_refused(run_root, method):
    factory, kw = METHODS[method]
    run = fit(run_root, factory, **kw).run_dir
    with pytest.raises(CacheError, match="another config"):
        loaded(run_root, run, factory, **{**kw, "rounds": 4})


def test_predicted_cost_is_exact_with_client_sampling(run_root):
    """client_fraction < 1: participants are keyed, so every method predicts its cost exactly."""
    for factory, kw in (
        (FedEraser, {"local_epochs": 2, "client_fraction": 0.5}),
        (FedRecover, {"rounds": 4, "warmup_rounds": 1, "correction_period": 2, "client_fraction": 0.5}),
        (RapidRetrain, {"client_fraction": 0.5}),
    ):
        alg = fit(run_root, factory, **kw).algorithm
        predicted = alg.predict_cost([2])
        res = alg.unlearn([2])
        assert res.client_steps == predicted == res.predicted_client_steps
        assert torch.isfinite(torch.cat([v.reshape(-1) for v in res.params.values()])).all()
