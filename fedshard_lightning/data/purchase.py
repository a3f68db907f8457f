"""Purchase-100 (Shokri et al., S&P 2017): 600 binary purchase features, 100 customer clusters.

The membership-inference benchmark derived from Kaggle's "Acquire Valued Shoppers" data: 197,324
customers, each a 0/1 vector over 600 products, labelled with one of 100 k-means clusters. It is
distributed as ``dataset_purchase.tgz`` holding one CSV, ``dataset_purchase``, whose rows are the
label (1..100) followed by the 600 features; many papers re-save it as ``.npz``. It has no
official train/test split, so a seeded split is drawn here. The features are already 0/1, so
``mean``/``std`` are ``None`` (no normalisation in ``transform``).
"""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.data.download import (
    RemoteFile,
    extract,
    find_first,
)
from fedshard_lightning.data.extract import _one_line
from fedshard_lightning.data.files import FileDataModule
from fedshard_lightning.errors import ConfigError, DataError

__all__ = ["PURCHASE_URLS", "Purchase100DataModule", "read_purchase_csv", "read_purchase_npz"]

#: Where the archive is published: the authors' page first, then the privacytrustlab mirror.
PURCHASE_URLS = (
    "https://www.comp.nus.edu.sg/~reza/files/dataset_purchase.tgz",
    "https://github.com/privacytrustlab/datasets/raw/master/dataset_purchase.tgz",
)
_CSV = "dataset_purchase"
_ARCHIVE = "dataset_purchase.tgz"
_NPZ = "purchase100.npz"
_NUM_CLASSES = 100


def _fast_binary_rows(rows: list[bytes]) -> tuple[np.ndarray, np.ndarray] | None:
    """Vectorised parse of ``label,0,1,...`` rows with single-digit 0/1 features; None if not that shape."""
    try:
        heads, tails = zip(*(r.split(b",", 1) for r in rows))
        labels = np.array([int(h) for h in heads], dtype=np.int64)
    except ValueError:
        return None
    width = len(tails[0])
    if width % 2 != 1 or any(len(t) != width for t in tails):
        return None
    buf = np.frombuffer(b"".join(tails), dtype=np.uint8).reshape(len(rows), width)
    digits = buf[:, ::2]
    if not (buf[:, 1::2] == ord(",")).all() or not ((digits == ord("0")) | (digits == ord("1"))).all():
        return None
    return (digits - ord("0")).astype(np.float32), labels


