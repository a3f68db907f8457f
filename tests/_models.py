"""Models that break the contract, importable by class_path in CLI tests (``_models.X``)."""

from __future__ import annotations

import torch

from fedshard_lightning.models import MLP


class LoggingMLP(MLP):
    """Calls self.log inside the training step (forbidden)."""

    def training_step(self, batch, batch_idx=0):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


class LBFGSMLP(MLP):
    """Returns a non element-wise optimizer."""

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


class SchedulerMLP(MLP):
    """Returns a learning-rate scheduler."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


class ExplodingMLP(MLP):
    """Produces an infinite loss for client data containing label 3."""

    def training_step(self, batch, batch_idx=0):
        _, y = batch
        loss = super().training_step(batch, batch_idx)
        return loss + torch.where(
            (y == 3).any(), torch.tensor(float("inf"), dtype=loss.dtype), torch.zeros((), dtype=loss.dtype)
        )
