"""SVHN (Netzer et al., 2011): Street View house-number digits, cropped 32 x 32 format (.mat files)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.data.download import RemoteFile
from fedshard_lightning.data.files import FileDataModule
from fedshard_lightning.errors import DataError

__all__ = ["SVHNDataModule"]

_BASE = "http://ufldl.stanford.edu/housenumbers/"


class SVHNDataModule(FileDataModule):
    """SVHN: 73,257 training and 26,032 test digits as uint8 [N, 3, 32, 32], 10 classes.

    Reads ``train_32x32.mat`` and ``test_32x32.mat`` (MATLAB files with ``X`` of shape
    [32, 32, 3, N] and ``y`` of shape [N, 1], where label 10 means digit 0) from
    ``<data_dir>/svhn``; ``download: true`` fetches them from Stanford (MD5 as published by
    torchvision). The ``extra`` set is not used.

    Args:
        **kwargs: See :class:`FederatedDataModule`.
    """

    dataset_name: ClassVar[str] = "SVHN"
    folder: ClassVar[str] = "svhn"
    source: ClassVar[str] = _BASE
    #: Standard SVHN training-set per-channel statistics.
    mean = (0.4377, 0.4438, 0.4728)
    std = (0.1980, 0.2010, 0.1970)
    resources: ClassVar[tuple[RemoteFile, ...]] = (
        RemoteFile(
            "train_32x32.mat",
            (_BASE + "train_32x32.mat",),
            md5="e26dedcc434d2e4c54c9b2d4a06d8373",
            size=182040794,
        ),
        RemoteFile(
            "test_32x32.mat",
            (_BASE + "test_32x32.mat",),
            md5="eb5a983be6a315427106f1b164d9cef3",
            size=64275384,
        ),
    )

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """Read ``X``/``y`` from the split's .mat file into uint8 [N, 3, 32, 32] and int64 [N] (10 -> 0)."""
        from scipy.io import loadmat

        path = self.root / ("train_32x32.mat" if train else "test_32x32.mat")
        if not path.is_file():
            raise self.missing()
        try:
            mat = loadmat(path, variable_names=["X", "y"])
        except Exception as e:  # scipy raises ValueError, MatReadError, OSError... for a bad file
            raise DataError(f"{path}: not a readable MATLAB file ({type(e).__name__}: {e})") from e
        if "X" not in mat or "y" not in mat:
            raise DataError(
                f"{path}: expected MATLAB variables X and y, found {sorted(k for k in mat if k[0] != '_')}"
            )
        x, y = mat["X"], np.asarray(mat["y"]).reshape(-1)
        if x.ndim != 4 or x.shape[2] != 3 or x.dtype != np.uint8:
            raise DataError(f"{path}: X must be uint8 of shape [H, W, 3, N], got {x.dtype} {list(x.shape)}")
        if x.shape[3] != len(y):
            raise DataError(f"{path}: X holds {x.shape[3]} images but y holds {len(y)} labels")
        if len(y) and (y.min() < 1 or y.max() > 10):
            raise DataError(f"{path}: labels must lie in 1..10 (10 is digit 0), found {y.min()}..{y.max()}")
        images = np.ascontiguousarray(x.transpose(3, 2, 0, 1))  # [H, W, C, N] -> [N, C, H, W]
        labels = (y.astype(np.int64)) % 10
        return torch.from_numpy(images), torch.from_numpy(labels)
