"""Evaluation metrics of federated unlearning: the FedShard fairness metrics and the MIA F1.

Fairness metrics: FedShard paper section 5, equations (6) and (7); membership inference: section
6.3 and SPEC section 10.
"""

from __future__ import annotations

from fedshard_lightning.metrics.client_alpha import (
    PROBE_STAGE,
    client_alphas,
    client_probe_updates,
    per_client_accuracy,
    sample_logits,
)
from fedshard_lightning.metrics.fairness import (
    client_distances,
    efficiency_fairness,
    performance_fairness,
)
from fedshard_lightning.metrics.fairness_metrics import EfficiencyFairness, PerformanceFairness
from fedshard_lightning.metrics.mia import ATTACK_CLASSIFIERS, MembershipInferenceAttack, attack_features

__all__ = [
    "ATTACK_CLASSIFIERS",
    "PROBE_STAGE",
    "EfficiencyFairness",
    "MembershipInferenceAttack",
    "PerformanceFairness",
    "attack_features",
    "client_alphas",
    "client_distances",
    "client_probe_updates",
    "efficiency_fairness",
    "per_client_accuracy",
    "performance_fairness",
    "sample_logits",
]
