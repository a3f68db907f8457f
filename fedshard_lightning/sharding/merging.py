"""Shard merging of FedShard: the A1 algorithm and the random grouping of naive sharding.

Paper: FedShard, section 3.2 and Algorithm 2 "Shard Merging Algorithm A1" (Appendix D.2): cluster
the shards of stage ``p - 1`` by their contribution angle into three clusters, give every new
shard first "average" children, then alternate large negative and large positive ones so that
each new shard starts from a direction close to the global one. SPEC section 5 makes it precise.

Departures from the paper and choices of ours (SPEC section 5 decides the first three):

- All alphas equal (stage 1, where every leaf has alpha 0): a seeded random grouping, the paper's
  "randomly picking up clients".
- Three clusters by scikit-learn's ``KMeans(n_clusters=3, random_state=seed, n_init=n_init)`` on
  the 1-D alphas, run single-threaded (faster on such small data, and the labels cannot depend on
  the machine's core count); clusters are ordered by centroid: negative, middle, positive.
- Fewer than three distinct alphas: no KMeans (it would find fewer than three clusters); the
  shards, sorted by ``(alpha, index)``, are cut into three consecutive parts of near-equal size
  (the first parts take the extra one, as ``numpy.array_split`` does).
- Group capacities: ``R`` for every group except the last, which takes ``n - R * (N - 1)``.
- ``allocateChildShard`` (``allocation="cost"``, the default, paper Algorithm 2 as SPEC section 5
  states it): the candidate whose addition gives the lowest ``M_e`` (paper eq. 7, with its
  ``1 / |alpha_c|`` weights) of the predicted per-client unlearning costs
  (:mod:`~fedshard_lightning.sharding.costs`: client-steps from the tree, the expected rounds of
  this stage and the expected cost of the later stages). Half-filled groups and unplaced shards
  are projected: each free slot is counted at the mean step sum of the shards not yet placed, and
  an unplaced shard is counted in an average group. Every candidate is scored in O(1) from running
  sums (no per-client pass), so it scales to thousands of shards. Ties (equal predicted M_e to
  1e-9 relative): smallest ``|alpha|``, then a seeded random order.
- Our variants, each a named option off by default (measured in the ablation, docs/fairness.md):
  ``random_start=False`` fills stage 1 (all alphas equal) by the same cost rule instead of the
  paper's random grouping (we know every client's steps, the paper's "randomly picking" does not);
  ``refine=True`` refines the greedy grouping by swaps of same-cluster children under the rounds
  the round policy will give (:func:`~fedshard_lightning.sharding.costs.refine_by_swaps`), when
  it can say them before training (A2 with a fixed range, fixed rounds); ``weighting="uniform"``
  drops eq. 7's ``1 / |alpha_c|`` weights (the variance of the predicted costs), which a client
  with a near-zero alpha can otherwise dominate. ``FedShard(merge="a1_cost")`` switches all three.
  ``shared_rounds=True`` (with ``refine``) also refines the stages whose rounds are not known before
  training (the calibration stages of ``auto`` and ``stage_a2``): every shard is given the stage's
  expected rounds, which is the exact shape of the costs when all shards of a stage train the same
  rounds (``rounds: stage_a2``), since M_e's minimiser does not change when all rounds scale alike.
  ``FedShard(merge="a1_path")`` is ``a1_cost`` with it: it balances every client's whole
  root-to-leaf path cost in every stage (docs/fairness.md derives why that can beat FedAvg's M_e).
- ``allocation="count"`` (the first implementation, kept for the ablation, and used whenever no
  :class:`StageCosts` is given): the shard whose addition keeps the groups' client counts most
  even, measured by the variance, over all groups, of the *projected* client counts: a group's
  count so far plus its free slots times the mean client count of the shards not yet placed.
  Ties: smallest ``|alpha|``, then smallest index. It ignores that client sizes differ by 30x
  under Dirichlet skew.
- The mean alpha of a group is the unweighted mean over its children; an empty group has mean 0,
  so it first takes a negative shard.
- Output order (canonical, independent of the filling order): each group sorted ascending, groups
  sorted by their smallest index. The remainder group can therefore sit anywhere in the list.

Balance guarantee: every group gets exactly its capacity of children, so full groups' client counts
differ by at most ``R * (c_max - c_min)`` and are equal whenever all shards hold the same number of
clients (which is the case for all but a few shards of a stage). Beyond that no per-input bound can
hold, because the cluster rules dictate which cluster each child comes from; on random inputs
(tested) the mean spread ``max - min`` of full groups' client counts is below that of a random
grouping, and so is the mean over groups of ``|mean alpha|`` (SPEC section 5 property).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from fedshard_lightning.errors import ConfigError
from fedshard_lightning.sharding.cost_filler import CostFiller, CostPool
from fedshard_lightning.sharding.costs import StageCosts, refine_by_swaps
from fedshard_lightning.sharding.count_filler import CountFiller, CountPool

__all__ = [
    "A1Merge",
    "MergePolicy",
    "RandomMerge",
    "a1_grouping",
    "group_capacities",
    "random_grouping",
    "with_shared_rounds",
]


class MergePolicy:
    """Decides which shards of stage ``p - 1`` merge into each shard of stage ``p``.

    Subclass it and override :meth:`group` to plug a new merging rule into a config via
    ``class_path``; the trainer calls it once per stage and freezes the result in the shard tree.
    A policy that sets ``needs_costs = True`` also receives the stage's predicted unlearning costs
    as ``group(..., costs=StageCosts)``.
    """

    needs_costs: bool = False

    def group(
        self,
        alphas: Sequence[float],
        client_counts: Sequence[int],
        merge_rate: int,
        seed: int,
        costs: StageCosts | None = None,
    ) -> list[list[int]]:
        """Group ``n`` shards into ``ceil(n / merge_rate)`` new shards.

        Args:
            alphas: Signed contribution angle of every shard of the previous stage.
            client_counts: Number of clients of every shard of the previous stage.
            merge_rate: Merging rate ``R >= 2``.
            seed: Non-negative seed of every random choice (derive it from the run seed and stage).
            costs: Predicted unlearning costs of the stage (only for ``needs_costs`` policies).

        Returns:
            Groups of shard indices: a partition of ``range(n)`` into ``ceil(n / R)`` groups whose
            sizes are the capacities of :func:`group_capacities`; each group sorted ascending, groups
            sorted by their smallest index.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class RandomMerge(MergePolicy):
    """Seeded random grouping: the merging of the "naive sharding" ablation (SPEC section 5)."""

    def group(
        self,
        alphas: Sequence[float],
        client_counts: Sequence[int],
        merge_rate: int,
        seed: int,
        costs: StageCosts | None = None,
    ) -> list[list[int]]:
        """Group the shards at random; ``alphas`` and ``client_counts`` only give their number."""
        _check_inputs(alphas, client_counts, merge_rate, seed)
        return random_grouping(len(alphas), merge_rate, seed)


