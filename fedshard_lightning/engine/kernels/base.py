"""What every kernel says about itself: its name, why it exists, whether it can train a model.

A kernel is one way of computing the local training of a call's clients. The stacked kernels
(:mod:`.chain`, :mod:`.fx`, :mod:`.vmap`) train all clients of a call at once and share one
driver (``LocalTrainer.train_stacked``: step order, retired clients, the optimizer over the
stacked rows); they differ in how a step's losses and gradients are computed. The per-client
loop (:mod:`.loop`) trains one client after the other with the user's own optimizer: the
reference the others are compared with, and the fallback.

The registry (:mod:`fedshard_lightning.engine.kernels`) lists them in the order ``kernel: auto``
prefers; :func:`~fedshard_lightning.engine.kernel_choice.choose_kernel` takes the first stacked
kernel that can train the model, asking each through :meth:`Kernel.unsupported` on a
:class:`Probe` of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
from torch import Tensor, nn

__all__ = [
    "ClientBatch",
    "ConvMode",
    "Kernel",
    "KernelChoice",
    "LocalResult",
    "Probe",
    "Trainer",
]

ConvMode = Literal["grouped", "per_client"]


@dataclass
class ClientBatch:
    """The clients of one local-training call and where their randomness comes from."""

    clients: list[int]
    groups: list[int]
    stage: int
    round: int


@dataclass
class LocalResult:
    """Final parameters [m, ...] by name, steps per client, summed loss and logged values per client."""

    params: dict[str, Tensor]
    steps: np.ndarray
    loss_sum: Tensor
    logs: dict[str, Tensor] = field(default_factory=dict)


class Probe:
    """A model as the kernels see it when asked whether they can train it.

    What one kernel builds to answer (the fx program, the user's reference losses) is kept in
    :attr:`built` for the next one, so a refused chain does not trace the model twice.

    Args:
        module: The user's model.
        names: Trainable parameter names.
        conv_mode: How stacked convolutions run.
        sample: Samples [C, B, ...] and labels [C, B] of a few clients, made on first use.
        not_maskable: Why the loss is not a mean of ``per_sample_loss`` (None where it is), which
            the kernels that rewrite that loss need.
    """

    def __init__(
        self,
        module: nn.Module,
        names: Sequence[str],
        conv_mode: ConvMode,
        sample: Callable[[], tuple[Tensor, Tensor]],
        not_maskable: str | None = None,
    ) -> None:
        self.module = module
        self.names = list(names)
        self.conv_mode: ConvMode = conv_mode
        self.not_maskable = not_maskable
        self._sample_fn = sample
        self._sample: tuple[Tensor, Tensor] | None = None
        self.built: dict[str, Any] = {}

    @property
    def sample(self) -> tuple[Tensor, Tensor]:
        """The samples and labels the checks run on (gathered once)."""
        if self._sample is None:
            self._sample = self._sample_fn()
        return self._sample


class Trainer(Protocol):
    """What a kernel reads from the local trainer (``LocalTrainer``) it trains for."""

    module: nn.Module
    names: list[str]
    buffer_names: list[str]
    dtype: Any
    dm: Any
    spec: Any
    lr_at: Any
    clip: Any
    loop_uses_spec: bool
    client_states: dict[int, dict[str, Any]] | None
    kernel_choice: KernelChoice | None

    def schedules(self, batch: ClientBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global sample indices [m, S, B], batch sizes [m, S] and step counts [m] of the clients."""
        ...

    def keys(self, batch: ClientBatch, steps: int) -> np.ndarray:
        """Random key of every client's every local step, [m, steps]."""
        ...

    def loop_worker(self) -> tuple[nn.Module, Any]:
        """The per-client loop's copy of the model and its step context."""
        ...

    def program(self) -> Any:
        """Make the trainer's stacked kernel choice (once)."""
        ...

    def train_stacked(
        self, start: dict[str, Tensor], batch: ClientBatch, rows: Tensor | None = None, fixed: bool = False
    ) -> LocalResult:
        """The stacked driver: every client of ``batch`` at once, with the chosen kernel."""
        ...


class Kernel(Protocol):
    """One way of training a call's clients."""

    name: str
    """Its name in logs, the kernel choice and ``kernel`` settings (``fx+chain``, ``fx``, ``vmap``, ``loop``)."""
    reason: str
    """Why it exists, in one line."""
    stacked: bool
    """Trains all clients of a call at once (else one after the other)."""
    batch_invariant: bool
    """On the CPU (per-client convolutions, no compile) a client's bits do not depend on the other
    clients of its call."""

    def unsupported(self, probe: Probe) -> str | None:
        """None if it can train the model exactly, else the reason it cannot."""
        ...

    def parts(self, probe: Probe) -> tuple[Any, Any]:
        """What the stacked driver runs (after :meth:`unsupported` said None).

        The fx program and the hand-written chain, each None where this kernel does not use it.
        """
        ...

    def train(
        self, local: Trainer, start: dict[str, Tensor], batch: ClientBatch, rows: Tensor | None = None
    ) -> LocalResult:
        """Train the clients of ``batch`` from ``start`` (one row per client, or per group with ``rows``)."""
        ...


@dataclass(frozen=True)
class KernelChoice:
    """Which stacked kernel runs, and why not a faster one (empty for the fastest)."""

    kernel: Kernel
    reason: str = ""

    def __str__(self) -> str:
        return self.kernel.name + (f" ({self.reason})" if self.reason else "")


class StackedKernel:
    """The stacked kernels' shared part: they train through the trainer's stacked driver."""

    name = ""
    reason = ""
    stacked = True
    batch_invariant = False

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"

    def train(
        self, local: Trainer, start: dict[str, Tensor], batch: ClientBatch, rows: Tensor | None = None
    ) -> LocalResult:
        """``local.train_stacked``, which runs this kernel only where the trainer chose it."""
        local.program()  # the trainer's kernel choice, made once
        if local.kernel_choice is None or local.kernel_choice.kernel is not self:
            raise ValueError(f"the trainer runs kernel {local.kernel_choice}, not {self.name}")
        return local.train_stacked(start, batch, rows)
