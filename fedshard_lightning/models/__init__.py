"""Built-in models."""

from fedshard_lightning.models.cnn import FedAvgCNN
from fedshard_lightning.models.mlp import MLP
from fedshard_lightning.models.resnet import ResNet18BN, ResNetGN

__all__ = ["MLP", "FedAvgCNN", "ResNet18BN", "ResNetGN"]
