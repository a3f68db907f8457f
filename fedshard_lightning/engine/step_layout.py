"""What a stacked round derives from its clients' batch sizes alone, made once per distinct set.

The stacked step order (clients by decreasing step count), the number of clients still training
at each step and the per-sample loss weights depend only on the clients' batch sizes, which are
the same in every round of the same participants (SPEC section 3: a batch's size depends on the
client's sample count, its content on the round's key). Deriving them cost a dozen numpy and
tensor calls a round, a fixed cost that dominates rounds of one or two clients (unlearning's lower
stages); :class:`StepLayouts` keeps them by the batch sizes themselves, so a cached layout is
exactly the one the round would derive (``tests/engine/test_step_layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["StepLayout", "StepLayouts"]


@dataclass(frozen=True)
class StepLayout:
    """The step order of a round's clients and what follows from their batch sizes.

    Attributes:
        order: Clients by decreasing step count (stable), positions into the round's clients.
        order_t: ``order`` on the models' device.
        in_order: Whether ``order`` is the identity (no permutation to undo).
        s_max: The most steps of any client.
        gsz: Batch sizes [S, m] in step order.
        live: Clients still training at each step (a prefix of ``order``).
        size_t: ``gsz`` on the device, for autograd steps (None for chain steps).
        weight_all: Per-sample loss weights [S, m, B] (1 / batch size, 0 on padding), for chain
            steps (None otherwise).
    """

    order: np.ndarray
    order_t: Tensor
    in_order: bool
    s_max: int
    gsz: np.ndarray
    live: list[int]
    size_t: Tensor | None
    weight_all: Tensor | None

    @classmethod
    def of(
        cls, gsz: np.ndarray, steps: np.ndarray, device: torch.device, b: int, dtype: torch.dtype, chain: bool
    ) -> StepLayout:
        """The layout of clients with batch sizes ``gsz`` [m, S] and step counts ``steps`` [m]."""
        m = len(steps)
        order = np.argsort(-steps, kind="stable")
        s_max = int(steps.max()) if m else 0
        g = np.ascontiguousarray(gsz[order].T)
        weight = None
        if chain:
            w = (np.arange(b) < g[:, :, None]) / np.maximum(g, 1)[:, :, None]
            weight = torch.as_tensor(w, dtype=dtype, device=device)
        return cls(
            order=order,
            order_t=torch.as_tensor(order, device=device),
            in_order=bool((order == np.arange(m)).all()),
            s_max=s_max,
            gsz=g,
            live=(steps[order] > np.arange(s_max)[:, None]).sum(1).tolist(),
            size_t=None if chain else torch.as_tensor(g, device=device),
            weight_all=weight,
        )


class StepLayouts:
    """:meth:`StepLayout.of`, kept by the batch sizes and steps (at most ``limit`` at a time).

    Args:
        batch_size: The schedule's batch size B.
        dtype: The models' dtype (of the loss weights).
        limit: Layouts kept before the cache starts afresh (distinct participant sets of a fit).
    """

    def __init__(self, batch_size: int, dtype: torch.dtype, limit: int = 256) -> None:
        self.batch_size = batch_size
        self.dtype = dtype
        self.limit = limit
        self._kept: dict[tuple, StepLayout] = {}

    def __call__(self, gsz: np.ndarray, steps: np.ndarray, device: torch.device, chain: bool) -> StepLayout:
        """The layout of these clients (cached: the same arrays give the same layout)."""
        key = (gsz.shape, gsz.tobytes(), steps.tobytes(), str(device), chain)
        lay = self._kept.get(key)
        if lay is None:
            if len(self._kept) >= self.limit:
                self._kept.clear()
            lay = self._kept[key] = StepLayout.of(gsz, steps, device, self.batch_size, self.dtype, chain)
        return lay
