"""The kernels that train a call's clients, in the order ``kernel: auto`` prefers them.

=========== =========================================================================
``fx+chain`` hand-written forward and backward for MLP/CNN chains (:mod:`.chain`)
``fx``       the traced ``per_sample_loss`` program, autograd backward (:mod:`.fx`)
``vmap``     ``vmap`` of the user's ``training_step``, any model (:mod:`.vmap`)
``loop``     one client after the other: the reference and the fallback (:mod:`.loop`)
=========== =========================================================================

Each kernel follows :class:`~.base.Kernel`. The stacked ones are chosen once per trainer by
:func:`~fedshard_lightning.engine.kernel_choice.choose_kernel` (the first in :data:`STACKED`
that can train the model exactly); the loop is chosen instead by the engine's path choice.
"""

from fedshard_lightning.engine.kernels.base import ClientBatch, Kernel, KernelChoice, LocalResult, Probe
from fedshard_lightning.engine.kernels.chain import CHAIN
from fedshard_lightning.engine.kernels.fx import FX
from fedshard_lightning.engine.kernels.loop import LOOP
from fedshard_lightning.engine.kernels.vmap import VMAP

__all__ = [
    "CHAIN",
    "FX",
    "KERNELS",
    "LOOP",
    "STACKED",
    "VMAP",
    "ClientBatch",
    "Kernel",
    "KernelChoice",
    "LocalResult",
    "Probe",
    "by_name",
]

KERNELS: tuple[Kernel, ...] = (CHAIN, FX, VMAP, LOOP)
"""Every kernel, fastest first: the order ``kernel: auto`` tries the stacked ones in."""

STACKED: tuple[Kernel, ...] = tuple(k for k in KERNELS if k.stacked)
"""The kernels :func:`~fedshard_lightning.engine.kernel_choice.choose_kernel` chooses from."""


def by_name(name: str) -> Kernel:
    """The registered kernel called ``name``."""
    for k in KERNELS:
        if k.name == name:
            return k
    raise ValueError(f"no kernel {name!r}: choose one of {[k.name for k in KERNELS]}")
