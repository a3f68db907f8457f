"""The shape every built-in image model shares: ``features`` then ``classifier``, built from the data's shape.

A :class:`~fedshard_lightning.module.FederatedModule` learns its input shape and class count from
the datamodule, so layers are built in ``configure_model`` once both are known (or at once when
they are given). :class:`ImageClassifier` owns that protocol and the refusal of non-image data;
a model only says how to build its two parts from ``(channels, height, width)``.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedshard_lightning.errors import ConfigError
from fedshard_lightning.module import FederatedModule

__all__ = ["ImageClassifier", "kaiming_convs"]


class ImageClassifier(FederatedModule):
    """``classifier(features(x))`` on images ``[C, H, W]``; subclasses implement :meth:`build_layers`."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.features: nn.Module | None = None
        self.classifier: nn.Module | None = None

    def build_when_shaped(self) -> None:
        """Build now if the shapes were given to the constructor (subclasses call it last in ``__init__``)."""
        if self.input_shape is not None and self.num_classes is not None:
            self.configure_model()

    def configure_model(self) -> None:
        """Build the layers once shapes are known (once: later calls keep them)."""
        if self.features is not None:
            return
        if len(self.input_shape) != 3:
            raise ConfigError(
                f"{type(self).__name__} needs image inputs [C, H, W], got samples of shape "
                f"{list(self.input_shape)}; use MLP for vector data"
            )
        self.features, self.classifier = self.build_layers(*self.input_shape)

    def build_layers(self, channels: int, height: int, width: int) -> tuple[nn.Module, nn.Module]:
        """``(features, classifier)`` for inputs of this shape and ``self.num_classes`` classes."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_layers")

    def forward(self, x: Tensor) -> Tensor:
        """Logits [b, classes]."""
        return self.classifier(self.features(x))


def kaiming_convs(module: nn.Module) -> None:
    """He et al.'s initialisation (fan-out, ReLU) of every convolution in ``module``."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
