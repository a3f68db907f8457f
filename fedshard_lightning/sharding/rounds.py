"""Round allocation of FedShard: the A2 algorithm, fixed rounds, and the calibrated ("auto") range.

Paper: FedShard, section 3.3 and Algorithm 3 "A2" (Appendix D.3): shards whose children have a low
variance of contribution angles get more FedAvg rounds, within an empirical range ``[T0*, T1*]``
taken from the rounds that the first two stages needed to converge. SPEC section 5 makes it precise.

Departures from the paper and choices of ours:

- The paper's formula, read literally, maps to ``[T1, inf)`` and divides by zero for the
  lowest-variance shard. We implement its stated intent (SPEC section 5):
  ``nu = (v - v_min) / (v_max - v_min)``, ``T = round(T1 - nu * (T1 - T0))``, and ``T1`` for every
  shard when all variances are equal (stage 1, where every child is a leaf with alpha 0, and the
  final stage, which has one shard).
- ``round`` rounds halves up (``floor(x + 0.5)``), not to even, so that equal distances from the
  ends of the range are treated alike.
- Variance is the population variance (``ddof=0``) of the children's alphas, unweighted, as in the
  paper's ``var``; a shard with a single child has variance 0.
- "Converged" (for the auto range) means: the loss did not improve by more than a relative
  ``tolerance`` for ``patience`` consecutive rounds, capped at ``max_rounds``; see
  :class:`ConvergenceTracker`.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from fedshard_lightning.errors import ConfigError
from fedshard_lightning.limits import MAX_COUNT

__all__ = [
    "A2Rounds",
    "AutoRounds",
    "ConvergenceTracker",
    "FixedRounds",
    "RoundPolicy",
    "StageA2Rounds",
    "a2_rounds",
]


def _check_int(name: str, value: object, minimum: int, fix: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}{fix}")
    if value > MAX_COUNT:
        raise ConfigError(f"{name}={value!r} must be at most {MAX_COUNT}{fix}")
    return value


def _check_range(t0: int, t1: int) -> None:
    _check_int("t0", t0, 1, " (the fewest rounds a shard trains)")
    _check_int("t1", t1, 1, " (the most rounds a shard trains)")
    if t0 > t1:
        raise ConfigError(f"t1={t1} must be >= t0={t0}: set t1 to at least {t0} or lower t0")


def _population_variance(values: Sequence[float]) -> float:
    n = len(values)
    if n == 0:
        raise ValueError("a new shard must have at least one child alpha")
    mean = math.fsum(values) / n
    return math.fsum((v - mean) ** 2 for v in values) / n


@functools.lru_cache(maxsize=1 << 16)
def _variance_of(values: tuple[float, ...]) -> float:
    """:func:`_population_variance`, remembered: A1's swap search asks for the same groups thousands of times."""
    return _population_variance(values)


def a2_rounds(variances: Sequence[float], t0: int, t1: int) -> list[int]:
    """Rounds per shard from the variances of its children's alphas (A2, SPEC section 5).

    The lowest variance gets ``t1`` rounds, the highest ``t0``, linearly in between, rounded half
    up. Monotone: a larger variance never gets more rounds.

    Args:
        variances: Variance ``v_s >= 0`` of every new shard's children's alphas.
        t0: Fewest rounds, at least 1.
        t1: Most rounds, at least ``t0``.

    Returns:
        ``T_s`` in ``[t0, t1]`` for every shard.

    Raises:
        ConfigError: If ``t0`` or ``t1`` is invalid.
        ValueError: If a variance is negative or not finite.
    """
    _check_range(t0, t1)
    v = [float(x) for x in variances]
    if any(not math.isfinite(x) or x < 0 for x in v):
        raise ValueError(f"variances must be finite and non-negative, got {v}")
    if not v:
        return []
    v_min, v_max = min(v), max(v)
    if v_max == v_min:
        return [t1] * len(v)
    rounds = []
    for x in v:
        nu = (x - v_min) / (v_max - v_min)
        rounds.append(min(t1, max(t0, math.floor(t1 - nu * (t1 - t0) + 0.5))))
    return rounds


