"""Lightning Fabric for the trainer: launch with the process-wide settings, one seed across processes, gathering.

The trainer (:mod:`fedshard_lightning.trainer.trainer`) calls these once per command; they touch
Fabric and the process, never the run.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor

from fedshard_lightning.engine.allocator import configure_process
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.launch.exits import one_line as _one_line
from fedshard_lightning.launch.peer_watch import launch_watched
from fedshard_lightning.run import numerics

__all__ = [
    "all_gather",
    "check_same_seed",
    "launch_fabric",
]


def all_gather(fabric: L.Fabric) -> Callable[[Tensor], Tensor]:
    """Fabric's ``all_gather`` without torch's deprecation warning for the function it calls.

    Lightning 2.6 gathers with ``torch.distributed.nn.functional.all_gather``, deprecated in torch
    2.13: every rank printed the warning at each place that gathers (6 lines in a 2-process fit),
    about code the user cannot change.
    """

    def gather(tensor: Tensor) -> Tensor:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated"
            )
            return fabric.all_gather(tensor)

    return gather


def launch_fabric(
    accelerator: str,
    devices: int | str,
    strategy: str,
    precision: str,
    num_threads: int | None = None,
    tf32: bool | None = None,
    warn: bool = True,
) -> L.Fabric:
    """Create and launch Fabric (with ``strategy: ddp`` this starts the other processes).

    Then the process-wide settings, once: the allocator, the intra-op thread count, and a one-line
    warning on rank zero when the processes' threads oversubscribe the CPU (``warn``: a fit; the
    other commands take fit's count and check it then, :func:`reproduce_numerics`).
    """
    try:
        fabric = L.Fabric(accelerator=accelerator, devices=devices, strategy=strategy, precision=precision)
    except (ValueError, TypeError, RuntimeError, ImportError, MisconfigurationException) as e:
        # ImportError: an accelerator whose package is missing (tpu needs torch_xla)
        raise ConfigError(
            f"trainer.accelerator={accelerator!r}, trainer.devices={devices!r}, "
            f"trainer.strategy={strategy!r}, trainer.precision={precision!r}: {e}"
        ) from None
    try:
        launch_watched(fabric)  # fabric.launch(), a stopped worker stopping this process cleanly
    except TypeError as e:  # ddp_spawn/ddp_fork/ddp_notebook start a function, not the command again
        raise ConfigError(
            f"trainer.strategy={strategy!r}: the trainer's commands run in processes that re-run the "
            f"command line; use trainer.strategy ddp ({_one_line(str(e))})"
        ) from None
    configure_process(fabric.device, tf32)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if warn and fabric.is_global_zero and fabric.device.type == "cpu":
        warning = numerics.oversubscription_warning(torch.get_num_threads() * fabric.world_size)
        if warning:
            sys.stderr.write(warning + "\n")
    return fabric


def check_same_seed(fabric: L.Fabric, seed: int) -> None:
    """Refuse processes of one DDP run that were given different seeds, on every rank alike.

    Rank r trains its groups from its own seed while rank zero commits and records its own, so
    the model would equal no one-process fit and fail its audit (a launcher that draws
    ``seed_everything: true`` in each process, or a script that seeds each rank differently).
    """
    seeds = all_gather(fabric)(torch.tensor([seed], dtype=torch.long, device=fabric.device))
    seeds = [int(s) for s in seeds.flatten().tolist()]
    if len(set(seeds)) > 1:
        raise ConfigError(
            f"seed_everything: the {len(seeds)} processes of this DDP run have different seeds {seeds}; "
            "give every process the same one (--seed_everything N)"
        )
