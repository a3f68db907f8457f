"""FedRecover: L-BFGS on a quadratic with known Hessian, stored history, degeneration to retraining."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _baseline_helpers import fit, max_diff

from fedshard_lightning.unlearning import FedRecover
from fedshard_lightning.unlearning.federaser import weighted_mean
from fedshard_lightning.unlearning.fedrecover import curvature_ok, lbfgs_hvp

N = 12


def _quadratic(low, high, seed=0):
    """f(w) = 0.5 w^T A w - b^T w with A's spectrum in [low, high]; gradient A w - b."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(N, N)))
    lam = np.linspace(low, high, N)
    a = q @ np.diag(lam) @ q.T
    b = rng.normal(size=N)
    return a, b, q, lam, rng


def _pairs(a, b, ws):
    """(Δw, Δg) from consecutive iterates, gradients of the quadratic."""
    grads = [a @ w - b for w in ws]
    return [ws[i + 1] - ws[i] for i in range(len(ws) - 1)], [
        grads[i + 1] - grads[i] for i in range(len(ws) - 1)
    ]


def _bfgs_reference(dws, dgs, v):
    """Dense BFGS recursion from B0 = sigma I (sigma from the newest pair), in numpy."""
    s, y = dws[-1], dgs[-1]
    bmat = (y @ s) / (s @ s) * np.eye(len(v))
    for s, y in zip(dws, dgs):
        bs = bmat @ s
        bmat = bmat - np.outer(bs, bs) / (s @ bs) + np.outer(y, y) / (y @ s)
    return bmat @ v


def _t(xs):
    return [torch.tensor(x) for x in xs]


def test_lbfgs_compact_form_equals_bfgs_recursion_on_a_quadratic():
    a, b, _, _, rng = _quadratic(0.5, 4.0)
    ws = [rng.normal(size=N) for _ in range(4)]
    dws, dgs = _pairs(a, b, ws)
    v = rng.normal(size=N)
    est = lbfgs_hvp(_t(dws), _t(dgs), torch.tensor(v)).numpy()
    np.testing.assert_allclose(est, _bfgs_reference(dws, dgs, v), rtol=1e-9, atol=1e-10)
    # the newest secant equation holds exactly
    np.testing.assert_allclose(
        lbfgs_hvp(_t(dws), _t(dgs), torch.tensor(dws[-1])).numpy(), dgs[-1], atol=1e-10
    )


def test_lbfgs_estimates_the_gradient_difference():
    # exact on the span of A-conjugate pairs (here: eigenvectors of A)
    a, b, q, _, rng = _quadratic(0.5, 4.0)
    w0 = rng.normal(size=N)
    ws = [w0, w0 + q[:, 0], w0 + q[:, 0] + 0.5 * q[:, 5], w0 + q[:, 0] + 0.5 * q[:, 5] - 2 * q[:, 9]]
    dws, dgs = _pairs(a, b, ws)
    v = 0.3 * q[:, 0] - 1.1 * q[:, 5] + 0.7 * q[:, 9]
    np.testing.assert_allclose(lbfgs_hvp(_t(dws), _t(dgs), torch.tensor(v)).numpy(), a @ v, atol=1e-10)
    # any direction, well-conditioned A (spectrum in [1, 1.2]): relative error below 0.2
    a, b, _, _, rng = _quadratic(1.0, 1.2, seed=1)
    for _ in range(20):
        ws = [rng.normal(size=N) for _ in range(3)]
        dws, dgs = _pairs(a, b, ws)
        v = rng.normal(size=N)
        est = lbfgs_hvp(_t(dws), _t(dgs), torch.tensor(v)).numpy()
        assert np.linalg.norm(est - a @ v) <= 0.2 * np.linalg.norm(a @ v)
    # a scalar Hessian is recovered exactly from one pair
    est = lbfgs_hvp(_t([ws[0]]), _t([2.5 * ws[0]]), torch.tensor(v)).numpy()
    np.testing.assert_allclose(est, 2.5 * v, atol=1e-12)


def test_curvature_condition():
    dw = torch.tensor([1.0, 0.0])
    assert curvature_ok(dw, torch.tensor([-1.0, 0.2]), 0.0)
    assert not curvature_ok(dw, torch.tensor([1.0, 0.2]), 0.0)
    assert not curvature_ok(dw, torch.zeros(2), 0.0)


def test_exact_round_schedule():
    alg = FedRecover(rounds=12, warmup_rounds=2, correction_period=3, final_tuning_rounds=2)
    assert [t for t in range(12) if alg.is_exact(t)] == [0, 1, 4, 7, 10, 11]
    assert all(FedRecover(rounds=5, warmup_rounds=0, correction_period=1).is_exact(t) for t in range(5))


def test_history_holds_every_round(run_root):
    alg = fit(run_root, FedRecover, rounds=3).algorithm
    sizes = alg.ctx.client_sizes
    for t in range(3):
        start, updates = alg.history.load(t, "cpu")
        w = torch.tensor([float(sizes[c]) for c in alg.history.participants[t]], dtype=torch.float64)
        nxt = alg.history.load(t + 1, "cpu")[0] if t < 2 else alg.current_params()
        after = {k: start[k] + v for k, v in weighted_mean(updates, w).items()}
        assert max_diff(after, nxt) <= 1e-12


def test_all_exact_rounds_equal_retraining(run_root):
    kw = dict(rounds=4, warmup_rounds=4, correction_period=1, final_tuning_rounds=0)
    alg = fit(run_root, FedRecover, **kw).algorithm
    res = alg.unlearn([2])
    assert res.details["estimated_rounds"] == [] and res.details["exact_rounds"] == [0, 1, 2, 3]
    reference = fit(run_root, FedRecover, unlearned=[2], **kw).algorithm
    assert max_diff(res.params, reference.current_params()) <= 1e-10
    assert (
        res.client_steps
        == res.predicted_client_steps
        == res.retrain_client_steps
        == reference.total_client_steps
    )


def test_estimated_rounds_are_free(run_root):
    kw = dict(rounds=6, warmup_rounds=2, correction_period=3, final_tuning_rounds=1)
    alg = fit(run_root, FedRecover, local_epochs=2, **kw).algorithm
    res = alg.unlearn([0])
    assert res.details["exact_rounds"] == [0, 1, 4, 5] and res.details["estimated_rounds"] == [2, 3]
    assert res.client_steps == res.predicted_client_steps == res.retrain_client_steps * 4 // 6
    assert res.server_seconds > 0
    assert torch.isfinite(torch.cat([v.reshape(-1) for v in res.params.values()])).all()


@pytest.mark.parametrize("bad", [{"correction_period": 0}, {"buffer_size": 0}, {"warmup_rounds": -1}])
def test_invalid_settings_are_refused(bad):
    from fedshard_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=next(iter(bad))):
        FedRecover(**bad)