class RoundPolicy:
    """Decides how many FedAvg rounds ``T_s^p`` every new shard of a stage trains.

    Subclass it and override :meth:`rounds` to plug a new rule into a config via ``class_path``.
    The trainer asks :meth:`calibrating` before a stage: when True it runs the stage with early
    stopping (a :class:`ConvergenceTracker` from :meth:`make_tracker`, the returned rounds being
    caps) and reports the rounds actually trained with :meth:`observe`. The rounds that were trained
    are what FLCache records and unlearning replays.
    """

    def rounds(self, stage: int, children_alphas: Sequence[Sequence[float]]) -> list[int]:
        """Rounds for every new shard of ``stage``.

        Args:
            stage: Stage ``p >= 1`` being built.
            children_alphas: For every new shard, the alphas of its children (shards of ``p - 1``).

        Returns:
            One positive number of rounds per new shard.
        """
        raise NotImplementedError

    def calibrating(self, stage: int) -> bool:
        """Whether ``stage`` trains with early stopping (its rounds are then upper bounds)."""
        return False

    def expected_rounds(self, stage: int, last: bool) -> float:
        """Rounds a shard of ``stage`` is expected to get, before the grouping is known.

        A1's cost model (:mod:`~fedshard_lightning.sharding.costs`) weighs the stages with it.
        The default, 1, weighs every stage alike; override it for a better prediction.

        Args:
            stage: Stage ``p >= 1``.
            last: Whether ``stage`` is the final stage (one shard).
        """
        return 1.0

    def make_tracker(self, num_groups: int) -> ConvergenceTracker:
        """Early-stopping tracker for a calibrating stage with ``num_groups`` shards."""
        raise NotImplementedError(f"{type(self).__name__} does not calibrate")

    def observe(self, stage: int, rounds_used: Sequence[int]) -> None:
        """Learn from the rounds each shard of ``stage`` actually trained (no-op by default)."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state learned during training (for FLCache and resuming); none by default."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class FixedRounds(RoundPolicy):
    """The same number of rounds for every shard (the "fixed rounds" ablations, SPEC section 5).

    Args:
        rounds: Rounds per shard, at least 1.

    Raises:
        ConfigError: If ``rounds`` is not a positive integer.
    """

    def __init__(self, rounds: int = 5) -> None:
        self.rounds_per_shard = _check_int("rounds", rounds, 1, " (FedAvg rounds per shard)")

    def rounds(self, stage: int, children_alphas: Sequence[Sequence[float]]) -> list[int]:
        """``rounds`` for every new shard."""
        return [self.rounds_per_shard] * len(children_alphas)

    def expected_rounds(self, stage: int, last: bool) -> float:
        """``rounds``: known exactly."""
        return float(self.rounds_per_shard)

    def __repr__(self) -> str:
        return f"FixedRounds(rounds={self.rounds_per_shard})"


class A2Rounds(RoundPolicy):
    """FedShard's variance-aware allocation A2 within a fixed range ``[t0, t1]``.

    Args:
        t0: Rounds of the shard whose children's alphas vary most, at least 1.
        t1: Rounds of the shard whose children's alphas vary least, at least ``t0``.

    Raises:
        ConfigError: If ``t0`` or ``t1`` is invalid.
    """

    def __init__(self, t0: int = 2, t1: int = 8) -> None:
        _check_range(t0, t1)
        self.t0, self.t1 = t0, t1

    def rounds(self, stage: int, children_alphas: Sequence[Sequence[float]]) -> list[int]:
        """A2 rounds from the population variance of every shard's children's alphas."""
        return a2_rounds([_variance_of(tuple(c)) for c in children_alphas], self.t0, self.t1)

    def expected_rounds(self, stage: int, last: bool) -> float:
        """``t1`` where all variances are equal (stage 1, the last stage), else the middle of the range."""
        return float(self.t1) if stage == 1 or last else (self.t0 + self.t1) / 2


class AutoRounds(RoundPolicy):
    """A2 with the range ``[T0, T1]`` measured by training the first stages to convergence.

    This is the paper's "empirical training rounds" (Appendix D.3, SPEC section 5 ``rounds: auto``).
    Protocol with the trainer:

    1. For stages ``p <= calibration_stages`` :meth:`calibrating` is True and :meth:`rounds` returns
       ``max_rounds`` for every shard. The trainer trains all shards of the stage with a tracker
       from :meth:`make_tracker`, calling ``tracker.update(losses)`` after every round and stopping
       each shard when its flag turns True (at the latest after ``max_rounds``).
    2. The trainer reports ``tracker.rounds_used`` with :meth:`observe` (and records those rounds,
       not ``max_rounds``, as the stage's ``T_s^p``: unlearning replays them).
    3. From stage ``calibration_stages + 1`` on, :meth:`rounds` is A2 with ``T0``/``T1`` the fewest
       and most rounds observed over all calibration stages. Observations of later stages are
       ignored; asking for a later stage before any observation is an error.

    Args:
        tolerance: Relative loss improvement below which a round counts as no improvement, >= 0.
        patience: Rounds without improvement after which a shard stops, at least 1.
        max_rounds: Cap on the rounds of a calibrating shard, at least 1.
        calibration_stages: Number of first stages trained to convergence, at least 1.

    Raises:
        ConfigError: If an argument is invalid.
    """

    def __init__(
        self,
        tolerance: float = 1e-3,
        patience: int = 2,
        max_rounds: int = 30,
        calibration_stages: int = 2,
    ) -> None:
        _check_tolerance(tolerance)
        self.tolerance = float(tolerance)
        self.patience = _check_int("patience", patience, 1, " (rounds without improvement before stopping)")
        self.max_rounds = _check_int("max_rounds", max_rounds, 1, " (cap on calibration rounds)")
        self.calibration_stages = _check_int(
            "calibration_stages", calibration_stages, 1, " (stages trained to convergence)"
        )
        self._observed: list[int] = []

    @property
    def observed_range(self) -> tuple[int, int] | None:
        """``(T0, T1)`` observed so far, or None before the first observation."""
        return (min(self._observed), max(self._observed)) if self._observed else None

    def calibrating(self, stage: int) -> bool:
        """True for stages ``1..calibration_stages``."""
        return stage <= self.calibration_stages

    def make_tracker(self, num_groups: int) -> ConvergenceTracker:
        """A tracker with this policy's tolerance, patience and cap."""
        return ConvergenceTracker(num_groups, self.tolerance, self.patience, self.max_rounds)

    def rounds(self, stage: int, children_alphas: Sequence[Sequence[float]]) -> list[int]:
        """``max_rounds`` while calibrating, A2 over the observed range afterwards."""
        if self.calibrating(stage):
            return [self.max_rounds] * len(children_alphas)
        observed = self.observed_range
        if observed is None:
            raise RuntimeError(
                f"AutoRounds: stage {stage} needs the rounds observed in stages "
                f"1..{self.calibration_stages}; call observe(stage, tracker.rounds_used) after each of them"
            )
        variances = [_variance_of(tuple(c)) for c in children_alphas]
        return a2_rounds(variances, *observed)

    def expected_rounds(self, stage: int, last: bool) -> float:
        """Mean observed rounds (``T1`` at the last stage) once observed; ``max_rounds / 2`` before."""
        if not self._observed:
            return self.max_rounds / 2
        if last and not self.calibrating(stage):
            return float(max(self._observed))
        return sum(self._observed) / len(self._observed)

    def observe(self, stage: int, rounds_used: Sequence[int]) -> None:
        """Record the rounds the shards of a calibrating ``stage`` trained.

        Raises:
            ValueError: If a count is not an integer in ``[1, max_rounds]``.
        """
        if not self.calibrating(stage):
            return
        used = list(rounds_used)
        for r in used:
            if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 1 <= r <= self.max_rounds:
                raise ValueError(f"rounds_used must be integers in [1, {self.max_rounds}], got {used}")
        self._observed.extend(int(r) for r in used)

    def state_dict(self) -> dict[str, Any]:
        """``{"observed": [...]}``: every round count observed in the calibration stages."""
        return {"observed": list(self._observed)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the observed round counts.

        Raises:
            ValueError: If a count is not an integer in ``[1, max_rounds]``.
        """
        observed = list(state.get("observed", []))
        self._observed = []
        self.observe(1, observed)


def _check_tolerance(tolerance: float) -> None:
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not (math.isfinite(tolerance) and tolerance >= 0)
    ):
        raise ConfigError(f"tolerance={tolerance!r} must be a finite number >= 0 (relative loss improvement)")


class ConvergenceTracker:
    """Per-shard early stopping on the training loss, for the calibrating stages of AutoRounds.

    A shard stops when its loss has not improved on its best by more than ``tolerance`` (relative:
    ``loss < best - tolerance * |best|``) for ``patience`` consecutive rounds, or when it has trained
    ``max_rounds`` rounds. A stopped shard stays stopped; its later losses are ignored (pass NaN).

    Args:
        num_groups: Number of shards trained together.
        tolerance: Relative improvement threshold, >= 0.
        patience: Rounds without improvement before stopping, at least 1.
        max_rounds: Cap on rounds, at least 1.

    Raises:
        ConfigError: If an argument is invalid.
    """

    def __init__(self, num_groups: int, tolerance: float, patience: int, max_rounds: int) -> None:
        self._n = _check_int("num_groups", num_groups, 0)
        _check_tolerance(tolerance)
        self.tolerance = float(tolerance)
        self.patience = _check_int("patience", patience, 1, " (rounds without improvement before stopping)")
        self.max_rounds = _check_int("max_rounds", max_rounds, 1, " (cap on rounds)")
        self._best: list[float | None] = [None] * num_groups
        self._stale = [0] * num_groups
        self._used = [0] * num_groups
        self._stopped = [False] * num_groups

    def update(self, losses: Sequence[float | None]) -> list[bool]:
        """Record one round's loss of every shard; return which shards should stop now.

        Args:
            losses: Loss of every shard after this round (entries of stopped shards, and None for
                a shard this process does not train, are ignored).

        Returns:
            For every shard, True when it has stopped (it trains no further round).

        Raises:
            ValueError: On a wrong number of losses or a non-finite loss of an active shard.
        """
        if len(losses) != self._n:
            raise ValueError(f"expected {self._n} losses, got {len(losses)}")
        for g, loss in enumerate(losses):
            if self._stopped[g] or loss is None:  # None: not trained here (another DDP rank's shard)
                continue
            loss = float(loss)
            if not math.isfinite(loss):
                raise ValueError(f"loss of group {g} is not finite ({loss}) after round {self._used[g] + 1}")
            self._used[g] += 1
            best = self._best[g]
            if best is None or loss < best - self.tolerance * abs(best):
                self._best[g], self._stale[g] = loss, 0
            else:
                self._stale[g] += 1
            if self._stale[g] >= self.patience or self._used[g] >= self.max_rounds:
                self._stopped[g] = True
        return list(self._stopped)

    @property
    def rounds_used(self) -> list[int]:
        """Rounds every shard has trained so far."""
        return list(self._used)

    @property
    def stopped(self) -> list[bool]:
        """Which shards have stopped."""
        return list(self._stopped)

    @property
    def done(self) -> bool:
        """Whether every shard has stopped."""
        return all(self._stopped)


class StageA2Rounds(AutoRounds):
    """Our variant of ``auto``: A2's rule over whole stages, every shard of a stage the same rounds.

    Why: A2's min-max scaling gives one shard of every stage ``T0`` rounds and another ``T1``, and
    per-shard convergence in the calibration stages stops every shard at its own round, so the
    cost of unlearning a client depends on which shards it fell into: that spread is what M_e
    measures. Sharing the rounds within a stage removes it and keeps A2's intent (more rounds
    where the children agree) between stages:

    - calibration stages (``1..calibration_stages``): all shards of the stage train until the mean
      of their losses stops improving (one :class:`ConvergenceTracker` on the mean), so all stop
      at the same round; those counts become ``[T0, T1]``;
    - later stages: every shard gets the mean, rounded half up, of the rounds A2 would give the
      stage's shards over ``[T0, T1]`` (the final stage, one shard: ``T1``).

    Args and errors as :class:`AutoRounds`.
    """

    def make_tracker(self, num_groups: int) -> ConvergenceTracker:
        """One tracker on the mean loss of the stage's shards, its verdict shared by all of them."""
        return _SharedTracker(num_groups, self.tolerance, self.patience, self.max_rounds)

    def rounds(self, stage: int, children_alphas: Sequence[Sequence[float]]) -> list[int]:
        """``max_rounds`` while calibrating; afterwards the stage's mean A2 rounds for every shard."""
        per_shard = super().rounds(stage, children_alphas)
        if self.calibrating(stage) or not per_shard:
            return per_shard
        shared = math.floor(math.fsum(per_shard) / len(per_shard) + 0.5)
        return [shared] * len(per_shard)


class _SharedTracker(ConvergenceTracker):
    """:class:`ConvergenceTracker` of one group, the mean loss of ``num_groups`` shards, for all of them."""

    def __init__(self, num_groups: int, tolerance: float, patience: int, max_rounds: int) -> None:
        super().__init__(1, tolerance, patience, max_rounds)
        self._shards = _check_int("num_groups", num_groups, 0)

    def update(self, losses: Sequence[float | None]) -> list[bool]:
        """Record the mean of the shards' losses; every shard stops when the mean has converged."""
        if len(losses) != self._shards:
            raise ValueError(f"expected {self._shards} losses, got {len(losses)}")
        live = [float(x) for x in losses if math.isfinite(float(x))]
        mean = math.fsum(live) / len(live) if live else float("nan")
        return super().update([mean]) * self._shards

    @property
    def rounds_used(self) -> list[int]:
        """The same rounds for every shard."""
        return super().rounds_used * self._shards

    @property
    def stopped(self) -> list[bool]:
        """The same verdict for every shard."""
        return super().stopped * self._shards
