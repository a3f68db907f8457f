"""Callbacks that tests name on the command line (``--trainer.callbacks _callbacks.X``)."""

from __future__ import annotations

from fedshard_lightning.callbacks import FederatedCallback


class InterruptOnceAtStage(FederatedCallback):
    """Raises KeyboardInterrupt (as Ctrl-C) in the first round of ``stage``, once per run directory."""

    def __init__(self, stage: int = 2) -> None:
        self.stage = stage

    def on_round_end(self, trainer, info, metrics) -> None:
        """Interrupt unless this run was interrupted before (its marker file exists)."""
        marker = trainer.run_dir / "interrupted-once"
        if info.stage == self.stage and not marker.exists():
            marker.write_text("")
            raise KeyboardInterrupt
