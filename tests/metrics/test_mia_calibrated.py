"""The calibrated MIA's scores and summaries against scikit-learn, numpy and hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score, roc_curve

from fedshard_lightning.metrics.mia_calibrated import (
    auc_difference_ci,
    best_f1_threshold,
    calibrated_scores,
    f1_at_threshold,
    logit_confidence,
    roc_auc,
    tpr_at_fpr,
)


def _gaussians(d: float, n: int = 4000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(d, 1.0, n), rng.normal(0.0, 1.0, n)


@pytest.mark.parametrize("d", [0.0, 0.5, 1.0, 2.0])
def test_auc_known_separation(d):
    """Two unit Gaussians d apart: AUC = Phi(d / sqrt 2); equal to scikit-learn's on the sample."""
    m, n = _gaussians(d)
    ours = roc_auc(m, n)
    ref = roc_auc_score(np.r_[np.ones(len(m)), np.zeros(len(n))], np.r_[m, n])
    assert ours == pytest.approx(ref, abs=1e-12)
    assert ours == pytest.approx(0.5 * (1 + math.erf(d / 2)), abs=0.02)


def test_auc_ties_count_half():
    m, n = np.array([1.0, 1.0, 2.0]), np.array([1.0, 0.0])
    assert roc_auc(m, n) == pytest.approx(roc_auc_score([1, 1, 1, 0, 0], np.r_[m, n]))
    assert roc_auc([3.0, 2.0], [1.0, 2.0]) == 0.875  # (1 + 1 + 1 + 0.5) / 4


def test_tpr_at_fpr_hand():
    """100 non-members: one false positive allowed at 1% FPR, so the threshold is the 2nd largest."""
    non = np.r_[10.0, 3.0, np.zeros(98)]
    members = np.array([11.0, 5.0, 3.0, 2.0])
    # threshold 3.0 (strictly above): 11 and 5 -> 2 of 4; the non-member at 10 is the one FP
    assert tpr_at_fpr(members, non, 0.01) == 0.5
    # no false positive allowed: threshold 10 -> only 11
    assert tpr_at_fpr(members, non, 0.0) == 0.25


def test_tpr_at_fpr_against_roc_curve():
    m, n = _gaussians(1.5, n=3000, seed=1)
    fpr, tpr, _ = roc_curve(np.r_[np.ones(len(m)), np.zeros(len(n))], np.r_[m, n])
    assert tpr_at_fpr(m, n, 0.01) == pytest.approx(tpr[fpr <= 0.01].max())


def test_logit_confidence_against_numpy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 7, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(7, (50,), generator=g)
    p = torch.softmax(logits, 1)[torch.arange(50), labels].numpy()
    np.testing.assert_allclose(logit_confidence(logits, labels), np.log(p / (1 - p)), rtol=1e-9, atol=1e-9)
    # stays finite where p_y rounds to 1
    assert np.isfinite(logit_confidence(torch.tensor([[200.0, 0.0]]), torch.tensor([0]))).all()


def test_calibrated_scores_against_numpy():
    rng = np.random.default_rng(2)
    shadows = rng.normal(size=(4, 6))
    target = rng.normal(size=6)
    out = np.array([[1, 1, 0, 1, 1, 1], [1, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1]], bool)
    scores, sigma = calibrated_scores(target, shadows, out)
    mu = np.array([shadows[out[:, j], j].mean() for j in range(6)])
    resid = np.concatenate([shadows[out[:, j], j] - mu[j] for j in range(6)])
    ref_sigma = math.sqrt((resid**2).sum() / (out.sum() - 6))
    assert sigma == pytest.approx(ref_sigma)
    np.testing.assert_allclose(scores, (target - mu) / ref_sigma)
    with pytest.raises(ValueError, match="no OUT shadow"):
        calibrated_scores(target, shadows, np.zeros_like(out))


def test_calibration_removes_example_difficulty():
    """Members gain +0.5 confidence over hard/easy examples spread by 3: raw AUC is weak, calibrated strong."""
    rng = np.random.default_rng(3)
    difficulty = rng.normal(0, 3, 2000)
    member = np.r_[np.ones(1000, bool), np.zeros(1000, bool)]
    shadows = difficulty + rng.normal(0, 0.3, (8, 2000))
    target = difficulty + 0.5 * member + rng.normal(0, 0.3, 2000)
    scores, _ = calibrated_scores(target, shadows)
    assert roc_auc(target[member], target[~member]) < 0.6
    assert roc_auc(scores[member], scores[~member]) > 0.8


def test_f1_threshold():
    m, n = np.array([3.0, 2.0, 0.5]), np.array([1.0, 0.0, -1.0])
    # above 1.0: tp 2, fp 0, fn 1 -> 4 / 5
    assert f1_at_threshold(m, n, 1.0) == pytest.approx(0.8)
    assert f1_at_threshold(m, n, best_f1_threshold(m, n)) >= 0.8


def test_auc_difference_ci():
    m, n = _gaussians(1.0, n=500)
    same = auc_difference_ci([(m, n, m, n)], num_bootstrap=200)
    assert same["diff"] == 0 and same["low"] == 0 and same["high"] == 0
    m2, n2 = _gaussians(0.0, n=500, seed=5)
    apart = auc_difference_ci([(m, n, m2, n2)], num_bootstrap=200)
    assert apart["low"] > 0.1
    assert apart["auc_a_low"] < apart["auc_a"] < apart["auc_a_high"]
