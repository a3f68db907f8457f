"""The calibrated membership-inference protocol of ``compare``: shadow models, before and after.

The attack is :mod:`fedshard_lightning.metrics.mia_calibrated` (offline LiRA, Carlini et al.,
IEEE S&P 2022). This module owns what the federated setting adds:

* **Shadow models**, trained by the fitted algorithm's own engine as plain FedAvg (one group of
  clients, ``rounds`` rounds, from the target's initial model) on random halves of the clients
  that are *not* audited: shadows come in complementary pairs (half ``H`` and the rest), so
  every non-audited client's example is OUT in exactly half of the shadows, and the audited
  clients' examples and the test set are OUT in all of them. Their randomness is keyed by
  :data:`SHADOW_STAGE`, a stage no algorithm trains. The algorithm's state is restored after.
* **Before unlearning**: the fitted model scores the audited clients' examples (members) and
  the evaluation half of the test set (non-members).
* **After unlearning**: for each audited client ``c``, the model after unlearning ``c`` alone
  scores ``c``'s examples and the evaluation half of the test set; those are pooled over ``c``
  (the replay's protocol, :class:`~fedshard_lightning.metrics.membership.MembershipAudit`).
* **Per-label offset.** Under non-IID data the audited clients hold a few labels, and how much
  more confident the target is than the shadows differs between labels (it depends on how many
  samples of the label the rest of the federation holds). That would let the attack "separate"
  the audited clients from the test set by label alone, even for a model that never saw them
  (on digits, K = 64, 4 audited clients, seed 0, the scores without it give AUC 0.33 after
  FedAvg's exact retraining: below chance, by label). So every score is shifted by the mean score of the *fitting* test half's examples of
  the same label under the same model: a member is compared with non-members of its own label.
* **F1** (kept for continuity with the paper's Table 3) needs a threshold: the one maximising
  F1 on the *fitting* set, the non-audited clients' examples (members, scored with their OUT
  shadows only) against the other half of the test set, under the fitted model. It is then
  applied to a balanced (seeded subsample) evaluation set, as the classifier attack does.

AUC and the TPR at 1% FPR need no threshold and use every evaluation example.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.engine import Group, predict_logits, stack_params, unstack_params
from fedshard_lightning.metrics.client_alpha import sample_logits
from fedshard_lightning.metrics.mia_calibrated import (
    best_f1_threshold,
    calibrated_scores,
    f1_at_threshold,
    logit_confidence,
    roc_auc,
    tpr_at_fpr,
)

__all__ = ["SHADOW_STAGE", "CalibratedAudit", "MIAScores", "ShadowSet", "train_shadows"]

SHADOW_STAGE = 2**30 + 11
"""Keyed-randomness stage of the shadow models (the probe round uses ``2**30 + 7``)."""


@dataclass
class ShadowSet:
    """Shadow confidences on every training and test example, and who trained on what."""

    train_phi: np.ndarray  # (N, n_train)
    test_phi: np.ndarray  # (N, n_test)
    train_in: np.ndarray  # (N, n_train) bool: shadow i trained on example j
    sigma: float  # pooled std of the OUT confidences (test examples)
    clients: list[list[int]]  # each shadow's clients


@dataclass
class MIAScores:
    """Scores of one model (or of pooled unlearned models) on members and non-members."""

    members: np.ndarray
    nonmembers: np.ndarray
    f1: float

    @property
    def auc(self) -> float:
        """ROC AUC of "member"."""
        return roc_auc(self.members, self.nonmembers)

    @property
    def tpr_at_1fpr(self) -> float:
        """TPR at 1% FPR."""
        return tpr_at_fpr(self.members, self.nonmembers, 0.01)


def _confidences(module: Any, params: dict[str, Tensor], dm: Any) -> tuple[np.ndarray, np.ndarray]:
    dtype = next(iter(params.values())).dtype
    train = logit_confidence(sample_logits(module, params, dm).cpu(), dm.train_y.cpu())
    test_x, test_y = dm.test_data(dtype)
    test = logit_confidence(predict_logits(module, params, test_x).cpu(), test_y.cpu())
    return train, test


def train_shadows(
    algorithm: Any,
    module: Any,
    datamodule: Any,
    audited: Sequence[int],
    num_shadows: int,
    rounds: int,
    seed: int = 0,
) -> ShadowSet:
    """Train ``num_shadows`` FedAvg shadows (complementary pairs of random halves of the others).

    Args:
        algorithm: A fitted algorithm (its engine, schedule and ``theta0`` are used; its state is
            the same after).
        module: The model.
        datamodule: The federated datamodule, set up.
        audited: Clients whose membership is audited: no shadow trains on them.
        num_shadows: An even number >= 2.
        rounds: FedAvg rounds of every shadow.
        seed: Seeds the halves.
    """
    if num_shadows < 2 or num_shadows % 2:
        raise ValueError(f"num_shadows={num_shadows!r}: must be an even number >= 2 (complementary pairs)")
    audited_set = {int(c) for c in audited}
    others = [c for c in range(len(datamodule.client_indices)) if c not in audited_set]
    others = [c for c in others if len(datamodule.client_indices[c])]
    if len(others) < 2:
        raise ValueError("train_shadows: needs at least two non-audited clients with data")
    rng = np.random.default_rng([seed, 7_211])
    n_train = len(datamodule.train_y)
    saved = algorithm.state_dict()
    train_phi, test_phi, train_in, groups_clients = [], [], [], []
    try:
        for pair in range(num_shadows // 2):
            perm = [others[i] for i in rng.permutation(len(others))]
            halves = [tuple(sorted(perm[: len(perm) // 2])), tuple(sorted(perm[len(perm) // 2 :]))]
            groups = [Group(2 * pair + j, halves[j], int(rounds)) for j in range(2)]
            res = algorithm.train(
                stack_params([algorithm.theta0, algorithm.theta0]), groups, SHADOW_STAGE, report=False
            )
            for j in range(2):
                params = unstack_params(res.params, j)
                tr, te = _confidences(module, params, datamodule)
                train_phi.append(tr)
                test_phi.append(te)
                mask = np.zeros(n_train, dtype=bool)
                idx = torch.cat([datamodule.client_indices[c].cpu() for c in halves[j]]).numpy()
                mask[idx] = True
                train_in.append(mask)
                groups_clients.append(list(halves[j]))
    finally:
        algorithm.load_state_dict(saved)
    test_arr = np.stack(test_phi)
    _, sigma = calibrated_scores(test_arr[0], test_arr)
    return ShadowSet(np.stack(train_phi), test_arr, np.stack(train_in), sigma, groups_clients)


class CalibratedAudit:
    """Calibrated MIA of the models of one run: before (fitted) and after unlearning each client.

    Args:
        module: The model.
        datamodule: The federated datamodule, set up.
        shadows: From :func:`train_shadows` with the same ``audited`` clients.
        audited: The clients whose membership is scored.
        seed: Seeds the test halves and the F1's balancing subsample.
    """

    def __init__(
        self, module: Any, datamodule: Any, shadows: ShadowSet, audited: Sequence[int], seed: int = 0
    ):
        self.module, self.dm, self.shadows = module, datamodule, shadows
        self.audited = sorted(int(c) for c in audited)
        self.seed = int(seed)
        n_test = len(datamodule.test_y)
        perm = np.random.default_rng([self.seed, 7_177]).permutation(n_test)
        self.fit_test, self.eval_test = np.sort(perm[: n_test // 2]), np.sort(perm[n_test // 2 :])
        self.member_idx = {c: datamodule.client_indices[c].cpu().numpy() for c in self.audited}
        self._train_y = datamodule.train_y.cpu().numpy()
        self._test_y = datamodule.test_y.cpu().numpy()
        self._num_labels = int(max(self._train_y.max(), self._test_y.max())) + 1
        # every audited example and every test example is OUT in every shadow
        for c, idx in self.member_idx.items():
            if shadows.train_in[:, idx].any():
                raise ValueError(f"CalibratedAudit: a shadow model trained on audited client {c}")
        self.threshold: float | None = None

    def _scores(self, params: dict[str, Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """Calibrated scores of every training example (NaN where no OUT shadow) and test example."""
        tr, te = _confidences(self.module, params, self.dm)
        sh = self.shadows
        has_out = (~sh.train_in).any(axis=0)
        train_scores = np.full(tr.shape, np.nan)
        train_scores[has_out], _ = calibrated_scores(
            tr[has_out], sh.train_phi[:, has_out], ~sh.train_in[:, has_out], sh.sigma
        )
        test_scores, _ = calibrated_scores(te, sh.test_phi, None, sh.sigma)
        offset = self._label_offsets(test_scores)
        return train_scores - offset[self._train_y], test_scores - offset[self._test_y]

    def _label_offsets(self, test_scores: np.ndarray) -> np.ndarray:
        """Mean score of the fitting test half per label (the overall mean for an absent label)."""
        fit_y, fit_s = self._test_y[self.fit_test], test_scores[self.fit_test]
        offset = np.full(self._num_labels, float(fit_s.mean()))
        for y in np.unique(fit_y):
            offset[y] = float(fit_s[fit_y == y].mean())
        return offset

    def _f1(self, members: np.ndarray, nonmembers: np.ndarray) -> float:
        rng = np.random.default_rng(self.seed)
        size = min(len(members), len(nonmembers))
        m = (
            members
            if len(members) == size
            else members[np.sort(rng.choice(len(members), size, replace=False))]
        )
        n = (
            nonmembers
            if len(nonmembers) == size
            else nonmembers[np.sort(rng.choice(len(nonmembers), size, replace=False))]
        )
        return f1_at_threshold(m, n, self.threshold)

    def before(self, params: dict[str, Tensor]) -> MIAScores:
        """The fitted model: audited clients' examples against the evaluation test half.

        Also fixes the F1 threshold from the fitting set (non-audited clients' examples with an
        OUT shadow against the fitting test half) under this model.
        """
        train_scores, test_scores = self._scores(params)
        audited = np.zeros(len(train_scores), dtype=bool)
        for idx in self.member_idx.values():
            audited[idx] = True
        fit_members = train_scores[~audited & np.isfinite(train_scores)]
        self.threshold = best_f1_threshold(fit_members, test_scores[self.fit_test])
        members = np.concatenate([train_scores[self.member_idx[c]] for c in self.audited])
        nonmembers = test_scores[self.eval_test]
        return MIAScores(members, nonmembers, self._f1(members, nonmembers))

    def after(self, params_by_client: dict[int, dict[str, Tensor]]) -> MIAScores:
        """Pooled over clients ``c``: the model without ``c`` on ``c``'s examples and the test half."""
        if self.threshold is None:
            raise RuntimeError("CalibratedAudit.after: call before() first (it fixes the F1 threshold)")
        members, nonmembers = [], []
        for c in self.audited:
            train_scores, test_scores = self._scores(params_by_client[c])
            members.append(train_scores[self.member_idx[c]])
            nonmembers.append(test_scores[self.eval_test])
        m, n = np.concatenate(members), np.concatenate(nonmembers)
        return MIAScores(m, n, self._f1(m, n))
