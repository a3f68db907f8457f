"""``--trainer.fast_dev_run true``: one round of one stage on a few clients, then stop.

As Lightning's ``fast_dev_run`` does, it runs the code a fit would run first, to find bugs before a
long run: the model bound to the data, the local-training path chosen, the user's
``training_step``, optimizer and clipping on a few clients for one round, their FedAvg, and the
test-set evaluation. It saves nothing: the run folder is a temporary one, removed at the end, so
no run folder, cache or model file exists that could be mistaken for a trained run; loggers are off.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from fedshard_lightning.engine import Group, stack_params, unstack_params
from fedshard_lightning.errors import ConfigError

__all__ = ["DEV_CLIENTS", "run_dev"]

#: Clients a dev run trains (the first ones that hold data).
DEV_CLIENTS = 4


def run_dev(trainer: Any, model: Any, datamodule: Any, ckpt_path: str | None) -> dict[str, Any]:
    """Train one round of one stage on the first :data:`DEV_CLIENTS` clients; print one line; keep nothing."""
    if ckpt_path is not None:
        raise ConfigError("trainer.fast_dev_run: a dev run trains one throwaway round; leave out --ckpt_path")
    trainer.wandb, trainer.tensorboard, trainer.user_loggers = False, False, []
    trainer._launch()
    folder = Path(tempfile.mkdtemp(prefix="fedshard-fast-dev-run-")) if trainer.is_global_zero else None
    folder = Path(trainer.fabric.broadcast(str(folder) if folder else None, src=0))
    try:
        trainer._setup(model, datamodule, folder, "fit")
        engine = trainer.algorithm.engine
        clients = [c for c, n in enumerate(trainer.client_sizes) if n > 0][:DEV_CLIENTS]
        result = engine.train_groups(stack_params([engine.module_params()]), [Group(0, tuple(clients), 1)], 1)
        acc, loss = trainer.evaluate(unstack_params(result.params, 0))
        train_loss = result.history[0].mean_loss[0] if result.history else float("nan")
        trainer._print(
            f"fast_dev_run: a dev run, nothing saved: 1 round of 1 stage on clients {clients}, "
            f"{result.client_steps} client-steps, train_loss={train_loss:.4f} test_accuracy={acc:.4f}"
        )
        return {
            "fast_dev_run": True,
            "clients": clients,
            "client_steps": result.client_steps,
            "train_loss": train_loss,
            "test_accuracy": acc,
            "test_loss": loss,
        }
    finally:
        trainer.fabric.barrier()
        if trainer.is_global_zero:
            shutil.rmtree(folder, ignore_errors=True)
        trainer.run_dir = None
