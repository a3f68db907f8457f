"""CIFAR-100 (Krizhevsky, 2009) from the official "python version" pickles, fine or coarse labels."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np

from fedshard_lightning.data.cifar10 import CIFAR10DataModule, cifar_labels
from fedshard_lightning.data.download import RemoteFile
from fedshard_lightning.errors import ConfigError

__all__ = ["CIFAR100DataModule"]

_LABELS = {"fine": (b"fine_labels", 100), "coarse": (b"coarse_labels", 20)}


class CIFAR100DataModule(CIFAR10DataModule):
    """CIFAR-100: 50,000 training and 10,000 test images as uint8 [N, 3, 32, 32].

    Reads ``cifar-100-python/train`` and ``test`` under ``<data_dir>/cifar100`` (or straight from
    ``cifar-100-python.tar.gz`` there); ``download: true`` fetches the archive from the University
    of Toronto (MD5 as published there and by torchvision) and extracts it. The files are read
    through the same restricted unpickler as CIFAR-10.

    Args:
        label: ``fine`` (100 classes) or ``coarse`` (the 20 superclasses).
        **kwargs: See :class:`~fedshard_lightning.data.base.FederatedDataModule`.
    """

    dataset_name: ClassVar[str] = "CIFAR-100"
    folder: ClassVar[str] = "cifar100"
    archive_name: ClassVar[str] = "cifar-100-python.tar.gz"
    batch_folder: ClassVar[str] = "cifar-100-python"
    train_members: ClassVar[tuple[str, ...]] = ("train",)
    test_members: ClassVar[tuple[str, ...]] = ("test",)
    #: Standard CIFAR-100 training-set per-channel statistics.
    mean = (0.5071, 0.4865, 0.4409)
    std = (0.2673, 0.2564, 0.2762)
    resources: ClassVar[tuple[RemoteFile, ...]] = (
        RemoteFile(
            "cifar-100-python.tar.gz",
            ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",),
            md5="eb9058c3a382ffc7106e4002c42a8d85",
            size=169001437,
        ),
    )

    def __init__(self, *args, label: Literal["fine", "coarse"] = "fine", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if label not in _LABELS:
            raise ConfigError(f"data.label={label!r}: choose fine (100 classes) or coarse (20 superclasses)")
        self.label = label

    def _labels_of(self, batch: dict[bytes, Any], n: int, source: str) -> np.ndarray:
        key, num_classes = _LABELS[self.label]
        return cifar_labels(batch, key, n, num_classes, source)
