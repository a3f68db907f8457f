"""User models for the engine and CLI tests, importable by class_path (``_models.X``)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from fedshard_lightning.models import MLP
from fedshard_lightning.module import FederatedModule


class LoggingMLP(MLP):
    """Calls self.log inside the training step."""

    def training_step(self, batch, batch_idx=0):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


class LBFGSMLP(MLP):
    """Returns a non element-wise optimizer."""

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


class SchedulerMLP(MLP):
    """Returns a learning-rate scheduler (stepped once per round)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


class PlateauMLP(MLP):
    """Returns ReduceLROnPlateau, whose rate follows a metric, not the round (refused)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}


class ExplodingMLP(MLP):
    """Produces an infinite loss for client data containing label 3."""

    def training_step(self, batch, batch_idx=0):
        _, y = batch
        loss = super().training_step(batch, batch_idx)
        return loss + torch.where(
            (y == 3).any(), torch.tensor(float("inf"), dtype=loss.dtype), torch.zeros((), dtype=loss.dtype)
        )


class PlainMLP(L.LightningModule):
    """What a Lightning user writes: forward, training_step, configure_optimizers, nothing else."""

    def __init__(self, hidden: int = 16, num_classes: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Flatten(), nn.LazyLinear(hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss_logged", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.5)


class DropoutCNN(FederatedModule):
    """A CNN with dropout, self.log in training_step and a StepLR scheduler."""

    def __init__(self, p: float = 0.3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.p = p
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            c = self.input_shape[0]
            self.net = nn.Sequential(
                nn.Conv2d(c, 4, 3, padding=1),
                nn.ReLU(),
                nn.Dropout(self.p),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.LazyLinear(16),
                nn.ReLU(),
                nn.Dropout(self.p),
                nn.Linear(16, self.num_classes),
            )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx=0):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_acc", (logits.argmax(-1) == y).to(loss.dtype).mean())
        self.log_dict({"logged_loss": loss})
        return {"loss": loss}

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.5)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


class FunctionalDropoutMLP(MLP):
    """Draws random numbers with F.dropout (not an nn.Dropout layer): trained on the keyed loop."""

    def per_sample_loss(self, batch):
        x, y = batch
        return F.cross_entropy(F.dropout(self(x), 0.2, self.training), y, reduction="none")

    def training_step(self, batch, batch_idx=0):
        return self.per_sample_loss(batch).mean()


class BNDropoutCNN(DropoutCNN):
    """DropoutCNN with BatchNorm (running statistics) after the convolution."""

    def configure_model(self) -> None:
        if self.net is None:
            c = self.input_shape[0]
            self.net = nn.Sequential(
                nn.Conv2d(c, 4, 3, padding=1),
                nn.BatchNorm2d(4),
                nn.ReLU(),
                nn.Dropout(self.p),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.LazyLinear(16),
                nn.ReLU(),
                nn.Dropout(self.p),
                nn.Linear(16, self.num_classes),
            )


class CumulativeBNMLP(PlainMLP):
    """BatchNorm with momentum=None (a cumulative average): refused before training, naming the layer."""

    def __init__(self, hidden: int = 16, num_classes: int = 4, lr: float = 0.1) -> None:
        super().__init__(hidden, num_classes, lr)
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.LazyLinear(hidden),
            nn.BatchNorm1d(hidden, momentum=None),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )


class Plain(L.LightningModule):
    """A plain LightningModule: MLP, SGD with momentum and weight decay."""

    def __init__(self, inputs: int = 10, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, 16), nn.ReLU(), nn.Linear(16, classes))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
