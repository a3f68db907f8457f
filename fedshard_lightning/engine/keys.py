"""Keyed randomness: every random draw of training is a function of where it happens.

SPEC section 3: the shuffling of client c in round r of stage p, and the client sampling of a group
in a round, come from generators seeded by ``(seed, stage, group key, round, client)``. A client's
computation therefore never depends on which other clients train beside it, which is what makes
vectorized training equal to a per-client loop and unlearning exactly checkable.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["SAMPLING", "keyed_rng", "sample_participants"]

SAMPLING = -1
"""Client slot used for the per-round participant sampling of a group."""


def keyed_rng(seed: int, stage: int, group: int, round_: int, client: int) -> np.random.Generator:
    """A numpy generator seeded by the key (SeedSequence hashes the tuple)."""
    return np.random.default_rng(
        [int(seed) & 0xFFFFFFFF, int(stage), int(group), int(round_), int(client) + 1]
    )


def sample_participants(
    clients: Sequence[int], fraction: float, seed: int, stage: int, group: int, round_: int
) -> list[int]:
    """Sorted sample of ``ceil(fraction * n)`` (at least one) clients, without replacement."""
    clients = sorted(int(c) for c in clients)
    if fraction >= 1.0 or len(clients) <= 1:
        return clients
    k = max(1, int(np.ceil(fraction * len(clients) - 1e-9)))
    rng = keyed_rng(seed, stage, group, round_, SAMPLING)
    picked = rng.choice(len(clients), size=k, replace=False)
    return sorted(clients[i] for i in picked)