def read_purchase_csv(data: bytes, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Parse the ``dataset_purchase`` CSV (label 1..100 first, then the features).

    Returns:
        float32 features [N, D] and int64 labels 0..99.

    Raises:
        DataError: Rows of different lengths, non-numeric values or labels outside 1..100.
    """
    rows = [r.strip() for r in data.splitlines()]
    rows = [r for r in rows if r]
    if not rows:
        raise DataError(f"{source}: empty Purchase-100 CSV")
    parsed = _fast_binary_rows(rows)
    if parsed is None:  # general path: any numeric CSV
        try:
            table = np.loadtxt(io.BytesIO(b"\n".join(rows)), delimiter=",", dtype=np.float64, ndmin=2)
        except ValueError as e:
            raise DataError(f"{source}: not a numeric CSV of label then features ({_one_line(e)})") from e
        if table.shape[1] < 2 or not np.array_equal(table[:, 0], np.round(table[:, 0])):
            raise DataError(f"{source}: the first column must be an integer label, followed by the features")
        parsed = table[:, 1:].astype(np.float32), table[:, 0].astype(np.int64)
    features, labels = parsed
    if labels.min() < 1 or labels.max() > _NUM_CLASSES:
        raise DataError(f"{source}: labels must lie in 1..100, found {labels.min()}..{labels.max()}")
    return features, labels - 1


def read_purchase_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read an ``.npz`` with ``features``/``labels`` (or ``X``/``Y``); no pickled objects allowed.

    Labels may be class indices (0..99, or 1..100 which are shifted) or one-hot rows.
    """
    try:
        with np.load(path, allow_pickle=False) as npz:
            keys = set(npz.files)
            pair = next((p for p in (("features", "labels"), ("X", "Y")) if set(p) <= keys), None)
            if pair is None:
                raise DataError(f"{path}: expected arrays features/labels or X/Y, found {sorted(keys)}")
            features, labels = npz[pair[0]], npz[pair[1]]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{path}: not a readable .npz file ({_one_line(e)})") from e
    if labels.ndim == 2:
        labels = labels.argmax(axis=1)  # one-hot
    labels = labels.reshape(-1).astype(np.int64)
    if len(labels) and labels.min() >= 1 and labels.max() == _NUM_CLASSES:
        labels = labels - 1  # the CSV's 1-based labels
    if len(labels) and (labels.min() < 0 or labels.max() >= _NUM_CLASSES):
        raise DataError(f"{path}: labels must lie in 0..99 (or 1..100), found {labels.min()}..{labels.max()}")
    return np.asarray(features, dtype=np.float32), labels


class Purchase100DataModule(FileDataModule):
    """Purchase-100 as float32 [N, 600] 0/1 features and 100 classes, with a seeded test split.

    Looks in ``<data_dir>/purchase100`` for ``purchase100.npz``, then the ``dataset_purchase``
    CSV, then the ``dataset_purchase.tgz`` archive (read in place). The archive has no published
    checksum, so ``download: true`` needs one: pass ``archive_sha256`` (of a copy you trust) and it
    is fetched from :data:`PURCHASE_URLS`, verified and extracted; without it the download is
    refused with a message saying where to get the file.

    Args:
        test_fraction: Share of the samples kept as the global test set (seeded, stratified).
        archive_sha256: SHA-256 of ``dataset_purchase.tgz`` that enables ``download: true``.
        **kwargs: See :class:`FederatedDataModule`.
    """

    dataset_name: ClassVar[str] = "Purchase-100"
    folder: ClassVar[str] = "purchase100"
    source: ClassVar[str] = PURCHASE_URLS[0]
    mean = None
    std = None
    #: Files to fetch; empty because no checksum is published (see ``archive_sha256``).
    resources: ClassVar[tuple[RemoteFile, ...]] = ()

    def __init__(
        self, *args, test_fraction: float = 0.2, archive_sha256: str | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        if not 0 < test_fraction < 1:
            raise ConfigError(
                f"data.test_fraction={test_fraction}: must be strictly between 0 and 1 (e.g. 0.2)"
            )
        if isinstance(test_fraction, bool) or not 0 < test_fraction < 1:
            raise ConfigError(f"data.test_fraction={test_fraction!r}: must be in (0, 1), e.g. 0.2")
        self.test_fraction = test_fraction
        self.archive_sha256 = archive_sha256.lower() if archive_sha256 else None
        self._pending_test: tuple[Tensor, Tensor] | None = None

    def remote_files(self) -> tuple[RemoteFile, ...]:
        """The configured resources, or the archive when its SHA-256 is given; refused without a checksum."""
        if self.resources:
            return self.resources
        if self.archive_sha256 is None:
            raise DataError(
                f"{self.dataset_name}: no checksum is published for {_ARCHIVE}, so it is not downloaded "
                f"unverified: fetch {PURCHASE_URLS[0]} yourself and put it (or the extracted {_CSV}) in "
                f"{self.root}, or set data.archive_sha256 to the SHA-256 of a copy you trust"
            )
        try:
            return (RemoteFile(_ARCHIVE, PURCHASE_URLS, sha256=self.archive_sha256),)
        except ValueError as e:
            raise ConfigError(f"data.archive_sha256: {e}") from None

    def present(self) -> bool:
        """A data file (or the archive) is there already."""
        return find_first(self.root, (_NPZ, _CSV, _ARCHIVE)) is not None

    def unpack(self, path: Path) -> None:
        """Extract a fetched archive."""
        if path.name.endswith((".tgz", ".tar.gz")):
            extract(path, self.root)

    def _read_all(self) -> tuple[np.ndarray, np.ndarray]:
        path = find_first(self.root, (_NPZ, _CSV, _ARCHIVE))
        if path is None:
            expected = [f"{_NPZ} or {_CSV} (or {_ARCHIVE})"]
            raise self.missing(expected)
        if path.name == _NPZ:
            return read_purchase_npz(path)
        if path.name == _CSV:
            return read_purchase_csv(path.read_bytes(), str(path))
        try:
            with tarfile.open(path, "r:*") as tar:
                member = next((m for m in tar.getmembers() if m.isfile() and Path(m.name).name == _CSV), None)
                f = tar.extractfile(member) if member is not None else None
                if f is None:
                    raise DataError(f"{path}: no {_CSV} file in the archive")
                data = f.read()
        except (tarfile.TarError, OSError, EOFError) as e:
            raise DataError(f"{path}: corrupt or truncated archive ({_one_line(e)})") from e
        return read_purchase_csv(data, f"{path}:{_CSV}")

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """Read everything once and split it (stratified when every class has two samples)."""
        return self.split_of_both(train, self._read_both)

    def _read_both(self) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        from sklearn.model_selection import train_test_split

        x, y = self._read_all()
        if len(x) != len(y):
            raise DataError(f"{self.dataset_name}: {len(x)} feature rows but {len(y)} labels")
        if x.ndim != 2:
            raise DataError(f"{self.dataset_name}: features must be [N, D], got shape {list(x.shape)}")
        stratify = y if np.bincount(y)[np.unique(y)].min() >= 2 else None
        try:
            train_idx, test_idx = train_test_split(
                np.arange(len(y)), test_size=self.test_fraction, random_state=self.seed, stratify=stratify
            )
        except ValueError:  # too few samples per class for a stratified split of this size
            train_idx, test_idx = train_test_split(
                np.arange(len(y)), test_size=self.test_fraction, random_state=self.seed
            )
        train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)
        train_split = (torch.from_numpy(x[train_idx]), torch.from_numpy(y[train_idx]))
        return train_split, (torch.from_numpy(x[test_idx]), torch.from_numpy(y[test_idx]))
