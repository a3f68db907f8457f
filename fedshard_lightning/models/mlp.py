"""Multi-layer perceptrons, including the FedAvg "2NN" (McMahan et al., AISTATS 2017, section 3)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from torch import Tensor, nn

from fedshard_lightning.errors import ConfigError
from fedshard_lightning.module import FederatedModule

__all__ = ["MLP"]


class MLP(FederatedModule):
    """Fully connected ReLU network on flattened inputs.

    ``hidden=[200, 200]`` is the FedAvg 2NN (199,210 parameters on MNIST shape).

    Args:
        hidden: Widths of the hidden layers.
        **kwargs: See :class:`~fedshard_lightning.module.FederatedModule`.
    """

    def __init__(self, hidden: Sequence[int] = (200, 200), **kwargs) -> None:
        super().__init__(**kwargs)
        if any(int(h) < 1 for h in hidden):
            raise ConfigError(f"model.hidden={list(hidden)}: every width must be >= 1")
        self.hidden = tuple(int(h) for h in hidden)
        self.net: nn.Module | None = None
        if self.input_shape is not None and self.num_classes is not None:
            self.configure_model()

    def configure_model(self) -> None:
        """Build the layers once shapes are known."""
        if self.net is not None:
            return
        widths = [math.prod(self.input_shape), *self.hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], self.num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Logits [b, classes]."""
        return self.net(x)
