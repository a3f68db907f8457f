"""Fashion-MNIST (Zalando): a drop-in MNIST replacement of clothing thumbnails, same IDX files."""

from __future__ import annotations

from typing import ClassVar

from fedshard_lightning.data.download import RemoteFile
from fedshard_lightning.data.mnist import MNISTDataModule

__all__ = ["FashionMNISTDataModule"]

_OFFICIAL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_GITHUB = "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/"


class FashionMNISTDataModule(MNISTDataModule):
    """Fashion-MNIST: 60,000 training and 10,000 test images as uint8 [N, 1, 28, 28], 10 classes.

    Same file names and IDX format as MNIST, read from ``<data_dir>/fashion_mnist``; ``download:
    true`` fetches them from Zalando's S3 bucket (then the GitHub repository), checked against the
    MD5 sums torchvision publishes.

    Args:
        **kwargs: See :class:`~fedshard_lightning.data.base.FederatedDataModule`.
    """

    dataset_name: ClassVar[str] = "Fashion-MNIST"
    folder: ClassVar[str] = "fashion_mnist"
    source: ClassVar[str] = "https://github.com/zalandoresearch/fashion-mnist"
    #: Standard Fashion-MNIST training-set statistics.
    mean = (0.2860,)
    std = (0.3530,)
    resources: ClassVar[tuple[RemoteFile, ...]] = tuple(
        RemoteFile(name, (_OFFICIAL + name, _GITHUB + name), md5=md5, size=size)
        for name, md5, size in (
            ("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d", 26421880),
            ("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe", 29515),
            ("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79", 4422102),
            ("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310", 5148),
        )
    )