class A1Merge(MergePolicy):
    """FedShard's cluster-based merging A1 (paper Algorithm 2, SPEC section 5).

    Args:
        n_init: Number of KMeans initializations (scikit-learn's ``n_init``), at least 1.
        allocation: ``cost`` (the paper's ``allocateChildShard``: lowest predicted M_e of the
            unlearning costs) or ``count`` (balance client counts; the ablation of the first
            implementation).
        random_start: Group stage 1 (all alphas equal) at random, as SPEC section 5 step 1 says
            (default); False fills it by the predicted costs (our variant).
        refine: Refine the greedy groups by swaps of same-cluster children under the known rounds
            (our variant); False (default) keeps SPEC section 5's steps 4-6 alone.
        weighting: ``alpha`` (default): the M_e of ``allocateChildShard`` weighs every client by
            ``1 / max(|alpha_c|, eps)`` (paper eq. 7, the weights the costs carry); ``uniform``:
            every client alike (our variant).
        shared_rounds: With ``refine``: where the round policy cannot say the rounds before training
            (calibration), refine under the stage's expected rounds for every shard (our variant,
            exact in shape for stage-shared rounds); False (default) skips those stages.

    Raises:
        ConfigError: If ``n_init`` is not a positive integer, or ``allocation`` or ``weighting``
            is unknown.
    """

    needs_costs = True

    def __init__(
        self,
        n_init: int = 10,
        allocation: Literal["cost", "count"] = "cost",
        random_start: bool = True,
        refine: bool = False,
        weighting: Literal["alpha", "uniform"] = "alpha",
        shared_rounds: bool = False,
    ) -> None:
        if isinstance(n_init, bool) or not isinstance(n_init, int) or n_init < 1:
            raise ConfigError(f"n_init={n_init!r} must be an integer >= 1 (KMeans initializations)")
        _check_allocation(allocation)
        if weighting not in ("alpha", "uniform"):
            raise ConfigError(
                f"weighting={weighting!r}: choose alpha (paper eq. 7, 1/|alpha_c|) or uniform (our variant)"
            )
        self.n_init = n_init
        self.allocation = allocation
        self.random_start, self.refine = bool(random_start), bool(refine)
        self.weighting = weighting
        self.shared_rounds = bool(shared_rounds)

    def __repr__(self) -> str:
        """The arguments, the variants only where set (the paper's defaults keep the repr short)."""
        extra = "".join(
            f", {k}={v!r}"
            for k, v, d in (
                ("random_start", self.random_start, True),
                ("refine", self.refine, False),
                ("weighting", self.weighting, "alpha"),
                ("shared_rounds", self.shared_rounds, False),
            )
            if v != d
        )
        return f"A1Merge(n_init={self.n_init!r}, allocation={self.allocation!r}{extra})"

    def group(
        self,
        alphas: Sequence[float],
        client_counts: Sequence[int],
        merge_rate: int,
        seed: int,
        costs: StageCosts | None = None,
    ) -> list[list[int]]:
        """Group the shards by A1; see :func:`a1_grouping`."""
        if costs is not None and self.weighting == "uniform":
            costs = dataclasses.replace(costs, weights=None)
        if costs is not None and self.refine and self.shared_rounds and costs.rounds_fn is None:
            costs = with_shared_rounds(costs)
        return a1_grouping(
            alphas,
            client_counts,
            merge_rate,
            seed,
            n_init=self.n_init,
            costs=costs if self.allocation == "cost" else None,
            random_start=self.random_start,
            refine=self.refine,
        )


