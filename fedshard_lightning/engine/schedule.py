"""Local-training schedules: which samples a client visits, in which batches, in one round."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedshard_lightning.engine.keys import keyed_rng
from fedshard_lightning.errors import ConfigError

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
            raise ConfigError(f"batch_size={self.batch_size!r}: must be a positive integer (e.g. 10)")
        if self.local_steps is None and (not isinstance(self.local_epochs, int) or self.local_epochs < 1):
            raise ConfigError(f"local_epochs={self.local_epochs!r}: must be a positive integer")
        if self.local_steps is not None and (not isinstance(self.local_steps, int) or self.local_steps < 1):
            raise ConfigError(f"local_steps={self.local_steps!r}: must be a positive integer or null")

    def num_steps(self, n: int) -> int:
        """Optimizer steps a client with ``n`` samples takes in one round."""
        if self.local_steps is not None:
            return self.local_steps
        return self.local_epochs * math.ceil(n / self.batch_size)

    def batches(
        self, n: int, seed: int, stage: int, group: int, round_: int, client: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Positions (into the client's own index list) of every batch, padded with 0, and batch sizes.

        Returns:
            ``idx`` of shape [steps, batch_size] and ``sizes`` of shape [steps].
        """
        rng = keyed_rng(seed, stage, group, round_, client)
        b = self.batch_size
        steps = self.num_steps(n)
        idx = np.zeros((steps, b), dtype=np.int64)
        sizes = np.zeros(steps, dtype=np.int64)
        s = 0
        while s < steps:
            perm = rng.permutation(n)
            for start in range(0, n, b):
                chunk = perm[start : start + b]
                idx[s, : len(chunk)] = chunk
                sizes[s] = len(chunk)
                s += 1
                if s == steps:
                    break
        return idx, sizes
