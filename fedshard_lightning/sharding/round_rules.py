"""The built-in round policies as a per-shard statistic plus a rule on all shards' statistics.

A1's swap search (:func:`~fedshard_lightning.sharding.costs.refine_by_swaps`) asks the stage's
round policy for the rounds of every shard after every tried swap, thousands of times a stage.
A2 needs only one number per shard, the variance of its children's alphas, then a min-max rule
over those numbers; a swap changes two shards. :func:`round_rule` gives the search that form for
the built-in policies, so a swap recomputes two variances and one vectorised rule instead of
calling :meth:`~.rounds.RoundPolicy.rounds` on every shard: the same numbers (tested against
``rounds``) for a fraction of the search's time. A subclass, or any other policy, gets None and
is called as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fedshard_lightning.sharding.rounds import A2Rounds, AutoRounds, FixedRounds, RoundPolicy, _variance_of

__all__ = ["RoundRule", "a2_rounds_array", "round_rule"]

RoundRule = tuple[Callable[[Sequence[float]], float], Callable[[np.ndarray], np.ndarray]]
"""(statistic of one shard's children's alphas, rounds [G] as float64 from the statistics [G])."""


def a2_rounds_array(variances: np.ndarray, t0: int, t1: int) -> np.ndarray:
    """:func:`~.rounds.a2_rounds` of valid variances, element-wise the same arithmetic, as float64."""
    v_min, v_max = variances.min(), variances.max()
    if v_max == v_min:
        return np.full(len(variances), float(t1))
    nu = (variances - v_min) / (v_max - v_min)
    return np.clip(np.floor(t1 - nu * (t1 - t0) + 0.5), t0, t1)


def _variance(alphas: Sequence[float]) -> float:
    return _variance_of(tuple(alphas))


def round_rule(policy: RoundPolicy, stage: int) -> RoundRule | None:
    """``policy``'s rounds at ``stage`` in statistic form, for the built-in policies; else None."""
    kind = type(policy)
    if kind is A2Rounds:
        t0, t1 = policy.t0, policy.t1
        return _variance, lambda v: a2_rounds_array(v, t0, t1)
    if kind is AutoRounds and not policy.calibrating(stage) and policy.observed_range is not None:
        t0, t1 = policy.observed_range
        return _variance, lambda v: a2_rounds_array(v, t0, t1)
    if kind is FixedRounds:
        rounds = float(policy.rounds_per_shard)
        return (lambda alphas: 0.0), lambda v: np.full(len(v), rounds)
    return None
