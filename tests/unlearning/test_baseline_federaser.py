"""FedEraser: the calibration formula against numpy, the retained history, end-to-end costs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _baseline_helpers import fit, max_diff

from fedshard_lightning.engine import Group, stack_params
from fedshard_lightning.flcache import FLCache
from fedshard_lightning.unlearning import FedEraser
from fedshard_lightning.unlearning.federaser import calibrate_updates, weighted_mean


def _history(rng, n):
    return {"w": rng.normal(size=(n, 3, 2)), "b": rng.normal(size=(n, 3))}


def test_calibration_matches_numpy_reference():
    rng = np.random.default_rng(0)
    old, new = _history(rng, 4), _history(rng, 4)
    new["b"][2] = 0.0  # a zero new update stays zero
    sizes = np.array([3.0, 5.0, 2.0, 7.0])
    cal = calibrate_updates(
        {k: torch.tensor(v) for k, v in old.items()}, {k: torch.tensor(v) for k, v in new.items()}
    )
    step = weighted_mean(cal, torch.tensor(sizes))
    for k in old:
        ref = np.stack(
            [
                np.linalg.norm(old[k][c]) * new[k][c] / np.linalg.norm(new[k][c])
                if np.linalg.norm(new[k][c]) > 0
                else np.zeros_like(new[k][c])
                for c in range(4)
            ]
        )
        np.testing.assert_allclose(cal[k].numpy(), ref, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(
            step[k].numpy(), np.tensordot(sizes / sizes.sum(), ref, axes=1), rtol=1e-12, atol=1e-15
        )
        # per layer and per client: every calibrated tensor has its old tensor's norm
        for c in range(4):
            if np.linalg.norm(new[k][c]) > 0:
                assert np.linalg.norm(cal[k][c].numpy()) == pytest.approx(np.linalg.norm(old[k][c]))


def test_history_and_end_to_end_unlearning(run_root):
    """Per-client calibration with round 0 retrained: the paper's formula (``calibrate="client"``)."""
    trainer = fit(
        run_root, FedEraser, rounds=4, delta_t=2, local_epochs=2, calibrate="client", reuse_first_round=False
    )
    alg = trainer.algorithm
    assert alg.history.rounds == [0, 2]
    assert alg.calibration_schedule.local_epochs == 1
    start, _ = alg.history.load(0, "cpu")
    assert all(torch.equal(start[k], alg.theta0[k].cpu()) for k in start)
    assert alg.history.participants == {0: list(range(6)), 2: list(range(6))}

    res = alg.unlearn([3])
    steps = alg.calibration_engine.client_steps_of([0, 1, 2, 4, 5])
    assert res.details["calibrated_rounds"] == [0, 2]
    assert res.client_steps == res.predicted_client_steps == 2 * steps
    assert res.retrain_client_steps == 4 * alg.engine.client_steps_of([0, 1, 2, 4, 5]) == 4 * res.client_steps
    assert res.server_seconds > 0
    files = FLCache(trainer.run_dir / "cache").manifest()["files"]
    assert {"round_0000.safetensors", "round_0002.safetensors", "theta0.safetensors"} <= set(files)
    assert "round_0001.safetensors" not in files

    # reference replay of the retained rounds, with the calibration formula in numpy
    rest = [0, 1, 2, 4, 5]
    sizes = np.array([alg.ctx.client_sizes[c] for c in rest], dtype=float)
    w = {k: v.clone() for k, v in alg.theta0.items()}
    for r in (0, 2):
        out = alg.calibration_engine.train_groups(
            stack_params([w]), [Group(0, tuple(rest), 1)], r, keep_client_params=True
        )
        client = out.history[0].client_params
        _, old = alg.history.load(r, "cpu")
        for k in w:
            new = (client[k] - w[k]).numpy()
            prev = old[k][rest].numpy()
            scale = [np.linalg.norm(prev[i]) / np.linalg.norm(new[i]) for i in range(len(rest))]
            w[k] = w[k] + torch.tensor(np.tensordot(sizes / sizes.sum() * scale, new, axes=1))
    assert max_diff(res.params, w) <= 1e-12


def test_default_calibrates_the_mean_update_and_reuses_round_0(run_root):
    """The authors' code: round 0 averaged from the retained updates, later rounds calibrate the mean."""
    alg = fit(run_root, FedEraser, rounds=4, delta_t=2, local_epochs=2).algorithm
    res = alg.unlearn([3])
    rest = [0, 1, 2, 4, 5]
    assert res.details["reused_rounds"] == [0] and res.details["calibrated_rounds"] == [2]
    assert res.client_steps == res.predicted_client_steps == alg.calibration_engine.client_steps_of(rest)
    sizes = np.array([alg.ctx.client_sizes[c] for c in rest], dtype=float)
    p = sizes / sizes.sum()
    w = {k: v.clone() for k, v in alg.theta0.items()}
    _, old0 = alg.history.load(0, "cpu")
    for k in w:
        w[k] = w[k] + torch.tensor(np.tensordot(p, old0[k][rest].numpy(), axes=1))
    out = alg.calibration_engine.train_groups(
        stack_params([w]), [Group(0, tuple(rest), 1)], 2, keep_client_params=True
    )
    client = out.history[0].client_params
    _, old2 = alg.history.load(2, "cpu")
    for k in w:
        mean_new = np.tensordot(p, (client[k] - w[k]).numpy(), axes=1)
        mean_old = np.tensordot(p, old2[k][rest].numpy(), axes=1)
        w[k] = w[k] + torch.tensor(np.linalg.norm(mean_old) / np.linalg.norm(mean_new) * mean_new)
    assert max_diff(res.params, w) <= 1e-12


def test_calibration_rounding():
    assert FedEraser(local_epochs=5, calibration_ratio=0.5).calibration_schedule.local_epochs == 3
    assert FedEraser(local_steps=7, calibration_ratio=0.3).calibration_schedule.local_steps == 3
    with pytest.warns(UserWarning, match="rounds up"):
        FedEraser(local_epochs=1, calibration_ratio=0.5)
