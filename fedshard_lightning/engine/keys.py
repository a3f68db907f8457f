"""Keyed randomness: every random draw of training is a function of where it happens.

SPEC section 3: the shuffling of client c in round r of stage p, and the client sampling of a group
in a round, come from generators seeded by ``(seed, stage, group key, round, client)``. A client's
computation therefore never depends on which other clients train beside it, which is what makes
vectorized training equal to a per-client loop and unlearning exactly checkable.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "SAMPLING",
    "client_keys",
    "counter_bits",
    "keyed_rng",
    "keyed_uniform_bits",
    "mix64",
    "sample_participants",
]

SAMPLING = -1
"""Client slot used for the per-round participant sampling of a group."""


def keyed_rng(seed: int, stage: int, group: int, round_: int, client: int) -> np.random.Generator:
    """A numpy generator seeded by the key (SeedSequence hashes the tuple)."""
    return np.random.default_rng(
        [int(seed) & 0xFFFFFFFF, int(stage), int(group), int(round_), int(client) + 1]
    )


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 arrays: a bijective hash with full avalanche."""
    z = np.asarray(z, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _u64(v: int | np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=np.int64).astype(np.uint64)


def keyed_uniform_bits(
    seed: int, stage: int, groups: np.ndarray, round_: int, clients: np.ndarray, counters: np.ndarray
) -> np.ndarray:
    """64 random bits per draw, a hash of ``(seed, stage, group, round, client, counter)``.

    The counter-based form of :func:`keyed_rng` for many clients at once (one vectorized hash
    instead of one generator per client): ``groups``, ``clients`` and ``counters`` broadcast.
    """
    return counter_bits(client_keys(seed, stage, groups, round_, clients), counters)


def client_keys(seed: int, stage: int, groups: np.ndarray, round_: int, clients: np.ndarray) -> np.ndarray:
    """The hash of ``(seed, stage, group, round, client)``: once per client, not once per draw."""
    with np.errstate(over="ignore"):
        k = mix64(_u64(int(seed) & 0xFFFFFFFF))
        k = mix64(k ^ _u64(stage))
        k = mix64(k ^ _u64(groups))
        k = mix64(k ^ _u64(round_))
        return mix64(k ^ _u64(np.asarray(clients) + 1))


def counter_bits(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """:func:`keyed_uniform_bits` from :func:`client_keys` (broadcast against ``counters``)."""
    with np.errstate(over="ignore"):
        return mix64(keys ^ mix64(_u64(counters)))


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
