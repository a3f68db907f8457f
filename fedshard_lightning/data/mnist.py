"""MNIST handwritten digits, read from the original IDX files (gzipped or not).

Also home of :func:`read_idx`, the IDX parser that Fashion-MNIST and EMNIST share: it checks the
magic number and that the data length matches the announced dimensions, so a wrong or truncated
file is a one-line :class:`~fedshard_lightning.errors.DataError`, not a numpy traceback.
"""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path
from typing import BinaryIO, ClassVar

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.data.download import RemoteFile
from fedshard_lightning.data.files import FileDataModule
from fedshard_lightning.errors import DataError

__all__ = ["IDX_IMAGES_MAGIC", "IDX_LABELS_MAGIC", "MNISTDataModule", "idx_tensors", "read_idx"]

#: Magic number of an IDX file of unsigned bytes with one dimension (labels).
IDX_LABELS_MAGIC = 2049
#: Magic number of an IDX file of unsigned bytes with three dimensions (images).
IDX_IMAGES_MAGIC = 2051
_IDX_TYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_MAX_IDX_BYTES = 1 << 36  # a header announcing more than 64 GiB is corrupt, not a dataset


def _open(path: Path) -> BinaryIO:
    """Open raw or gzip-compressed (recognised by its magic bytes, not its name)."""
    with open(path, "rb") as f:
        head = f.read(2)
    return gzip.open(path, "rb") if head == b"\x1f\x8b" else open(path, "rb")


def _read_fully(f: BinaryIO, view: memoryview) -> int:
    filled = 0
    while filled < len(view):
        n = f.readinto(view[filled:])
        if not n:
            break
        filled += n
    return filled


def read_idx(path: Path, expected_magic: int | None = None, fileobj: BinaryIO | None = None) -> np.ndarray:
    """Parse an IDX file (LeCun's MNIST format), raw or gzip-compressed.

    Args:
        path: The file (with ``fileobj``: only its name, for messages).
        expected_magic: Required magic number, e.g. :data:`IDX_IMAGES_MAGIC` (2051) or
            :data:`IDX_LABELS_MAGIC` (2049); ``None`` accepts any valid IDX header.
        fileobj: An already open, decompressed stream to read instead of ``path`` (e.g. a
            member of a zip archive).

    Returns:
        The array, with the dimensions from the header, in native byte order.

    Raises:
        DataError: Wrong magic number, truncated or oversized data, or a corrupt gzip stream;
            the message names the file.
    """
    path = Path(path)
    try:
        if fileobj is not None:
            out = _parse_idx(fileobj, path, expected_magic)
        else:
            with _open(path) as f:
                out = _parse_idx(f, path, expected_magic)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: unreadable or corrupt IDX file ({' '.join(str(e).split())})") from e
    if out.dtype.byteorder == ">":
        out = out.astype(out.dtype.newbyteorder("="))
    return out


