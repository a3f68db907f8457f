"""The FedAvg CNN (McMahan et al., AISTATS 2017, section 3): two 5x5 convolutions, two dense layers."""

from __future__ import annotations

from torch import nn

from fedshard_lightning.models.image import ImageClassifier

__all__ = ["FedAvgCNN"]


class FedAvgCNN(ImageClassifier):
    """conv5x5(32) -> maxpool 2 -> conv5x5(64) -> maxpool 2 -> fc(512) -> fc(classes), ReLU.

    With "same" padding, as in the FedAvg paper: 1,663,370 parameters for 1x28x28 inputs and 10
    classes. Works for any input size (CIFAR: 3x32x32).

    Args:
        channels: Output channels of the two convolutions.
        hidden: Width of the dense hidden layer.
        **kwargs: See :class:`~fedshard_lightning.module.FederatedModule`.
    """

    def __init__(self, channels: tuple[int, int] = (32, 64), hidden: int = 512, **kwargs) -> None:
        super().__init__(**kwargs)
        self.channels = tuple(int(c) for c in channels)
        self.hidden = int(hidden)
        self.build_when_shaped()

    def build_layers(self, c_in: int, h: int, w: int) -> tuple[nn.Module, nn.Module]:
        """Two 5x5 convolutions with pooling, then two dense layers."""
        c1, c2 = self.channels
        features = nn.Sequential(
            nn.Conv2d(c_in, c1, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        flat = c2 * (h // 4) * (w // 4)
        classifier = nn.Sequential(
            nn.Linear(flat, self.hidden), nn.ReLU(), nn.Linear(self.hidden, self.num_classes)
        )
        return features, classifier
