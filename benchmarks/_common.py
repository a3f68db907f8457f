"""Helpers shared by the benchmark scripts: build and run trainers quietly."""

from __future__ import annotations

import contextlib
import io
import tempfile
from typing import Any

from fedshard_lightning.trainer import FederatedTrainer


def quiet_trainer(algorithm: Any, root: str | None = None, **kw: Any) -> FederatedTrainer:
    """A trainer without progress bar or per-round evaluation, in a temporary root."""
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("eval_every_n_rounds", 0)
    return FederatedTrainer(
        algorithm=algorithm, default_root_dir=root or tempfile.mkdtemp(prefix="bench-"), **kw
    )


@contextlib.contextmanager
def silence():
    """Swallow the trainer's prints."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield
