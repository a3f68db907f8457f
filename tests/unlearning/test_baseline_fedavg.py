"""FA: FedAvg's unlearning retrains from scratch and equals FedAvg trained without the clients."""

from __future__ import annotations

from _baseline_helpers import fit, loaded, max_diff, unlearn

from fedshard_lightning.unlearning import FedAvg

KW = {"client_fraction": 0.6}


def test_fa_equals_fedavg_without_the_clients_from_the_start(run_root):
    run = fit(run_root, FedAvg, **KW).run_dir
    rep = unlearn(run_root, run, FedAvg, [2], **KW)
    cached = loaded(run_root, run, FedAvg, **KW)
    reference = fit(run_root, FedAvg, unlearned=[2], **KW).algorithm
    assert max_diff(cached.current_params(), reference.current_params()) <= 1e-10
    assert rep["client_steps"] == rep["predicted_client_steps"] == reference.total_client_steps
    res2 = cached.unlearn([0, 5])  # a second request retrains without every unlearned client
    reference2 = fit(run_root, FedAvg, unlearned=[0, 2, 5], **KW).algorithm
    assert max_diff(res2.params, reference2.current_params()) <= 1e-10
    assert res2.client_steps == reference2.total_client_steps