def _parse_idx(f: BinaryIO, path: Path, expected_magic: int | None) -> np.ndarray:
    header = f.read(4)
    if len(header) < 4:
        raise DataError(f"{path}: truncated IDX file ({len(header)} bytes, no complete header)")
    magic = int.from_bytes(header, "big")
    valid = header[:2] == b"\0\0" and header[2] in _IDX_TYPES and header[3] > 0
    if not valid or (expected_magic is not None and magic != expected_magic):
        wanted = expected_magic if expected_magic is not None else "a valid IDX magic number"
        raise DataError(
            f"{path}: not the expected IDX file: magic number {magic} (0x{magic:08x}), expected {wanted}"
        )
    ndim = header[3]
    raw_dims = f.read(4 * ndim)
    if len(raw_dims) < 4 * ndim:
        raise DataError(f"{path}: truncated IDX file (header announces {ndim} dimensions)")
    dims = tuple(int.from_bytes(raw_dims[4 * i : 4 * i + 4], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_TYPES[header[2]])
    nbytes = math.prod(dims) * dtype.itemsize
    if nbytes > _MAX_IDX_BYTES:
        raise DataError(f"{path}: corrupt IDX header (dimensions {dims} are implausible)")
    out = np.empty(math.prod(dims), dtype=dtype)
    got = _read_fully(f, memoryview(out).cast("B"))
    if got < nbytes:
        raise DataError(
            f"{path}: truncated IDX file: dimensions {dims} need {nbytes} bytes of data, found {got}"
        )
    if f.read(1):
        raise DataError(f"{path}: corrupt IDX file: data continues past dimensions {dims}")
    return out.reshape(dims)


class MNISTDataModule(FileDataModule):
    """MNIST: 60,000 training and 10,000 test digits as uint8 [N, 1, 28, 28], 10 classes.

    Reads ``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
    ``t10k-images-idx3-ubyte.gz`` and ``t10k-labels-idx1-ubyte.gz`` (or the same names without
    ``.gz``) from ``<data_dir>/mnist``; ``download: true`` fetches them, checked against the MD5
    sums torchvision publishes.

    Args:
        **kwargs: See :class:`FederatedDataModule`.
    """

    #: Name used in messages.
    dataset_name: ClassVar[str] = "MNIST"
    #: Sub-folder of ``data_dir`` holding the files.
    folder: ClassVar[str] = "mnist"
    #: Where to get the files by hand (named in the missing-files error).
    source: ClassVar[str] = "https://ossci-datasets.s3.amazonaws.com/mnist/"
    #: Classes the labels must lie in.
    label_count: ClassVar[int] = 10
    #: Standard MNIST training-set statistics.
    mean = (0.1307,)
    std = (0.3081,)
    #: Official site first, then the PyTorch S3 mirror; MD5 as published by torchvision.
    resources: ClassVar[tuple[RemoteFile, ...]] = tuple(
        RemoteFile(
            name,
            (
                f"http://yann.lecun.com/exdb/mnist/{name}",
                f"https://ossci-datasets.s3.amazonaws.com/mnist/{name}",
            ),
            md5=md5,
            size=size,
        )
        for name, md5, size in (
            ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873", 9912422),
            ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432", 28881),
            ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3", 1648877),
            ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c", 4542),
        )
    )

    def remote_files(self) -> tuple[RemoteFile, ...]:
        """The ``.gz`` files to fetch, less those only present uncompressed (read as they are).

        A ``.gz`` that is there is still verified; an uncompressed twin has no published checksum
        to verify, but :meth:`read_split` reads it, so fetching its ``.gz`` only costs a download
        (and fails offline with the shipped ``download: true``).
        """
        return tuple(
            f
            for f in self.resources
            if (self.root / f.name).exists() or not (self.root / f.name.removesuffix(".gz")).is_file()
        )

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """Read one split's image and label IDX files into uint8 [N, 1, H, W] and int64 [N]."""
        prefix = "train" if train else "t10k"
        image_path = self.locate(f"{prefix}-images-idx3-ubyte.gz")
        label_path = self.locate(f"{prefix}-labels-idx1-ubyte.gz")
        images = read_idx(image_path, IDX_IMAGES_MAGIC)
        labels = read_idx(label_path, IDX_LABELS_MAGIC).astype(np.int64)
        return idx_tensors(self.dataset_name, image_path, label_path, images, labels, self.label_count)


def idx_tensors(
    dataset: str, image_path: Path, label_path: Path, images: np.ndarray, labels: np.ndarray, label_count: int
) -> tuple[Tensor, Tensor]:
    """Cross-check an IDX image/label pair and wrap it as [N, 1, H, W] uint8 and int64 tensors."""
    if len(images) != len(labels):
        raise DataError(
            f"{dataset}: {image_path.name} holds {len(images)} images but {label_path.name} "
            f"holds {len(labels)} labels"
        )
    if len(labels) and (labels.min() < 0 or labels.max() >= label_count):
        raise DataError(
            f"{dataset}: {label_path} has labels in [{labels.min()}, {labels.max()}], "
            f"expected 0..{label_count - 1}"
        )
    return torch.from_numpy(np.ascontiguousarray(images[:, None])), torch.from_numpy(labels)
