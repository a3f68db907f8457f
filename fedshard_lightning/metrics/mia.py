"""Membership-inference attack (MIA) F1 used to check that unlearning forgot: FedShard section 6.3.

Paper: *FedShard: Federated Unlearning with Efficiency Fairness and Performance Fairness*,
section 6.3 ("Effectiveness and Performance Fairness", Table "tab:mia") and Appendix G.5; SPEC
section 10. The attack is the model-agnostic, shadow-free variant of ML-Leaks (Salem et al.,
NDSS 2019): a scikit-learn classifier on the softmax outputs sorted in descending order, so it
learns "how confident is the model" rather than "which class".

Protocol:

1. **Fit** on the *original* (not unlearned) model: its outputs on training data are members
   (label 1), its outputs on test data are non-members (label 0). The larger side is subsampled,
   seeded, to the size of the smaller one, so the attack is trained on balanced classes.
2. **Evaluate** a model (the original one, for the "non-unlearned" baseline, or each unlearned
   one): its outputs on the leaving clients' data are members, its outputs on the same number of
   test samples are non-members; the score is the F1 of predicting "member" (label 1). After
   exact unlearning the leaving clients' data look like test data and F1 falls towards that of a
   coin (about 0.5 with a balanced guess, lower when the attack leans to "non-member").

Choices where the paper and SPEC are silent, left to the caller and documented here: the test set
should be split in two disjoint halves, one for fitting and one for evaluation, and the fitting
members should exclude the leaving clients' samples; otherwise the attack can memorise the very
samples it is scored on, which inflates the non-unlearned baseline. Evaluation balances the two
sides the same way as fitting (subsampling the larger one with the seed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from sklearn.base import ClassifierMixin

__all__ = ["ATTACK_CLASSIFIERS", "MembershipInferenceAttack", "attack_features"]

ATTACK_CLASSIFIERS: tuple[str, ...] = ("gradient_boosting", "logistic", "mlp", "random_forest")
"""Names accepted by :class:`MembershipInferenceAttack` ``classifier``."""


def attack_features(logits: Tensor | np.ndarray, top_k: int | None = None) -> np.ndarray:
    """Turn model outputs into attack features: softmax probabilities sorted in descending order.

    Sorting discards the class identity, so one attack model serves every class.

    Args:
        logits: Raw model outputs, shape ``(n, num_classes)`` with ``num_classes >= 2``.
        top_k: Keep only the ``top_k`` largest probabilities; ``None`` keeps all ``num_classes``.

    Returns:
        float64 array of shape ``(n, top_k or num_classes)``.

    Raises:
        ValueError: If ``logits`` is not a finite 2-D array with at least two classes, or
            ``top_k`` is outside ``[1, num_classes]``.

    Example:
        >>> import torch
        >>> attack_features(torch.tensor([[0.0, 0.0, 0.0, 0.0]]), top_k=2)
        array([[0.25, 0.25]])
    """
    scores = _as_logits(logits, "logits")
    num_classes = scores.shape[1]
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_classes
    ):
        raise ValueError(
            f"Expected argument `top_k` to be None or an int in [1, {num_classes}], but got {top_k!r}."
        )
    probs = torch.softmax(scores, dim=1)
    ordered = torch.sort(probs, dim=1, descending=True).values
    return ordered[:, : top_k or num_classes].numpy()


def _as_logits(logits: Any, name: str) -> Tensor:
    """Check and convert logits to a float64 CPU tensor; the message names the argument."""
    if not isinstance(logits, (Tensor, np.ndarray)):
        raise ValueError(
            f"Expected argument `{name}` to be a torch.Tensor or numpy array, "
            f"but got {type(logits).__name__}."
        )
    scores = torch.as_tensor(logits).detach().to(device="cpu", dtype=torch.float64)
    if scores.ndim != 2 or scores.shape[1] < 2:
        raise ValueError(
            f"Expected argument `{name}` to have shape (n, num_classes) with num_classes >= 2, "
            f"but got {tuple(scores.shape)}."
        )
    if not bool(torch.isfinite(scores).all()):
        raise ValueError(f"Expected argument `{name}` to contain only finite values, but it has NaN or inf.")
    return scores


def _make_classifier(name: str, seed: int) -> ClassifierMixin:
    """Build the attack model; scale-sensitive models get a StandardScaler in front.

    scikit-learn is imported here, not at module level, so that importing the metrics package (as
    every training process and DDP worker does) does not pay for it.
    """
    from sklearn.ensemble import HistGradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if name == "gradient_boosting":
        return HistGradientBoostingClassifier(max_iter=100, random_state=seed)
    if name == "logistic":
        return make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
    if name == "mlp":
        return make_pipeline(
            StandardScaler(),
            MLPClassifier(hidden_layer_sizes=(64, 64), max_iter=500, early_stopping=True, random_state=seed),
        )
    if name == "random_forest":
        return RandomForestClassifier(n_estimators=100, min_samples_leaf=5, random_state=seed)
    raise ValueError(
        f"Expected argument `classifier` to be one of {list(ATTACK_CLASSIFIERS)}, but got {name!r}."
    )


class MembershipInferenceAttack:
    """Membership-inference attack on sorted softmax outputs, scored by F1 of "member".

    Args:
        classifier: ``"gradient_boosting"`` (histogram gradient boosting, the default: fast,
            scale-free, strong on these few features), ``"logistic"``, ``"mlp"`` or
            ``"random_forest"``.
        seed: Seeds the balancing subsamples and the classifier.
        top_k: Number of sorted probabilities used as features; ``None`` uses all classes.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> members = 8.0 * torch.nn.functional.one_hot(torch.randint(10, (200,), generator=g), 10).float()
        >>> nonmembers = torch.randn(200, 10, generator=g) * 0.1
        >>> attack = MembershipInferenceAttack(classifier="logistic").fit(members, nonmembers)
        >>> attack.f1(members, nonmembers)
        1.0
    """

    def __init__(
        self, classifier: str = "gradient_boosting", seed: int = 0, top_k: int | None = None
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"Expected argument `seed` to be a non-negative int, but got {seed!r}.")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"Expected argument `top_k` to be None or a positive int, but got {top_k!r}.")
        self.classifier = classifier
        self.seed = seed
        self.top_k = top_k
        self._model = _make_classifier(classifier, seed)
        self._num_classes: int | None = None

    def fit(
        self, member_logits: Tensor | np.ndarray, nonmember_logits: Tensor | np.ndarray
    ) -> MembershipInferenceAttack:
        """Train the attack on the original model's outputs.

        Args:
            member_logits: Original model's outputs on training data, ``(n_member, num_classes)``.
            nonmember_logits: Original model's outputs on held-out test data, ``(n_non, num_classes)``.

        Returns:
            ``self``, fitted.
        """
        self._num_classes = None
        from sklearn.base import clone

        features, labels = self._balanced(member_logits, nonmember_logits)
        self._model = clone(self._model).fit(features, labels)
        return self

    def predict_proba(self, logits: Tensor | np.ndarray) -> np.ndarray:
        """Probability that each sample was a member of the evaluated model's training data.

        Args:
            logits: Model outputs, ``(n, num_classes)``.

        Returns:
            float64 array of shape ``(n,)``.
        """
        self._check_fitted()
        features = self._features(logits, "logits")
        column = list(self._model.classes_).index(1)
        return np.asarray(self._model.predict_proba(features)[:, column], dtype=np.float64)

    def f1(self, member_logits: Tensor | np.ndarray, nonmember_logits: Tensor | np.ndarray) -> float:
        """F1 of predicting "member" (label 1) on a balanced evaluation set.

        Args:
            member_logits: Evaluated model's outputs on the leaving clients' data.
            nonmember_logits: Evaluated model's outputs on test data not used in :meth:`fit`;
                subsampled (seeded) to the number of members if larger.

        Returns:
            F1 score in ``[0, 1]``; 0 when the attack predicts no member.
        """
        return self._f1(*self._balanced_fitted(member_logits, nonmember_logits))

    def auc(self, member_logits: Tensor | np.ndarray, nonmember_logits: Tensor | np.ndarray) -> float:
        """ROC AUC of the attack's member probability on the same balanced set as :meth:`f1`.

        F1 depends on how often the attack says "member" at its fitted threshold, so two models
        the attack cannot tell apart from test data may still differ in F1; the AUC is 0.5 for
        any attack without power, whatever its threshold.

        Returns:
            AUC in ``[0, 1]``.
        """
        return self._auc(*self._balanced_fitted(member_logits, nonmember_logits))

    def scores(
        self, member_logits: Tensor | np.ndarray, nonmember_logits: Tensor | np.ndarray
    ) -> tuple[float, float]:
        """``(F1, AUC)`` on one balanced set: the subsample and its features are made once."""
        features, labels = self._balanced_fitted(member_logits, nonmember_logits)
        return self._f1(features, labels), self._auc(features, labels)

    # ----------------------------------------------------------------------------------------------

    def _balanced_fitted(self, member_logits: Any, nonmember_logits: Any) -> tuple[np.ndarray, np.ndarray]:
        self._check_fitted()
        return self._balanced(member_logits, nonmember_logits)

    def _f1(self, features: np.ndarray, labels: np.ndarray) -> float:
        from sklearn.metrics import f1_score

        return float(f1_score(labels, self._model.predict(features), pos_label=1, zero_division=0.0))

    def _auc(self, features: np.ndarray, labels: np.ndarray) -> float:
        from sklearn.metrics import roc_auc_score

        column = list(self._model.classes_).index(1)
        return float(roc_auc_score(labels, self._model.predict_proba(features)[:, column]))

    def _check_fitted(self) -> None:
        if self._num_classes is None:
            raise RuntimeError("MembershipInferenceAttack is not fitted: call fit() first.")

    def _features(self, logits: Any, name: str) -> np.ndarray:
        scores = _as_logits(logits, name)
        if self._num_classes is not None and scores.shape[1] != self._num_classes:
            raise ValueError(
                f"Expected argument `{name}` to have {self._num_classes} classes like the fitting data, "
                f"but got {scores.shape[1]}."
            )
        if self.top_k is not None and self.top_k > scores.shape[1]:
            raise ValueError(
                f"Expected `top_k` ({self.top_k}) to be at most the number of classes, but `{name}` has "
                f"{scores.shape[1]}."
            )
        return attack_features(scores, self.top_k)

    def _balanced(self, member_logits: Any, nonmember_logits: Any) -> tuple[np.ndarray, np.ndarray]:
        """Features and labels with as many non-members as members: the larger side is subsampled."""
        members = _as_logits(member_logits, "member_logits")
        nonmembers = _as_logits(nonmember_logits, "nonmember_logits")
        if members.shape[1] != nonmembers.shape[1]:
            raise ValueError(
                "Expected arguments `member_logits` and `nonmember_logits` to have the same number of "
                f"classes, but got {members.shape[1]} and {nonmembers.shape[1]}."
            )
        for scores, name in ((members, "member_logits"), (nonmembers, "nonmember_logits")):
            if scores.shape[0] == 0:
                raise ValueError(f"Expected argument `{name}` to hold at least one sample, but it is empty.")
        if self._num_classes is None:
            self._num_classes = members.shape[1]
        rng = np.random.default_rng(self.seed)
        size = min(members.shape[0], nonmembers.shape[0])
        members = _subsample(members, size, rng)
        nonmembers = _subsample(nonmembers, size, rng)
        features = np.concatenate(
            [self._features(members, "member_logits"), self._features(nonmembers, "nonmember_logits")]
        )
        labels = np.concatenate([np.ones(size, dtype=np.int64), np.zeros(size, dtype=np.int64)])
        return features, labels


def _subsample(scores: Tensor, size: int, rng: np.random.Generator) -> Tensor:
    """Keep ``size`` rows chosen without replacement, in their original order."""
    if scores.shape[0] == size:
        return scores
    keep = np.sort(rng.choice(scores.shape[0], size=size, replace=False))
    return scores[torch.from_numpy(keep)]
