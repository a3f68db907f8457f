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
- Weights: the paper's ``M_e`` (eq. 7) divides by ``|alpha_c|`` of the *client* contribution
  angles, which come from a probe round after training. During training a client's alpha is
  taken from its stage-1 shard's update (SPEC section 5; :func:`eq7_weights`), so from stage 2
  on ``allocateChildShard`` minimises eq. 7 with ``w_c = 1 / max(|alpha_c|, eps_alpha)``. Before
  any alpha exists (stage 1) the weights are uniform (the variance of the predicted costs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "StageCosts",
    "eq7_weights",
    "expected_future_costs",
    "predicted_m_e",
    "refine_by_swaps",
    "tree_client_costs",
]


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


def eq7_weights(
    shard_clients: Sequence[Sequence[int]], shard_alphas: Sequence[float], num_clients: int, eps: float = 1e-6
) -> np.ndarray:
    """Paper eq. 7's weights ``1 / max(|alpha_c|, eps)``, every client's alpha its shard's.

    Args:
        shard_clients: Clients of every shard of one stage (stage 1: SPEC section 5's stand-in for
            the client alphas, which exist only after training).
        shard_alphas: Signed alpha of every such shard.
        num_clients: ``K``; every client must be in exactly one shard.
        eps: ``eps_alpha`` (SPEC section 8), the floor that keeps a zero alpha finite.

    Returns:
        ``w_c`` for every client.
    """
    a = np.full(num_clients, np.nan)
    for clients, alpha in zip(shard_clients, shard_alphas):
        a[np.asarray(list(clients), dtype=np.int64)] = abs(float(alpha))
    if np.isnan(a).any():
        raise ValueError("every client must belong to one shard of the stage")
    return 1.0 / np.maximum(a, eps)


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
        rounds_fn: The round policy of the stage (children's alphas of every group -> rounds of
            every group), when it is known before training (A2, fixed); then the grouping is refined
            with the rounds A2 will really give (:func:`refine_by_swaps`). None: expected rounds only.
        rounds_rule: The same policy as (statistic of one group's alphas, rounds from all groups'
            statistics) where it has that form (:func:`~.round_rules.round_rule`): the swap search
            then updates two statistics per swap instead of asking ``rounds_fn`` for every group.
    """

    shard_clients: list[list[int]]
    client_steps: np.ndarray
    paid: np.ndarray
    rounds: float
    future: np.ndarray
    weights: np.ndarray | None = field(default=None)
    rounds_fn: Callable[[list[list[float]]], list[int]] | None = field(default=None)
    rounds_rule: tuple[Callable[[Sequence[float]], float], Callable[[np.ndarray], np.ndarray]] | None = field(
        default=None
    )

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

    def predicted(self, groups: Sequence[Sequence[int]], rounds: Sequence[float] | None = None) -> np.ndarray:
        """Predicted ``Z_c`` of every client if the children are grouped as ``groups`` (reference).

        Args:
            groups: Children of every new shard.
            rounds: Rounds of every new shard (default: the expected rounds for all).
        """
        s = self.client_steps
        z = self.paid + self.future
        for gi, g in enumerate(groups):
            t = self.rounds if rounds is None else float(rounds[gi])
            idx = np.asarray([c for child in g for c in self.shard_clients[child]], dtype=np.int64)
            if idx.size:
                z[idx] += t * (s[idx].sum() - s[idx])
        return z


class _ExactObjective:
    """Predicted M_e of a complete grouping with each group's real rounds, from per-child sums.

    With ``b_c`` = paid + later cost, a client of group ``g`` costs ``Z_c = b_c + T_g (S_g - s_c)``;
    the M_e sums of a group follow from nine sums over its clients, so a swap costs O(groups).
    """

    def __init__(self, costs: StageCosts, alphas: np.ndarray) -> None:
        s, w = costs.client_steps, costs.weights
        b = costs.paid + costs.future
        self.k, self.w_total, self.alphas = float(len(s)), float(w.sum()), alphas
        self.rounds_fn = costs.rounds_fn
        rows = []
        for clients in costs.shard_clients:
            i = np.asarray(clients, dtype=np.int64)
            bi, si, wi = b[i], s[i], w[i]
            rows.append(
                (i.size, bi.sum(), si.sum(), wi.sum(), (wi * bi).sum(), (wi * si).sum(),
                 (wi * bi * bi).sum(), (wi * si * si).sum(), (wi * bi * si).sum())
            )  # fmt: skip
        self.child = np.asarray(rows, dtype=np.float64)
        self._alphas = [float(a) for a in alphas]

    def rounds(self, groups: list[list[int]]) -> np.ndarray:
        return np.asarray(self.rounds_fn([[self._alphas[i] for i in g] for g in groups]), dtype=np.float64)

    def group_sums(self, group: list[int]) -> np.ndarray:
        """The nine sums of one group (one row of :meth:`value_of`'s ``agg``)."""
        return self.child[group].sum(axis=0)

    def value(self, groups: list[list[int]], rounds: np.ndarray) -> float:
        return self.value_of(np.stack([self.group_sums(g) for g in groups]), rounds)

    def value_of(self, agg: np.ndarray, rounds: np.ndarray) -> float:
        """M_e from the groups' sums ``agg`` [G, 9] (a swap updates two rows, not all of them)."""
        n, sb, ss, sw, swb, sws, swb2, sws2, swbs = agg.T
        t, big_s = rounds, ss
        sz = sb - t * ss + n * t * big_s
        swz = swb - t * sws + t * big_s * sw
        swz2 = (
            swb2
            + t * t * sws2
            + (t * big_s) ** 2 * sw
            - 2 * t * swbs
            + 2 * t * big_s * swb
            - 2 * t * t * big_s * sws
        )
        z_avg = sz.sum() / self.k
        return float((swz2.sum() - 2 * z_avg * swz.sum() + z_avg * z_avg * self.w_total) / self.k)


def refine_by_swaps(
    groups: list[list[int]],
    labels: Sequence[int],
    alphas: Sequence[float],
    costs: StageCosts,
    seed: int,
    max_evals: int = 4000,
) -> list[list[int]]:
    """Swap children of the same cluster between groups while the exact predicted M_e falls.

    A1's greedy scores candidates with the *expected* rounds; A2 (min-max normalised) then gives one
    shard ``T0`` and one ``T1`` in every stage, and that spread dominates the costs. Once the
    groups are complete, the rounds A2 will give are known (``costs.rounds_fn``), so first-improvement
    hill climbing over swaps of same-cluster children (each group keeps its mix of negative, middle
    and positive children, i.e. A1's direction balance) lowers the M_e of the real predicted costs.

    Args:
        groups: A complete grouping (lists of child indices).
        labels: Cluster of every child (swaps stay within a cluster).
        alphas: Alpha of every child (the round policy's input).
        costs: The stage's cost model; needs ``rounds_fn``.
        seed: Seed of the order in which swaps are tried.
        max_evals: Most swaps evaluated (bounds the time at thousands of shards).

    Returns:
        The refined grouping (same group sizes and cluster mix); unchanged without ``rounds_fn``.
    """
    if costs.rounds_fn is None or len(groups) < 2:
        return groups
    obj = _ExactObjective(costs, np.asarray(alphas, dtype=np.float64))
    groups = [list(g) for g in groups]
    where = {i: (gi, pos) for gi, g in enumerate(groups) for pos, i in enumerate(g)}
    # With a rule (the built-in policies) every group's statistic is kept and a swap redoes two;
    # either way the rounds are the same numbers (tests/sharding/test_costs.py).
    stat, combine = costs.rounds_rule or (None, None)
    a = obj._alphas
    stats = np.asarray([stat([a[c] for c in g]) for g in groups], dtype=np.float64) if stat else None

    def rounds_now() -> np.ndarray:
        if stats is None:
            return obj.rounds(groups)
        return np.asarray(combine(stats), dtype=np.float64)

    agg = np.stack([obj.group_sums(g) for g in groups])
    best = obj.value_of(agg, rounds_now())
    rng = np.random.default_rng(seed)
    n = len(where)
    evals = 0
    improved = True
    while improved and evals < max_evals:
        improved = False
        for i in rng.permutation(n).tolist():
            if evals >= max_evals:
                break
            gi, pi = where[i]
            for j in rng.permutation(n).tolist():
                gj, pj = where[j]
                if gj == gi or labels[j] != labels[i]:
                    continue
                evals += 1
                groups[gi][pi], groups[gj][pj] = j, i
                row_i, row_j = agg[gi].copy(), agg[gj].copy()
                agg[gi], agg[gj] = obj.group_sums(groups[gi]), obj.group_sums(groups[gj])
                if stats is not None:
                    stat_i, stat_j = stats[gi], stats[gj]
                    stats[gi] = stat([a[c] for c in groups[gi]])
                    stats[gj] = stat([a[c] for c in groups[gj]])
                value = obj.value_of(agg, rounds_now())
                if value < best * (1 - 1e-12):
                    best, improved = value, True
                    where[i], where[j] = (gj, pj), (gi, pi)
                    break
                groups[gi][pi], groups[gj][pj] = i, j
                agg[gi], agg[gj] = row_i, row_j
                if stats is not None:
                    stats[gi], stats[gj] = stat_i, stat_j
                if evals >= max_evals:
                    break
    return groups
