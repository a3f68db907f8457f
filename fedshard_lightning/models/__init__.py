"""Built-in vmap-safe models."""

from fedshard_lightning.models.cnn import FedAvgCNN
from fedshard_lightning.models.mlp import MLP

__all__ = ["MLP", "FedAvgCNN"]
