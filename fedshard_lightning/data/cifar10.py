"""CIFAR-10 (Krizhevsky, 2009) from the official "python version" pickle batches.

The format is a pickled dict per batch, so reading it needs ``pickle``; a plain ``pickle.load``
would run any code a tampered file asks for. :func:`read_cifar_batch` therefore unpickles through
:class:`RestrictedUnpickler`, which resolves only the few globals a numpy array needs and refuses
everything else with a :class:`~fedshard_lightning.errors.DataError`.
"""

from __future__ import annotations

import builtins
import codecs
import io
import pickle
import tarfile
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.data.download import RemoteFile, extract, missing_files_error
from fedshard_lightning.data.extract import _one_line
from fedshard_lightning.data.files import FileDataModule
from fedshard_lightning.errors import DataError

__all__ = ["CIFAR10DataModule", "RestrictedUnpickler", "read_cifar_batch", "read_cifar_batches"]

_RECONSTRUCT = np.zeros(1).__reduce__()[0]  # numpy's ndarray rebuild function, wherever it lives
_FROMBUFFER = np.zeros(1).__reduce_ex__(5)[0]
_SCALAR = np.int64(0).__reduce__()[0]
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(m, "_reconstruct"): _RECONSTRUCT for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(m, "scalar"): _SCALAR for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(m, "_frombuffer"): _FROMBUFFER for m in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    # Python 3 pickles of protocol <= 2 spell bytes as _codecs.encode(str, "latin1").
    ("_codecs", "encode"): codecs.encode,
    **{(m, n): getattr(builtins, n) for m in ("builtins", "__builtin__") for n in ("dict", "list", "bytes")},
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for data files: dicts, lists, bytes, numbers and numpy arrays, nothing callable else.

    Args:
        file: Binary stream to read.
        source: Name of the file, for error messages.
    """

    def __init__(self, file: BinaryIO, source: str) -> None:
        super().__init__(file, encoding="bytes")
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        """Resolve only allow-listed globals; anything else means the file is not plain data."""
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise DataError(
                f"{self.source}: refusing to unpickle {module}.{name}: a dataset pickle holds only "
                "dicts, lists, bytes and numpy arrays (corrupt or tampered file?)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        """Data files have no persistent references."""
        raise DataError(f"{self.source}: refusing a persistent reference in a dataset pickle")


def read_cifar_batch(data: bytes | BinaryIO, source: str) -> dict[bytes, Any]:
    """Unpickle one CIFAR batch (``data_batch_1``, ``test_batch``, ``train``...) safely.

    Args:
        data: The pickle bytes or a binary stream.
        source: File name for error messages.

    Returns:
        The batch dict with byte-string keys (``b"data"``, ``b"labels"``...).
    """
    stream = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
    try:
        batch = RestrictedUnpickler(stream, source).load()
    except DataError:
        raise
    except Exception as e:  # any unpickling failure of a data file is a corrupt file
        raise DataError(f"{source}: not a readable CIFAR pickle ({type(e).__name__}: {e})") from e
    if not isinstance(batch, dict) or b"data" not in batch:
        raise DataError(f"{source}: not a CIFAR batch (expected a dict with a b'data' entry)")
    return batch


def read_cifar_batches(
    root: Path,
    folder: str,
    archive: str,
    members: list[str],
    dataset: str,
    source: str,
    all_members: list[str] | None = None,
) -> dict[str, dict[bytes, Any]]:
    """Read the named batches from ``root/folder`` or, if not extracted, straight from the archive.

    ``all_members`` (default ``members``) are the batch files named in the missing-files error.

    Raises:
        DataError: The one-line missing-files error when neither is there, or a corrupt file.
    """
    extracted = [root / folder / m for m in members]
    if all(p.is_file() for p in extracted):
        return {m: read_cifar_batch(p.read_bytes(), str(p)) for m, p in zip(members, extracted)}
    tar_path = root / archive
    if not tar_path.is_file():
        expected = [f"{archive} (or its extracted {folder}/: {', '.join(all_members or members)})"]
        raise missing_files_error(dataset, root, expected, source)
    out: dict[str, dict[bytes, Any]] = {}
    try:
        with tarfile.open(tar_path, "r:*") as tar:
            for m in members:
                try:
                    f = tar.extractfile(f"{folder}/{m}")
                except KeyError:
                    f = None
                if f is None:
                    raise DataError(f"{dataset}: {folder}/{m} not found in {tar_path}")
                out[m] = read_cifar_batch(f.read(), f"{tar_path}:{folder}/{m}")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{dataset}: {tar_path} is corrupt or truncated ({_one_line(e)})") from e
    return out


def cifar_images(batch: dict[bytes, Any], source: str) -> np.ndarray:
    """The ``b"data"`` rows (R, G, B planes of 32 x 32) as uint8 [N, 3, 32, 32]."""
    data = batch[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise DataError(
            f"{source}: b'data' must be a uint8 array of N x 3072, got {type(data).__name__} {shape}"
        )
    return data.reshape(-1, 3, 32, 32)


def cifar_labels(batch: dict[bytes, Any], key: bytes, n: int, num_classes: int, source: str) -> np.ndarray:
    """One label list of a batch as int64, checked for length and range."""
    if key not in batch:
        raise DataError(f"{source}: no {key!r} entry in the batch")
    labels = np.asarray(batch[key], dtype=np.int64).reshape(-1)
    if len(labels) != n:
        raise DataError(f"{source}: {len(labels)} labels for {n} images")
    if n and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"{source}: labels outside 0..{num_classes - 1}")
    return labels


class CIFAR10DataModule(FileDataModule):
    """CIFAR-10: 50,000 training and 10,000 test images as uint8 [N, 3, 32, 32], 10 classes.

    Reads ``cifar-10-batches-py/data_batch_1..5`` and ``test_batch`` under ``<data_dir>/cifar10``
    (or straight from ``cifar-10-python.tar.gz`` there); ``download: true`` fetches the archive
    from the University of Toronto (MD5 as published there and by torchvision) and extracts it.

    Args:
        **kwargs: See :class:`FederatedDataModule`.
    """

    dataset_name: ClassVar[str] = "CIFAR-10"
    folder: ClassVar[str] = "cifar10"
    source: ClassVar[str] = "https://www.cs.toronto.edu/~kriz/cifar.html"
    archive_name: ClassVar[str] = "cifar-10-python.tar.gz"
    batch_folder: ClassVar[str] = "cifar-10-batches-py"
    train_members: ClassVar[tuple[str, ...]] = tuple(f"data_batch_{i}" for i in range(1, 6))
    test_members: ClassVar[tuple[str, ...]] = ("test_batch",)
    #: Standard CIFAR-10 training-set per-channel statistics.
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)
    resources: ClassVar[tuple[RemoteFile, ...]] = (
        RemoteFile(
            "cifar-10-python.tar.gz",
            ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
            md5="c58f30108f718f92721af3b95e74349a",
            size=170498071,
        ),
    )

    def _all_members(self) -> list[str]:
        return [*self.train_members, *self.test_members]

    def present(self) -> bool:
        """Every batch is extracted already."""
        return all((self.root / self.batch_folder / m).is_file() for m in self._all_members())

    def unpack(self, path: Path) -> None:
        """Extract the archive."""
        extract(path, self.root)

    def _labels_of(self, batch: dict[bytes, Any], n: int, source: str) -> np.ndarray:
        return cifar_labels(batch, b"labels", n, 10, source)

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """Concatenate the split's batches into uint8 [N, 3, 32, 32] and int64 [N]."""
        members = list(self.train_members if train else self.test_members)
        batches = read_cifar_batches(
            self.root,
            self.batch_folder,
            self.archive_name,
            members,
            self.dataset_name,
            self.source,
            all_members=self._all_members(),
        )
        images, labels = [], []
        for name, batch in batches.items():
            source = f"{self.root / self.batch_folder / name}"
            x = cifar_images(batch, source)
            images.append(x)
            labels.append(self._labels_of(batch, len(x), source))
        x = np.concatenate(images) if len(images) > 1 or not images[0].flags.writeable else images[0]
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.concatenate(labels))
