"""Which stacked kernel trains a model: the hand-written chain, the fx program, or ``vmap``.

The fastest kernel that reproduces the user's loss wins (:mod:`.kernels.check`). The chain is
compared with the user's loss directly; the fx program, from which the chain is read, needs its
own comparison only when it trains (no chain).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from torch import Tensor, nn

from fedshard_lightning.engine.kernels.chain import StackedChain
from fedshard_lightning.engine.kernels.check import Unsupported, reference
from fedshard_lightning.engine.kernels.fx import ConvMode, Kernel, KernelChoice, StackedProgram

__all__ = ["choose_kernel"]


def choose_kernel(
    module: nn.Module,
    names: Sequence[str],
    conv_mode: ConvMode,
    kernel: Literal["auto", "fx"],
    sample: tuple[Tensor, Tensor],
) -> tuple[KernelChoice, StackedProgram | None, StackedChain | None]:
    """The kernel choice, the fx program (None: keep vmap) and the chain (None: no chain).

    Args:
        module: The user's model (a :class:`~fedshard_lightning.module.FederatedModule` whose
            ``training_step`` is the default mean of ``per_sample_loss``).
        names: Trainable parameter names.
        conv_mode: How stacked convolutions run.
        kernel: ``auto`` (chain if it checks, else fx) or ``fx`` (the fx program only).
        sample: Samples [C, B, ...] and labels [C, B] of a few clients, for the checks.
    """
    try:
        program = StackedProgram.build(module, names, conv_mode)
        ref = reference(module, *sample, names)
    except Unsupported as err:
        return KernelChoice(Kernel.VMAP, str(err)), None, None
    why = "not asked (kernel: fx)"
    if kernel == "auto":
        try:
            chain = StackedChain.from_program(program, conv_mode)
            chain.check(ref, *sample)
            return KernelChoice(Kernel.CHAIN), program, chain
        except Unsupported as err:
            why = str(err)
    try:
        program.check(ref, *sample)
    except Unsupported as err:
        return KernelChoice(Kernel.VMAP, str(err)), None, None
    return KernelChoice(Kernel.FX, f"no chain: {why}" if kernel == "auto" else ""), program, None
