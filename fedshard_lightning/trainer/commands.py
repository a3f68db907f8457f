"""The bodies of ``test`` and ``audit``: what each reads, checks and prints, beside the trainer.

``test`` on a run directory evaluates the cache's current model (checksums verified, under the run
lock), repairing a stale or damaged ``model.safetensors`` from it; on a lone ``.safetensors`` file
it evaluates that file after checking its hash, names, shapes and dtypes against the configured
model. ``audit`` recomputes the model without
every unlearned client, by the run's own engine and by an independent reference, and compares both
with the current one; on a failure it adds the likely cause from the recorded numerical environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.callbacks.dispatch import call_hook
from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.schema import schema_of
from fedshard_lightning.loggers.run_loggers import finish_loggers
from fedshard_lightning.run.deployed import load_model
from fedshard_lightning.run.directory import check_real_folders, existing_run_dir, run_lock
from fedshard_lightning.unlearning.reference import certify

__all__ = ["run_audit", "run_test"]


def run_test(trainer: Any, model: Any, datamodule: Any, ckpt_path: str | None) -> dict[str, Any]:
    """``test``: see the module docstring."""
    path = Path(ckpt_path) if ckpt_path else None
    lone_file = path is not None and path.is_file()
    if lone_file:
        run_dir, weights = path.parent, path
        check_real_folders(run_dir)  # its logs/ are written beside the file
    else:
        run_dir = existing_run_dir(ckpt_path, "test")
        weights = run_dir / "model.safetensors"
    trainer.enable_progress_bar = False
    if not lone_file and (run_dir / "cache" / "CURRENT").is_file():
        with run_lock(run_dir):
            trainer._load_run(model, datamodule, str(run_dir), "test")
            trainer.cache.verify()  # every blob of the version it reports: those the load did not read
            metrics = _test_metrics(trainer, trainer.algorithm.current_params(), weights)
            row = {f"test/{k}": metrics[k] for k in ("test_accuracy", "test_loss")}
            trainer.reporter.log_result(run_dir, row, trainer.log_step_start)
            return metrics
    if not lone_file and not weights.is_file():
        raise CacheError(
            f"{run_dir} has no committed FLCache (cache/CURRENT) and no model file; was fit interrupted "
            "before stage 1? resume it with fit --ckpt_path RUN_DIR"
        )
    trainer._setup(model, datamodule, run_dir, "test")  # a model file: its hash, names, shapes and dtypes
    trainer.module.load_state_dict(
        load_model(weights, schema_of(trainer.module.state_dict()), trainer.device)
    )
    metrics = _test_metrics(trainer, trainer.algorithm.engine.module_params(), weights)
    finish_loggers(trainer.fabric.loggers, trainer.wandb)  # a lone model file: its folder is no run
    return metrics


def _test_metrics(trainer: Any, params: dict[str, Tensor], weights: Path) -> dict[str, Any]:
    acc, loss = trainer.evaluate(params)
    metrics = {"test_accuracy": acc, "test_loss": loss, "checkpoint": str(weights)}
    call_hook(trainer.fabric, "on_test_end", trainer.view(), metrics=metrics)
    trainer._print(f"test: test_accuracy={acc:.4f} test_loss={loss:.4f} ({weights})")
    return metrics


def run_audit(
    trainer: Any, tolerance: float, reference: bool = True, reference_tolerance: float | None = None
) -> dict[str, Any]:
    """``audit`` once the run is loaded: print both checks and the verdict; a failure names the likely cause.

    The checks are :func:`~fedshard_lightning.unlearning.reference.certify`'s: bit-equality with the
    run's own engine and the difference from the independent reference. The result says whether
    both passed (``passed``); the CLI turns a failure into exit status 1.
    """
    call_hook(trainer.fabric, "on_audit_start", trainer.view())
    result = certify(trainer.algorithm, tolerance, reference, reference_tolerance)
    call_hook(trainer.fabric, "on_audit_end", trainer.view(), result=result)
    if result["engine_passed"] and not result["passed"]:
        result["lines"].append(
            "likely cause: the engine replays its own model, but the independent reference trains another: "
            "a fault in the engine's training or averaging, or a reference tolerance too tight for this dtype"
        )
    elif not result["passed"]:
        dtype = next(trainer.module.parameters()).dtype
        notes = list(trainer.numerics_notes)
        if dtype not in (torch.float32, torch.float64):  # the stacked step is invariant in these only
            notes.append(
                f"dtype {dtype}: exactness is certified in float32 and float64 only (in half precision some CPU "
                "kernels round an element by its position in the stacked call); use 32-true, or audit with --tolerance"
            )
        cause = (
            "; ".join(notes)
            if notes
            else "no difference in the recorded numerical environment: were the cache, the model or the "
            "training samples changed (the run's fingerprint covers the data's labels and partition, not "
            "the sample values), or was fit run with trainer.batch_invariant false?"
        )
        result["lines"].append(f"likely cause: {cause}")
    for line in result["lines"]:
        trainer._print(line)
    row = {
        "audit/passed": float(result["passed"]),
        "audit/max_abs_diff": result["max_abs_diff"],
        "audit/bit_equal": float(result["bit_equal"]),
    }
    if "reference_rel_diff" in result:
        row["audit/reference_max_abs_diff"] = result["reference_max_abs_diff"]
        row["audit/reference_rel_diff"] = result["reference_rel_diff"]
    trainer.reporter.log_result(trainer.run_dir, row, trainer.log_step_start)
    return result  # a failure is the CLI's exit status 1, never a SystemExit from a Python call
