"""Local-training schedules: which samples a client visits, in which batches, in one round."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedshard_lightning.engine.keys import client_keys, counter_bits
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.limits import check_count

__all__ = ["LocalSchedule"]


@dataclass(frozen=True)
class LocalSchedule:
    """How a client trains in one round (SPEC section 3).

    Args:
        batch_size: Mini-batch size B; the last batch of an epoch may be partial (no drop_last).
        local_epochs: Passes over the client's data per round (used when ``local_steps`` is None).
        local_steps: If set, exactly this many steps per round, reshuffling at each epoch boundary.
    """

    batch_size: int = 10
    local_epochs: int = 1
    local_steps: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(
                f"algorithm.batch_size={self.batch_size!r}: must be a positive integer (e.g. 10)"
            )
        if self.local_steps is None:
            check_count("algorithm.local_epochs", self.local_epochs)
        check_count("algorithm.local_steps", self.local_steps, optional=True)

    def num_steps(self, n: int) -> int:
        """Optimizer steps a client with ``n`` samples takes in one round."""
        if self.local_steps is not None:
            return self.local_steps
        return self.local_epochs * math.ceil(n / self.batch_size)

    def plan_steps(self, n: np.ndarray) -> np.ndarray:
        """Steps of clients with ``n`` samples in :meth:`plan` (0 for a client without samples)."""
        n = np.asarray(n, dtype=np.int64)
        if self.local_steps is None:
            return self.local_epochs * -(-n // self.batch_size)
        return np.where(n > 0, self.local_steps, 0).astype(np.int64)

    def plan(
        self,
        n: np.ndarray,
        seed: int,
        stage: int | np.ndarray,
        groups: np.ndarray,
        round_: int | np.ndarray,
        clients: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The batches of many clients in one round, from the keyed hash (SPEC section 3).

        Every epoch visits a client's samples in a fresh keyed permutation; a client's batches
        depend only on its own key, never on the other clients planned with it.

        Args:
            n: Sample count of every client.
            seed: Training seed.
            stage: Stage of the round (or one per client: stages planned together).
            groups: Group key of every client.
            round_: Round within the stage (or one per client: rounds planned together).
            clients: Client ids.

        Returns:
            ``pos`` [m, S, batch_size]: positions into each client's own index list (0-padded),
            ``sizes`` [m, S]: batch sizes (0 after a client's last step) and ``steps`` [m], where
            S is the largest number of steps.
        """
        n = np.asarray(n, dtype=np.int64)
        m, b = len(n), self.batch_size
        steps = self.plan_steps(n)
        per_epoch = np.maximum(-(-n // b), 1)
        epochs = -(-steps // per_epoch)
        draws = n * epochs
        owner = np.repeat(np.arange(m), draws)
        within = np.arange(int(draws.sum()), dtype=np.int64) - np.repeat(np.cumsum(draws) - draws, draws)
        n_own = n[owner]
        epoch, rank = within // np.maximum(n_own, 1), within % np.maximum(n_own, 1)
        # The key hash once per client, then per draw only its counter (bits as keyed_uniform_bits).
        bits = counter_bits(
            client_keys(seed, stage, np.asarray(groups), round_, np.asarray(clients))[owner], within
        )
        # Segment (client, epoch) j holds draws [start_j, start_j + n) in rank order.
        seg = (np.cumsum(epochs) - epochs)[owner] + epoch
        perm = _order_within(bits, seg, rank, np.repeat(n, epochs))
        step = epoch * per_epoch[owner] + rank // b
        keep = step < steps[owner]
        owner, step, slot, perm = owner[keep], step[keep], rank[keep] % b, perm[keep]
        s_max = int(steps.max()) if m else 0
        pos = np.zeros((m, s_max, b), dtype=np.int64)
        pos[owner, step, slot] = perm
        # Step s of a client is batch s % per_epoch of an epoch: the rest of its n samples, at most b.
        s_idx = np.arange(s_max, dtype=np.int64)
        full = np.minimum(b, n[:, None] - (s_idx % per_epoch[:, None]) * b)
        sizes = np.where(s_idx < steps[:, None], full, 0)
        return pos, sizes, steps

    def batches(
        self, n: int, seed: int, stage: int, group: int, round_: int, client: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """One client's :meth:`plan`: positions [steps, batch_size] (0-padded) and batch sizes [steps]."""
        pos, sizes, steps = self.plan(
            np.array([n]), seed, stage, np.array([group]), round_, np.array([client])
        )
        return pos[0, : steps[0]], sizes[0, : steps[0]]


def _order_within(bits: np.ndarray, seg: np.ndarray, rank: np.ndarray, seg_len: np.ndarray) -> np.ndarray:
    """Ranks of each segment's draws sorted by ``bits``, segments in order (``lexsort`` by segment, bits).

    Draws come segment by segment, in rank order. Where the segments have similar lengths they are
    sorted as rows of a padded matrix (the padding, the largest ``uint64``, sorts last: the sort
    is stable and real draws come first), several times faster than ``lexsort`` on 10^4-10^5 draws
    (a round's plan of 64 digits clients: 3.2 -> 0.7 ms); ties in ``bits`` keep rank order in both.
    """
    width = int(seg_len.max(initial=0))
    if len(seg_len) * width > 4 * len(bits) + 1024:  # very unequal segments: padding would dominate
        return rank[np.lexsort((bits, seg))]
    rows = np.full((len(seg_len), width), np.iinfo(np.uint64).max, dtype=np.uint64)
    rows[seg, rank] = bits
    cols = np.argsort(rows, axis=1, kind="stable")
    return cols[np.arange(width) < seg_len[:, None]]
