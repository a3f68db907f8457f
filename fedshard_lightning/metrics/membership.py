"""The membership-inference protocol on a federated datamodule: who fits the attack, who is scored.

SPEC section 10 and the FedShard paper's Appendix G: the attack of
:mod:`fedshard_lightning.metrics.mia` is fitted on the original model's outputs and scored on the
leaving clients' data under the model being evaluated. :class:`MembershipAudit` owns the seeded
splits (test halves, fitting and scored members), so the unlearning replay, tests and experiments
all score membership the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.engine import predict_logits
from fedshard_lightning.metrics.client_alpha import sample_logits
from fedshard_lightning.metrics.mia import MembershipInferenceAttack

__all__ = ["MembershipAudit"]


@dataclass
class _MIASplit:
    fit_members: Tensor
    eval_members: dict[int, Tensor]
    fit_nonmembers: Tensor
    eval_nonmembers: Tensor


class MembershipAudit:
    """The MIA protocol of :mod:`fedshard_lightning.metrics.mia` on a federated datamodule.

    * The test set is split in two disjoint halves (seeded): one gives the attack's fitting
      non-members, the other the evaluation non-members.
    * Fitting members: the training samples of every client that is *not* evaluated (not in
      ``leaving``), scored by the reference (original, non-unlearned) model. If every client is
      evaluated, each client's samples are split in two seeded halves instead: one half fits the
      attack, the other is scored, so the attack is never scored on a sample it was fitted on.
    * Evaluation members: the (scored part of the) leaving clients' samples, under the model being
      evaluated; non-members: the evaluation half of the test set under the same model.

    Args:
        module: The model (its own parameters are not used).
        datamodule: The federated datamodule (set up, on the module's device).
        reference_params: The original model the attack is fitted on.
        leaving: Clients whose membership is evaluated.
        seed: Seeds the splits, the balancing subsamples and the attack classifier.
        classifier: Attack model, see :class:`~fedshard_lightning.metrics.MembershipInferenceAttack`.
    """

    def __init__(
        self,
        module: Any,
        datamodule: Any,
        reference_params: dict[str, Tensor],
        leaving: Sequence[int],
        seed: int = 0,
        classifier: str = "gradient_boosting",
    ) -> None:
        self.module, self.dm = module, datamodule
        self.leaving = sorted(int(c) for c in leaving)
        if not self.leaving:
            raise ValueError("MembershipAudit: name at least one leaving client")
        self.seed = int(seed)
        self.split = self._split()
        self.attack = MembershipInferenceAttack(classifier=classifier, seed=self.seed)
        dtype = next(iter(reference_params.values())).dtype
        self._test_x, _ = datamodule.test_data(dtype)
        self.attack.fit(
            sample_logits(module, reference_params, datamodule, self.split.fit_members),
            self._test_logits(reference_params, self.split.fit_nonmembers),
        )

    def _split(self) -> _MIASplit:
        rng = np.random.default_rng([self.seed, 7_177])
        n_test = len(self.dm.test_y)
        perm = torch.as_tensor(rng.permutation(n_test), dtype=torch.long)
        fit_non, eval_non = perm[: n_test // 2].sort().values, perm[n_test // 2 :].sort().values
        parts = self.dm.client_indices
        others = [parts[c].cpu() for c in range(len(parts)) if c not in set(self.leaving)]
        others = [o for o in others if len(o)]
        if others:
            fit = torch.cat(others)
            scored = {c: parts[c].cpu() for c in self.leaving}
        else:
            fit_parts, scored = [], {}
            for c in self.leaving:
                idx = parts[c].cpu()
                shuffled = idx[torch.as_tensor(rng.permutation(len(idx)), dtype=torch.long)]
                half = len(idx) // 2
                fit_parts.append(shuffled[:half])
                scored[c] = shuffled[half:].sort().values
            fit = torch.cat(fit_parts)
        return _MIASplit(fit.sort().values, scored, fit_non, eval_non)

    def _test_logits(self, params: dict[str, Tensor], idx: Tensor) -> Tensor:
        return predict_logits(self.module, params, self._test_x[idx.to(self._test_x.device)])

    def logits(
        self, params: dict[str, Tensor], clients: Sequence[int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Member logits (the clients' scored samples) and non-member logits (test half) of a model."""
        ids = self.leaving if clients is None else [int(c) for c in clients]
        unknown = sorted(set(ids) - set(self.split.eval_members))
        if unknown:
            raise ValueError(f"MembershipAudit: clients {unknown} are not among the audited {self.leaving}")
        members_idx = torch.cat([self.split.eval_members[c] for c in ids])
        return (
            sample_logits(self.module, params, self.dm, members_idx).cpu(),
            self._test_logits(params, self.split.eval_nonmembers).cpu(),
        )

    def f1(self, params: dict[str, Tensor], clients: Sequence[int] | None = None) -> float:
        """Attack F1 of a model on the clients' data (default: all leaving clients) vs test data."""
        return self.attack.f1(*self.logits(params, clients))

    def pooled_f1(self, pairs: Sequence[tuple[Tensor, Tensor]]) -> float:
        """F1 over the concatenated (members, non-members) logits of several models."""
        return self.attack.f1(*_pooled(pairs))

    def scores(self, params: dict[str, Tensor]) -> tuple[float, float]:
        """``(F1, AUC)`` of the attack on a model, all leaving clients' data vs test data."""
        return self.attack.scores(*self.logits(params))

    def pooled_scores(self, pairs: Sequence[tuple[Tensor, Tensor]]) -> tuple[float, float]:
        """``(F1, AUC)`` over the concatenated logits of several models (one per request)."""
        return self.attack.scores(*_pooled(pairs))


def _pooled(pairs: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Members and non-members of several models' ``(members, non-members)`` logits, concatenated."""
    return torch.cat([m for m, _ in pairs]), torch.cat([n for _, n in pairs])
