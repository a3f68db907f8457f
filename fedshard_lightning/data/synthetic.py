"""Seeded Gaussian-mixture classification of any sample shape: MNIST/CIFAR shapes without files."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fedshard_lightning.data.base import FederatedDataModule

__all__ = ["SyntheticDataModule"]


class SyntheticDataModule(FederatedDataModule):
    """Class-conditional Gaussians around random unit-variance centres.

    Args:
        num_samples: Training samples (the test set has ``num_test`` more from the same law).
        num_test: Test samples.
        shape: Shape of one sample, e.g. ``[1, 28, 28]`` (MNIST) or ``[3, 32, 32]`` (CIFAR) or ``[64]``.
        num_classes_: Number of classes.
        noise: Standard deviation around the class centre; larger is harder.
        as_uint8: Store samples as uint8 images (like real image data) instead of floats.
        **kwargs: See :class:`FederatedDataModule`.
    """

    def __init__(
        self,
        *args,
        num_samples: int = 2000,
        num_test: int = 500,
        shape: Sequence[int] = (64,),
        num_classes_: int = 10,
        noise: float = 1.0,
        as_uint8: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.num_samples = num_samples
        self.num_test = num_test
        self.shape = tuple(int(s) for s in shape)
        self.num_classes_ = num_classes_
        self.noise = noise
        self.as_uint8 = as_uint8
        self._data: tuple[Tensor, Tensor] | None = None

    def _generate(self) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(10_007 * self.seed + 1)
        n = self.num_samples + self.num_test
        centres = torch.randn(self.num_classes_, *self.shape, generator=g)
        y = torch.randint(0, self.num_classes_, (n,), generator=g)
        x = centres[y] + self.noise * torch.randn(n, *self.shape, generator=g)
        if self.as_uint8:
            x = (x * 32 + 128).clamp(0, 255).to(torch.uint8)
        return x, y

    def load_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """Generate once; the first ``num_samples`` are training data."""
        if self._data is None:
            self._data = self._generate()
        x, y = self._data
        return (
            (x[: self.num_samples], y[: self.num_samples])
            if train
            else (x[self.num_samples :], y[self.num_samples :])
        )
