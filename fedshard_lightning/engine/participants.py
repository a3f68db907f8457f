"""Who trains in a round: the participant policy an engine is given (SPEC section 3).

The engine asks its policy for the participants of each (stage, group, round). The default is
keyed uniform sampling without replacement (every client when the fraction is 1); a method with
its own sampling, such as FATS, passes another policy with
:meth:`~fedshard_lightning.engine.FederatedEngine.with_participants` instead of patching the
engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from fedshard_lightning.engine.keys import sample_participants

if TYPE_CHECKING:
    from fedshard_lightning.engine.groups import Group

__all__ = ["KeyedSampling", "ParticipantPolicy"]


@runtime_checkable
class ParticipantPolicy(Protocol):
    """``policy(stage, group, round) -> sorted client ids`` taking part; must be deterministic."""

    def __call__(self, stage: int, group: Group, round_: int) -> list[int]:
        """The clients of ``group`` that train in round ``round_`` of ``stage``."""
        ...


@dataclass(frozen=True)
class KeyedSampling:
    """``ceil(fraction * n)`` of a group's clients per round, keyed by (seed, stage, group, round).

    Args:
        fraction: Share of the group's clients sampled, in (0, 1].
        seed: Training seed of the keyed randomness.
    """

    fraction: float = 1.0
    seed: int = 0

    @property
    def everyone(self) -> bool:
        """Every client takes part in every round (a round's cost follows from sizes alone)."""
        return self.fraction >= 1.0

    def __call__(self, stage: int, group: Group, round_: int) -> list[int]:
        """The keyed sample of ``group``'s clients for this round."""
        return sample_participants(group.clients, self.fraction, self.seed, stage, group.key, round_)
