"""Which stacked kernel trains a model: the first of the registry's that can train it exactly.

The registry (:data:`~.kernels.STACKED`) lists the stacked kernels fastest first: the
hand-written chain, the fx program, ``vmap``. Each says through ``unsupported`` whether it
reproduces the user's loss (:mod:`.kernels.check`); the first that does trains, and the choice
records why the one before it did not. The chain is compared with the user's loss directly; the
fx program, from which the chain is read, needs its own comparison only when it trains (no chain).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, nn

from fedshard_lightning.engine.kernels import STACKED, VMAP, KernelChoice, Probe, by_name
from fedshard_lightning.engine.kernels.base import ConvMode
from fedshard_lightning.engine.kernels.chain import StackedChain
from fedshard_lightning.engine.kernels.fx import StackedProgram

__all__ = ["choose_kernel"]


def choose_kernel(
    module: nn.Module,
    names: Sequence[str],
    conv_mode: ConvMode,
    kernel: str,
    sample: Callable[[], tuple[Tensor, Tensor]],
    not_maskable: str | None = None,
) -> tuple[KernelChoice, StackedProgram | None, StackedChain | None]:
    """The kernel choice, the fx program (None: not used) and the chain (None: no chain).

    Args:
        module: The user's model.
        names: Trainable parameter names.
        conv_mode: How stacked convolutions run.
        kernel: ``auto`` (the first stacked kernel that can train the model), or a stacked
            kernel's name: that one, else the next that can (``fx``: the fx program only;
            ``vmap``: ``vmap`` without asking the others).
        sample: Makes samples [C, B, ...] and labels [C, B] of a few clients, for the checks.
        not_maskable: Why the loss is not a mean of ``per_sample_loss`` (None where it is).
    """
    if kernel == VMAP.name:
        return KernelChoice(VMAP, "chosen"), None, None
    first = 0 if kernel == "auto" else STACKED.index(by_name(kernel))
    probe = Probe(module, names, conv_mode, sample, not_maskable)
    why = ""
    for candidate in STACKED[first:]:
        refused = candidate.unsupported(probe)
        if refused is None:
            program, chain = candidate.parts(probe)
            return KernelChoice(candidate, why), program, chain
        why = refused
    raise AssertionError("vmap trains every model stacked or says why when it trains")
