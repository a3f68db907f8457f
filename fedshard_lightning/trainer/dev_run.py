"""``--trainer.fast_dev_run true``: one round of one stage on a few clients, then stop.

As Lightning's ``fast_dev_run`` does, it runs the code a fit would run first, to find bugs before a
long run: the model bound to the data, the local-training path chosen, the user's
``training_step``, optimizer and clipping on a few clients for one round, their FedAvg, and the
test-set evaluation. It saves nothing: the run folder is a temporary one (:func:`dev_folder`),
removed at the end, so no run folder, cache or model file exists that could be mistaken for a
trained run; loggers are off. The trainer sets itself up in that folder and calls
:func:`train_one_round`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.fabric import Fabric
from torch import Tensor

from fedshard_lightning.engine import FederatedEngine, Group, stack_params, unstack_params
from fedshard_lightning.errors import ConfigError

__all__ = ["DEV_CLIENTS", "check_dev_run", "dev_folder", "dev_line", "train_one_round"]

#: Clients a dev run trains (the first ones that hold data).
DEV_CLIENTS = 4


def check_dev_run(ckpt_path: str | None) -> None:
    """Refuse a dev run that names a run to resume."""
    if ckpt_path is not None:
        raise ConfigError("trainer.fast_dev_run: a dev run trains one throwaway round; leave out --ckpt_path")


@contextmanager
def dev_folder(fabric: Fabric) -> Iterator[Path]:
    """A temporary run folder, the same in every process, removed once every process is done with it."""
    folder = Path(tempfile.mkdtemp(prefix="fedshard-fast-dev-run-")) if fabric.is_global_zero else None
    folder = Path(fabric.broadcast(str(folder) if folder else None, src=0))
    try:
        yield folder
    finally:
        fabric.barrier()
        if fabric.is_global_zero:
            shutil.rmtree(folder, ignore_errors=True)


def train_one_round(
    engine: FederatedEngine,
    client_sizes: Sequence[int],
    evaluate: Callable[[dict[str, Tensor]], tuple[float, float]],
) -> dict[str, Any]:
    """Train one round of one stage on the first :data:`DEV_CLIENTS` clients that hold data; what it gave."""
    clients = [c for c, n in enumerate(client_sizes) if n > 0][:DEV_CLIENTS]
    result = engine.train_groups(stack_params([engine.module_params()]), [Group(0, tuple(clients), 1)], 1)
    acc, loss = evaluate(unstack_params(result.params, 0))
    train_loss = result.history[0].mean_loss[0] if result.history else float("nan")
    return {
        "fast_dev_run": True,
        "clients": clients,
        "client_steps": result.client_steps,
        "train_loss": train_loss,
        "test_accuracy": acc,
        "test_loss": loss,
    }


def dev_line(result: dict[str, Any]) -> str:
    """The one line a dev run prints."""
    return (
        f"fast_dev_run: a dev run, nothing saved: 1 round of 1 stage on clients {result['clients']}, "
        f"{result['client_steps']} client-steps, train_loss={result['train_loss']:.4f} "
        f"test_accuracy={result['test_accuracy']:.4f}"
    )
