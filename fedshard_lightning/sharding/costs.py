"""Predicted per-client unlearning costs of a shard tree, and the M_e that A1 minimises.

Paper: FedShard, Appendix D.2, Algorithm 2 ``allocateChildShard``: among the candidate children,
pick the one whose addition gives the lowest ``M_e`` (paper eq. 7). SPEC section 5 fixes the cost
model: client-steps from the tree, where unlearning client ``c`` alone retrains, in every stage,
its shard without ``c`` for that shard's rounds, i.e. ``T_s * (steps of the other clients of s)``,
summed over the stages (SPEC section 7; every client takes part in every round).

Choices of ours, all because A1 runs *during* training, before the quantities exist:

- Rounds of the stage being built: A2 decides them after the grouping, so A1 uses the policy's
  expected rounds (:meth:`RoundPolicy.expected_rounds`); stages already trained use their real
  rounds.
- Later stages: the expected cost of a client ``c`` in a later stage whose shards hold ``n`` clients
  on average is ``T * (n - 1) * (S - s_c) / (K - 1)`` (the other ``n - 1`` clients drawn from the
  remaining ones); at the last stage (``n = K``) it is exact: ``T * (S - s_c)``. This term carries
  the fact that large clients are cheap to unlearn at the top of the tree, so A1 can offset it
  lower down.
- Weights: paper's ``M_e`` divides by ``|alpha_c|`` of the *client* contribution angles, which
  come from a probe round after training; during training A1 uses uniform weights (the variance of
  the predicted costs) unless the caller passes weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["StageCosts", "expected_future_costs", "predicted_m_e", "tree_client_costs"]


def tree_client_costs(
    stages: Sequence[Sequence[tuple[Sequence[int], int]]], client_steps: Sequence[int]
) -> np.ndarray:
    """Exact client-steps of unlearning each client alone from a (partial) shard tree.

    Args:
        stages: For every trained stage, every shard as ``(clients, rounds)``.
        client_steps: Local steps of one round of every client (``K`` entries).

    Returns:
        ``Z_c`` for every client: ``sum over stages of rounds(s) * (steps(s) - steps(c))`` over the
        shard ``s`` that holds ``c`` in that stage.
    """
    s = np.asarray(client_steps, dtype=np.float64)
    z = np.zeros_like(s)
    for shards in stages:
        for clients, rounds in shards:
            idx = np.asarray(list(clients), dtype=np.int64)
            if idx.size:
                z[idx] += float(rounds) * (s[idx].sum() - s[idx])
    return z


def expected_future_costs(
    client_steps: Sequence[int], shards_per_stage: Sequence[int], rounds_per_stage: Sequence[float]
) -> np.ndarray:
    """Expected client-steps of the stages after the one being built (see the module docstring).

    Args:
        client_steps: Local steps of one round of every client (``K`` entries).
        shards_per_stage: Number of shards of every later stage (the last one is 1).
        rounds_per_stage: Expected rounds of every later stage.

    Returns:
        The expected later cost of every client.
    """
    s = np.asarray(client_steps, dtype=np.float64)
    k = len(s)
    others = s.sum() - s
    total = np.zeros_like(s)
    if k < 2:
        return total
    for n_shards, rounds in zip(shards_per_stage, rounds_per_stage):
        mean_size = k / n_shards
        total += float(rounds) * (mean_size - 1.0) * others / (k - 1)
    return total


def predicted_m_e(costs: np.ndarray, weights: np.ndarray | None = None) -> float:
    """``M_e = mean_c w_c (Z_avg - Z_c)^2`` (paper eq. 7 with ``w_c = 1 / |alpha_c|``).

    Args:
        costs: ``Z_c`` of every client.
        weights: ``w_c`` of every client (default 1: the population variance of the costs).
    """
    z = np.asarray(costs, dtype=np.float64)
    w = np.ones_like(z) if weights is None else np.asarray(weights, dtype=np.float64)
    return float(np.mean(w * (z.mean() - z) ** 2)) if z.size else 0.0


@dataclass
class StageCosts:
    """What A1's cost-aware ``allocateChildShard`` knows when it builds one stage.

    Attributes:
        shard_clients: Clients of every shard of the previous stage (the children to group).
        client_steps: Local steps of one round of every client.
        paid: Exact cost every client has accrued in the stages already trained
            (:func:`tree_client_costs`).
        rounds: Expected rounds of the stage being built.
        future: Expected cost of every client in the later stages (:func:`expected_future_costs`).
        weights: ``w_c`` of the M_e objective (default: 1 for every client).
    """

    shard_clients: list[list[int]]
    client_steps: np.ndarray
    paid: np.ndarray
    rounds: float
    future: np.ndarray
    weights: np.ndarray | None = field(default=None)

    def __post_init__(self) -> None:
        self.client_steps = np.asarray(self.client_steps, dtype=np.float64)
        k = len(self.client_steps)
        self.paid = np.asarray(self.paid, dtype=np.float64)
        self.future = np.asarray(self.future, dtype=np.float64)
        self.weights = np.ones(k) if self.weights is None else np.asarray(self.weights, dtype=np.float64)
        if not (len(self.paid) == len(self.future) == len(self.weights) == k):
            raise ValueError("client_steps, paid, future and weights must have one entry per client")
        if not (np.isfinite(self.rounds) and self.rounds > 0):
            raise ValueError(f"rounds={self.rounds!r} must be a positive number")

    def predicted(self, groups: Sequence[Sequence[int]]) -> np.ndarray:
        """Predicted ``Z_c`` of every client if the children are grouped as ``groups`` (reference)."""
        s = self.client_steps
        z = self.paid + self.future
        for g in groups:
            idx = np.asarray([c for child in g for c in self.shard_clients[child]], dtype=np.int64)
            if idx.size:
                z[idx] += self.rounds * (s[idx].sum() - s[idx])
        return z
