"""Tests of the membership-inference attack (SPEC section 10) on synthetic logits."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_limits

from fedshard_lightning.metrics import ATTACK_CLASSIFIERS, MembershipInferenceAttack, attack_features
from fedshard_lightning.metrics import mia as mia_module

NUM_CLASSES = 10


@pytest.fixture(autouse=True)
def _one_openmp_thread():
    """HistGradientBoosting's OpenMP threads spin badly on a shared, loaded CPU: 10x slower."""
    with threadpool_limits(limits=1):
        yield


def confident_logits(n: int, seed: int) -> torch.Tensor:
    """What a model outputs on its training data: a large margin on one class."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(NUM_CLASSES, (n,), generator=gen)
    margin = 6.0 + torch.randn(n, generator=gen)
    noise = 0.5 * torch.randn(n, NUM_CLASSES, generator=gen)
    return noise + margin[:, None] * torch.nn.functional.one_hot(labels, NUM_CLASSES)


def flat_logits(n: int, seed: int) -> torch.Tensor:
    """What it outputs on unseen data: no clear winner."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, NUM_CLASSES, generator=gen)


def mixed_logits(n: int, seed: int) -> torch.Tensor:
    """A realistic single distribution: half confident, half flat, shuffled."""
    logits = torch.cat([confident_logits(n // 2, seed), flat_logits(n - n // 2, seed + 1)])
    return logits[torch.randperm(n, generator=torch.Generator().manual_seed(seed + 2))]


def reference_features(logits: np.ndarray, top_k: int | None) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    ordered = -np.sort(-probs, axis=1)
    return ordered if top_k is None else ordered[:, :top_k]


@pytest.mark.parametrize("top_k", [None, 1, 3, NUM_CLASSES])
def test_attack_features_match_numpy(top_k):
    logits = np.random.default_rng(0).normal(scale=3.0, size=(50, NUM_CLASSES))
    features = attack_features(torch.from_numpy(logits), top_k=top_k)
    expected = reference_features(logits, top_k)
    assert features.dtype == np.float64
    assert features.shape == expected.shape
    np.testing.assert_allclose(features, expected, rtol=1e-12, atol=1e-15)
    assert (np.diff(features, axis=1) <= 0).all()
    np.testing.assert_allclose(attack_features(logits.astype(np.float32), top_k), expected, rtol=1e-5)


def test_attack_features_discard_class_identity():
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    features = attack_features(logits)
    np.testing.assert_allclose(features[0], features[1], rtol=1e-14)
    assert features[0].sum() == pytest.approx(1.0)


@pytest.mark.parametrize("classifier", ATTACK_CLASSIFIERS)
def test_f1_is_high_when_members_are_confident(classifier):
    attack = MembershipInferenceAttack(classifier=classifier, seed=0)
    attack.fit(confident_logits(600, seed=1), flat_logits(600, seed=2))
    # Fresh samples: the evaluated model behaves like the original one (no unlearning).
    assert attack.f1(confident_logits(300, seed=3), flat_logits(300, seed=4)) > 0.8


@pytest.mark.parametrize("classifier", ["gradient_boosting", "logistic"])
def test_f1_is_near_chance_on_identical_distributions(classifier):
    """Members and non-members from one distribution: the attack can only guess.

    Chance is not one F1 value: a guess that says "member" to a share q of a balanced set has
    precision 0.5 and recall q, so F1 = q / (0.5 + q), between 0 and 2/3 (e.g. the logistic attack
    leans to "non-member", q ~ 0.27, F1 ~ 0.36; gradient boosting q ~ 0.52, F1 ~ 0.52). Tolerance:
    accuracy within 0.5 +- 0.05 (about 6 standard deviations at 2000 + 2000 samples) and F1 within
    0.05 of q / (0.5 + q), against > 0.8 for the informative attack above.
    """
    attack = MembershipInferenceAttack(classifier=classifier, seed=0)
    attack.fit(mixed_logits(2000, seed=10), mixed_logits(2000, seed=20))
    members, nonmembers = mixed_logits(2000, seed=30), mixed_logits(2000, seed=40)
    said_member = np.concatenate([attack.predict_proba(members), attack.predict_proba(nonmembers)]) > 0.5
    accuracy = 0.5 * (said_member[:2000].mean() + (~said_member[2000:]).mean())
    share = said_member.mean()
    f1 = attack.f1(members, nonmembers)
    assert abs(accuracy - 0.5) < 0.05
    assert abs(f1 - share / (0.5 + share)) < 0.05
    assert f1 < 2 / 3 + 0.05


def _mann_whitney_auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(score of a member > score of a non-member) + half the ties: the AUC, by counting pairs."""
    diff = pos[:, None] - neg[None, :]
    return float((diff > 0).mean() + 0.5 * (diff == 0).mean())


@pytest.mark.parametrize("classifier", ["gradient_boosting", "logistic"])
def test_auc_counts_pairs_and_is_chance_without_power(classifier):
    attack = MembershipInferenceAttack(classifier=classifier, seed=0)
    attack.fit(confident_logits(600, seed=1), flat_logits(600, seed=2))
    members, nonmembers = confident_logits(200, seed=3), flat_logits(300, seed=4)
    kept = nonmembers[np.sort(np.random.default_rng(0).choice(300, size=200, replace=False))]
    want = _mann_whitney_auc(attack.predict_proba(members), attack.predict_proba(kept))
    assert attack.auc(members, nonmembers) == pytest.approx(want, abs=1e-12)  # same balanced subsample
    assert want > 0.9
    same = MembershipInferenceAttack(classifier=classifier, seed=0)
    same.fit(mixed_logits(2000, seed=10), mixed_logits(2000, seed=20))
    assert abs(same.auc(mixed_logits(2000, seed=30), mixed_logits(2000, seed=40)) - 0.5) < 0.05


def test_f1_balances_members_against_the_same_number_of_nonmembers():
    """An attack that says "member" to everything scores 2/3 on a balanced set, whatever the sizes."""
    attack = MembershipInferenceAttack(classifier="logistic").fit(
        confident_logits(300, 1), flat_logits(100, 2)
    )
    everything_member = confident_logits(500, seed=5)
    assert attack.f1(everything_member[:20], everything_member[20:]) == pytest.approx(2 / 3)
    assert attack.f1(everything_member[:480], everything_member[480:]) == pytest.approx(2 / 3)


def test_attack_is_deterministic_for_a_seed_and_predicts_probabilities():
    members, nonmembers = confident_logits(400, 1), mixed_logits(150, 2)
    first = MembershipInferenceAttack(seed=3, top_k=3).fit(members, nonmembers)
    second = MembershipInferenceAttack(seed=3, top_k=3).fit(members, nonmembers)
    probe = mixed_logits(64, 9)
    proba = first.predict_proba(probe)
    assert proba.shape == (64,)
    assert ((proba >= 0) & (proba <= 1)).all()
    np.testing.assert_array_equal(proba, second.predict_proba(probe))
    assert first.f1(members, nonmembers) == second.f1(members, nonmembers)


ERRORS = {
    "classifier": (
        lambda: MembershipInferenceAttack(classifier="svm"),
        ValueError,
        r"`classifier` to be one of",
    ),
    "seed": (lambda: MembershipInferenceAttack(seed=-1), ValueError, r"`seed`"),
    "top_k_init": (lambda: MembershipInferenceAttack(top_k=0), ValueError, r"`top_k`"),
    "top_k_features": (lambda: attack_features(torch.zeros(2, 3), top_k=4), ValueError, r"`top_k`.*\[1, 3\]"),
    "logits_1d": (
        lambda: attack_features(torch.zeros(3)),
        ValueError,
        r"`logits` to have shape \(n, num_classes\)",
    ),
    "logits_list": (lambda: attack_features([[0.0, 1.0]]), ValueError, r"`logits` to be a torch\.Tensor"),
    "logits_nan": (
        lambda: attack_features(torch.tensor([[0.0, float("nan")]])),
        ValueError,
        r"`logits`.*finite",
    ),
    "class_mismatch": (
        lambda: MembershipInferenceAttack().fit(torch.zeros(4, 3), torch.zeros(4, 5)),
        ValueError,
        r"`member_logits` and `nonmember_logits`",
    ),
    "empty_members": (
        lambda: MembershipInferenceAttack().fit(torch.zeros(0, 3), torch.zeros(4, 3)),
        ValueError,
        r"`member_logits` to hold at least one",
    ),
    "not_fitted": (
        lambda: MembershipInferenceAttack().f1(torch.zeros(2, 3), torch.zeros(2, 3)),
        RuntimeError,
        "fit",
    ),
}


@pytest.mark.parametrize("call, error, match", ERRORS.values(), ids=ERRORS.keys())
def test_argument_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_evaluation_must_have_the_fitted_number_of_classes():
    attack = MembershipInferenceAttack(classifier="logistic").fit(confident_logits(50, 1), flat_logits(50, 2))
    with pytest.raises(ValueError, match=r"`logits` to have 10 classes"):
        attack.predict_proba(torch.zeros(3, 4))


def test_docstring_examples():
    result = doctest.testmod(mia_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0