def with_shared_rounds(costs: StageCosts) -> StageCosts:
    """``costs`` whose round policy gives every new shard the stage's expected rounds ``costs.rounds``.

    What :func:`~fedshard_lightning.sharding.costs.refine_by_swaps` needs to refine a stage whose
    rounds are decided during training (calibration), when every shard of the stage will train the
    same rounds: a common factor on all rounds scales M_e without moving its minimiser.
    """
    t = float(costs.rounds)
    return dataclasses.replace(
        costs,
        rounds_fn=lambda children_alphas: [t] * len(children_alphas),
        rounds_rule=(_zero_statistic, lambda stats: np.full(len(stats), t)),
    )


def _zero_statistic(alphas: Sequence[float]) -> float:
    return 0.0


def group_capacities(num_items: int, merge_rate: int) -> list[int]:
    """Capacities of the ``ceil(n / R)`` groups: ``R`` each, the last one takes the remainder.

    Raises:
        ConfigError: If ``merge_rate`` is not an integer >= 2.
    """
    _check_rate(merge_rate)
    if num_items <= 0:
        return []
    n_groups = -(-num_items // merge_rate)
    return [merge_rate] * (n_groups - 1) + [num_items - merge_rate * (n_groups - 1)]


def random_grouping(num_items: int, merge_rate: int, seed: int) -> list[list[int]]:
    """Seeded random grouping: a ``numpy.random.default_rng(seed)`` permutation cut by capacities.

    Args:
        num_items: Number of shards ``n`` to group.
        merge_rate: Merging rate ``R >= 2``.
        seed: Non-negative seed.

    Returns:
        The groups in canonical order (see :meth:`MergePolicy.group`).
    """
    _check_rate(merge_rate)
    _check_seed(seed)
    perm = np.random.default_rng(seed).permutation(num_items).tolist()
    groups, start = [], 0
    for cap in group_capacities(num_items, merge_rate):
        groups.append(perm[start : start + cap])
        start += cap
    return _canonical(groups)


def a1_grouping(
    alphas: Sequence[float],
    client_counts: Sequence[int],
    merge_rate: int,
    seed: int,
    n_init: int = 10,
    costs: StageCosts | None = None,
    random_start: bool = True,
    refine: bool = False,
) -> list[list[int]]:
    """FedShard's A1 grouping, SPEC section 5 steps 1-6 (see the module docstring for the rules).

    Args:
        alphas: Signed contribution angle of every shard of the previous stage.
        client_counts: Number of clients (>= 1) of every shard of the previous stage.
        merge_rate: Merging rate ``R >= 2``.
        seed: Non-negative seed of the random grouping (all alphas equal), of KMeans and of the
            tie-break order.
        n_init: Number of KMeans initializations.
        costs: Predicted unlearning costs: ``allocateChildShard`` minimises their M_e. None: it
            balances client counts instead.
        random_start: All alphas equal (stage 1): a random grouping even with ``costs`` (the
            paper); False fills stage 1 by the costs (our variant).
        refine: With ``costs`` that know the rounds, refine the groups by swaps (our variant).

    Returns:
        The groups in canonical order (see :meth:`MergePolicy.group`).

    Raises:
        ConfigError: If ``merge_rate`` or ``n_init`` is invalid.
        ValueError: If the inputs have different lengths, non-finite alphas or counts below 1.
    """
    a, counts = _check_inputs(alphas, client_counts, merge_rate, seed)
    if isinstance(n_init, bool) or not isinstance(n_init, int) or n_init < 1:
        raise ConfigError(f"n_init={n_init!r} must be an integer >= 1 (KMeans initializations)")
    n = len(a)
    if n == 0:
        return []
    if costs is not None and len(costs.shard_clients) != n:
        raise ValueError(f"costs describe {len(costs.shard_clients)} shards, got {n} alphas")
    caps = group_capacities(n, merge_rate)
    if np.all(a == a[0]):
        if costs is None or random_start:
            return random_grouping(n, merge_rate, seed)
        negative, middle, positive = [], list(range(n)), []
    else:
        negative, middle, positive = _three_clusters(a, seed, n_init)

    if costs is not None:
        filler: CountFiller | CostFiller = CostFiller(caps, a, costs, seed)
        pools: list[Any] = [CostPool(cluster) for cluster in (negative, middle, positive)]
    else:
        filler = CountFiller(caps, a, counts)
        pools = [CountPool(cluster, a, counts) for cluster in (negative, middle, positive)]
    negative_pool, middle_pool, positive_pool = pools
    while middle_pool:  # step 4
        filler.place(middle_pool)
    while negative_pool and positive_pool:  # step 5
        filler.place(negative_pool if filler.next_mean_alpha() >= 0 else positive_pool)
    for leftover in (negative_pool, positive_pool):  # step 6
        while leftover:
            filler.place(leftover)
    groups = filler.groups
    if refine and costs is not None and costs.rounds_fn is not None:
        labels = [0] * n
        for label, cluster in enumerate((negative, middle, positive)):
            for i in cluster:
                labels[i] = label
        groups = refine_by_swaps(groups, labels, a, costs, seed)
    return _canonical(groups)


@functools.cache
def _threadpool_controller() -> Any:
    # Scanning the loaded native libraries costs ~10 ms; do it once per process.
    from threadpoolctl import ThreadpoolController  # a scikit-learn dependency

    return ThreadpoolController()


def _three_clusters(a: np.ndarray, seed: int, n_init: int) -> tuple[list[int], list[int], list[int]]:
    """Negative, middle and positive clusters of the 1-D alphas (index lists, ascending)."""
    n = len(a)
    if len(np.unique(a)) >= 3:
        from sklearn.cluster import KMeans  # heavy; only needed from stage 2 on
        from sklearn.exceptions import ConvergenceWarning

        random_state = seed if seed < 2**32 else int(np.random.SeedSequence(seed).generate_state(1)[0])
        # One thread: on a few thousand 1-D points threading costs far more than it saves (75x
        # slower measured on 2 cores beside torch), and the labels cannot depend on the core count.
        # Near-duplicate alphas may leave a cluster empty (handled below): no warning needed.
        with _threadpool_controller().limit(limits=1), warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            km = KMeans(n_clusters=3, random_state=random_state, n_init=n_init).fit(a.reshape(-1, 1))
        labels = km.labels_
        order = np.argsort(km.cluster_centers_.ravel(), kind="stable")
        clusters = [[i for i in range(n) if labels[i] == label] for label in order]
        if all(clusters):
            return clusters[0], clusters[1], clusters[2]
    ranked = np.lexsort((np.arange(n), a))
    parts = [sorted(p.tolist()) for p in np.array_split(ranked, 3)]
    return parts[0], parts[1], parts[2]


def _canonical(groups: list[list[int]]) -> list[list[int]]:
    return sorted((sorted(int(i) for i in g) for g in groups), key=lambda g: g[0])


def _check_allocation(allocation: str) -> None:
    if allocation not in ("cost", "count"):
        raise ConfigError(
            f"allocation={allocation!r}: choose cost (lowest predicted M_e, the paper) or count (balance client counts)"
        )


def _check_rate(merge_rate: int) -> None:
    if isinstance(merge_rate, bool) or not isinstance(merge_rate, int) or merge_rate < 2:
        raise ConfigError(f"merge_rate={merge_rate!r} must be an integer >= 2")


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer")


def _check_inputs(
    alphas: Sequence[float], client_counts: Sequence[int], merge_rate: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    _check_rate(merge_rate)
    _check_seed(seed)
    a = np.asarray(alphas, dtype=np.float64).reshape(-1)
    counts = np.asarray(client_counts)
    if counts.ndim != 1 or len(counts) != len(a):
        raise ValueError(f"got {len(a)} alphas but {counts.size} client counts; they must match")
    if not np.isfinite(a).all():
        raise ValueError("alphas must be finite")
    if len(counts) and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 1):
        raise ValueError("client_counts must be integers >= 1")
    return a, counts.astype(np.float64)
