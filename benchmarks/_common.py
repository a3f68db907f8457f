"""Helpers shared by the benchmark scripts: build and run trainers quietly."""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from typing import Any

from fedshard_lightning.trainer import FederatedTrainer


def quiet_trainer(algorithm: Any, root: str | None = None, **kw: Any) -> FederatedTrainer:
    """A trainer without progress bar or per-round evaluation, in a temporary root."""
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("eval_every_n_rounds", 0)
    kw.setdefault("enable_fairness", False)  # a benchmark times training, not the fairness replay after it
    return FederatedTrainer(
        algorithm=algorithm, default_root_dir=root or tempfile.mkdtemp(prefix="bench-"), **kw
    )


@contextlib.contextmanager
def silence():
    """Swallow the trainer's prints."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


_TF32 = {"default": None, "on": True, "off": False}


def add_tf32_option(ap: argparse.ArgumentParser) -> None:
    """``--tf32 default|on|off``: ``trainer.tf32`` null, true or false (read with :func:`tf32_setting`)."""
    ap.add_argument(
        "--tf32",
        choices=list(_TF32),
        default="default",
        help="CUDA: trainer.tf32 null (torch's default: TF32 convolutions), true or false (IEEE)",
    )


def tf32_setting(name: str) -> bool | None:
    """The ``trainer.tf32`` value of a ``--tf32`` choice."""
    return _TF32[name]
