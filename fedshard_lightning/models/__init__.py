"""Built-in vmap-safe models."""

from fedshard_lightning.models.cnn import FedAvgCNN
from fedshard_lightning.models.mlp import MLP
from fedshard_lightning.models.resnet import ResNetGN

__all__ = ["MLP", "FedAvgCNN", "ResNetGN"]
