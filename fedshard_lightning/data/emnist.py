"""EMNIST (Cohen et al., 2017): NIST Special Database 19 letters and digits in MNIST's IDX format.

NIST ships every split in one ``gzip.zip`` archive (about 536 MiB); only the chosen split's four
IDX files are extracted. EMNIST images are stored transposed relative to MNIST (column-major);
they are flipped back here so that digits look as in MNIST.
"""

from __future__ import annotations

import gzip
import zipfile
import zlib
from pathlib import Path
from typing import ClassVar

import numpy as np
from torch import Tensor

from fedshard_lightning.data.download import (
    RemoteFile,
    extract,
    find_first,
)
from fedshard_lightning.data.files import FileDataModule
from fedshard_lightning.data.mnist import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, idx_tensors, read_idx
from fedshard_lightning.errors import ConfigError, DataError

__all__ = ["EMNIST_SPLITS", "EMNISTDataModule"]

#: Split name -> number of classes (``letters`` labels are shifted from 1..26 to 0..25).
EMNIST_SPLITS: dict[str, int] = {
    "byclass": 62,
    "bymerge": 47,
    "balanced": 47,
    "letters": 26,
    "digits": 10,
    "mnist": 10,
}


class EMNISTDataModule(FileDataModule):
    """One EMNIST split as uint8 [N, 1, 28, 28] in MNIST orientation.

    Files live in ``<data_dir>/emnist``: either the NIST archive ``gzip.zip`` (read in place) or
    its members ``gzip/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte.gz``, which
    ``download: true`` fetches (MD5 as published by torchvision) and extracts.

    Args:
        split: ``byclass``, ``bymerge``, ``balanced`` (default; 47 balanced classes), ``letters``
            (26 classes, labels 0..25 for a..z), ``digits`` or ``mnist``.
        **kwargs: See :class:`FederatedDataModule`.
    """

    dataset_name: ClassVar[str] = "EMNIST"
    folder: ClassVar[str] = "emnist"
    source: ClassVar[str] = "https://www.nist.gov/itl/products-and-services/emnist-dataset"
    archive_name: ClassVar[str] = "gzip.zip"
    #: Normalisation commonly used for EMNIST-balanced (transposing does not change it).
    mean = (0.1751,)
    std = (0.3332,)
    resources: ClassVar[tuple[RemoteFile, ...]] = (
        RemoteFile(
            "gzip.zip",
            (
                "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",
                "https://www.itl.nist.gov/iaui/vip/cs_links/EMNIST/gzip.zip",
            ),
            md5="58c8d27c78d21e728a6bc7b3cc06412e",
            size=561753746,
        ),
    )

    def __init__(self, *args, split: str = "balanced", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if split not in EMNIST_SPLITS:
            raise ConfigError(f"data.split={split!r}: choose one of {', '.join(EMNIST_SPLITS)}")
        self.split = split

    def members(self) -> list[str]:
        """The archive members of the chosen split."""
        return [
            f"gzip/emnist-{self.split}-{side}-{kind}-ubyte.gz"
            for side in ("train", "test")
            for kind in ("images-idx3", "labels-idx1")
        ]

    def _extracted(self, member: str) -> Path | None:
        name = Path(member).name
        for folder in (self.root / "gzip", self.root):
            found = find_first(folder, (name, name.removesuffix(".gz")))
            if found is not None:
                return found
        return None

    def present(self) -> bool:
        """The split is extracted already."""
        return all(self._extracted(m) is not None for m in self.members())

    def unpack(self, path: Path) -> None:
        """Extract the split's members of ``gzip.zip``."""
        extract(path, self.root, members=self.members())

    def _read(self, member: str, magic: int) -> tuple[Path, np.ndarray]:
        path = self._extracted(member)
        if path is not None:
            return path, read_idx(path, magic)
        archive = self.root / self.archive_name
        if not archive.is_file():
            expected = [f"{self.archive_name} or {', '.join(self.members())}"]
            raise self.missing(expected)
        label = archive / member
        try:
            with zipfile.ZipFile(archive) as zf, zf.open(member) as raw, gzip.GzipFile(fileobj=raw) as f:
                return label, read_idx(label, magic, fileobj=f)
        except KeyError:
            raise DataError(f"{self.dataset_name}: {member} not found in {archive}") from None
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
            raise DataError(f"{self.dataset_name}: {archive} is corrupt ({' '.join(str(e).split())})") from e

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """Read one split's IDX pair, fix the orientation and (for ``letters``) shift labels to 0."""
        image_member, label_member = self.members()[:2] if train else self.members()[2:]
        image_path, images = self._read(image_member, IDX_IMAGES_MAGIC)
        label_path, labels = self._read(label_member, IDX_LABELS_MAGIC)
        images = images.transpose(0, 2, 1)  # stored column-major: back to MNIST orientation
        labels = labels.astype(np.int64)
        if self.split == "letters":
            labels = labels - 1  # a..z are 1..26 in the files
        return idx_tensors(
            self.dataset_name, image_path, label_path, images, labels, EMNIST_SPLITS[self.split]
        )
