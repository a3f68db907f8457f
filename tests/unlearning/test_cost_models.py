"""The per-client unlearning costs under SPEC section 8's cost models, against plain loops.

``predict_cost`` (client-steps) and ``predict_latency`` (each retrained round costs its slowest
participant's steps; shards of a stage retrain in parallel) are checked against a loop over the
frozen tree (FedShard) or over the rounds (FedAvg, FATS) that knows nothing of the code's shortcuts.
"""

from __future__ import annotations

import _baseline_helpers as base
import pytest
import torch
from _fedshard_helpers import fit, loaded

from fedshard_lightning.engine import Group
from fedshard_lightning.experiments.compare import _me
from fedshard_lightning.metrics import efficiency_fairness
from fedshard_lightning.unlearning import FATS, FedAvg


def _tree_loop(alg, client: int, latency: bool) -> int:
    """Every stage: the shard holding ``client``, retrained without it for its rounds, round by round."""
    total = 0
    for p, recs in enumerate(alg.records, start=1):
        for i, rec in enumerate(recs):
            if client not in rec.clients:
                continue
            rest = [c for c in rec.clients if c != client]
            group = Group(i, tuple(rest), rec.rounds)
            for r in range(rec.rounds):
                steps = [alg._steps[c] for c in alg.engine.participants(p, group, r)] if rest else []
                total += (max(steps) if steps else 0) if latency else sum(steps)
    return total


@pytest.mark.parametrize("client_fraction", [1.0, 0.5])
def test_fedshard_costs_equal_a_loop_over_the_tree(run_root, client_fraction):
    # Dirichlet sizes: clients take different numbers of steps, so max and sum differ.
    kw = dict(
        k=8,
        rounds="a2",
        t0=1,
        t1=3,
        client_fraction=client_fraction,
        data_kw=dict(partition="dirichlet", rho=0.5, min_client_size=3),
    )
    alg = loaded(run_root, fit(run_root, **kw), **kw)
    steps = [alg.predict_cost([c]) for c in range(8)]
    lat = [alg.predict_latency([c]) for c in range(8)]
    assert steps == [_tree_loop(alg, c, latency=False) for c in range(8)]
    assert lat == [_tree_loop(alg, c, latency=True) for c in range(8)]
    assert all(0 < a < b for a, b in zip(lat, steps))


def test_fedshard_latency_of_a_multi_client_request_takes_the_slowest_shard_per_stage(run_root):
    kw = dict(
        k=8, rounds="fixed", fixed_rounds=2, data_kw=dict(partition="dirichlet", rho=0.5, min_client_size=3)
    )
    alg = loaded(run_root, fit(run_root, **kw), **kw)
    leaving = [0, 7]
    want = 0
    for recs in alg.records:
        hit = [rec for rec in recs if set(leaving) & set(rec.clients)]
        want += max(
            rec.rounds * max((alg._steps[c] for c in rec.clients if c not in leaving), default=0)
            for rec in hit
        )
    assert alg.predict_latency(leaving) == want


@pytest.mark.parametrize(
    ("factory", "kw"), [(FedAvg, {}), (FedAvg, {"client_fraction": 0.5}), (FATS, {"sample_size": 3})]
)
def test_round_based_costs_equal_a_loop_over_the_rounds(run_root, factory, kw):
    alg = base.fit(run_root, factory, **kw).algorithm
    for c in range(base.K):
        rest = [x for x in range(base.K) if x != c]
        first = alg.first_round([c]) if factory is FATS else 0
        if first is None:
            assert alg.predict_cost([c]) == alg.predict_latency([c]) == 0
            continue
        steps, lat = 0, 0
        for r in range(first, alg.rounds):
            group = Group(0, tuple(rest), 1 if factory is FATS else alg.rounds)
            part = (
                alg.engine.participants(r, group, 0)
                if factory is FATS
                else alg.engine.participants(0, group, r)
            )
            counts = [alg.engine.schedule.num_steps(int(alg.engine.sizes[x])) for x in part]
            steps += sum(counts)
            lat += max(counts, default=0)
        assert alg.predict_cost([c]) == steps
        assert alg.predict_latency([c]) == lat


def test_m_e_of_each_cost_model_is_the_plain_formula():
    """compare's M_e columns: ``mean_c (Z_avg - Z_c)^2 / max(|alpha_c|, eps)`` on each model's costs."""
    gen = torch.Generator().manual_seed(0)
    alphas = (torch.rand(12, generator=gen, dtype=torch.float64) - 0.5).tolist()
    for costs in ([3.0, 5.0, 9.0] * 4, torch.rand(12, generator=gen, dtype=torch.float64).tolist()):
        z = torch.tensor(costs, dtype=torch.float64)
        a = torch.tensor(alphas, dtype=torch.float64)
        want = float(((z.mean() - z) ** 2 / a.abs().clamp_min(1e-6)).mean())
        assert _me(costs, alphas, 1e-6) == pytest.approx(want, rel=1e-12)
        assert float(efficiency_fairness(z, a, 1e-6)) == pytest.approx(want, rel=1e-12)
