"""UCI Adult / Census Income (Kohavi & Becker, 1996): predict income > 50K from 14 attributes.

Preprocessing is the usual one: rows with a missing value (``?``) are dropped, categorical
attributes are one-hot encoded with the categories seen in the training file, numeric attributes
are standardised with the training mean and standard deviation. The features are therefore
already standardised floats, so the datamodule's ``mean``/``std`` stay ``None`` (no second
normalisation in :meth:`~fedshard_lightning.data.base.FederatedDataModule.transform`).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.data.download import RemoteFile
from fedshard_lightning.data.extract import _one_line
from fedshard_lightning.data.files import FileDataModule
from fedshard_lightning.errors import DataError

__all__ = ["ADULT_COLUMNS", "AdultDataModule", "encode_adult", "read_adult_csv"]

_BASE = "https://archive.ics.uci.edu/ml/machine-learning-databases/adult/"

#: The 14 attributes in file order, with whether each is numeric.
ADULT_COLUMNS: tuple[tuple[str, bool], ...] = (
    ("age", True),
    ("workclass", False),
    ("fnlwgt", True),
    ("education", False),
    ("education-num", True),
    ("marital-status", False),
    ("occupation", False),
    ("relationship", False),
    ("race", False),
    ("sex", False),
    ("capital-gain", True),
    ("capital-loss", True),
    ("hours-per-week", True),
    ("native-country", False),
)
_LABELS = {"<=50K": 0, ">50K": 1}


def read_adult_csv(path: Path) -> tuple[list[list[str]], np.ndarray]:
    """Parse ``adult.data`` or ``adult.test`` into attribute rows and 0/1 labels.

    Strips the spaces after commas, skips blank lines and the ``|1x3 Cross validator`` first
    line of ``adult.test``, drops rows with a missing value (``?``) and accepts the test file's
    labels with a trailing ``.``.

    Raises:
        DataError: A row without 15 fields or with an unknown label (names file and line).
    """
    rows: list[list[str]] = []
    labels: list[int] = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for line_no, fields in enumerate(csv.reader(f, skipinitialspace=True), start=1):
                if not fields or (len(fields) == 1 and not fields[0].strip()) or fields[0].startswith("|"):
                    continue
                fields = [v.strip() for v in fields]
                if len(fields) != len(ADULT_COLUMNS) + 1:
                    raise DataError(
                        f"{path}:{line_no}: {len(fields)} fields, expected {len(ADULT_COLUMNS) + 1} "
                        "(14 attributes and the income label)"
                    )
                if "?" in fields:
                    continue
                label = fields[-1].rstrip(".")
                if label not in _LABELS:
                    raise DataError(f"{path}:{line_no}: income label {fields[-1]!r}, expected <=50K or >50K")
                rows.append(fields[:-1])
                labels.append(_LABELS[label])
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: not a readable Adult CSV file ({_one_line(e)})") from e
    return rows, np.asarray(labels, dtype=np.int64)


def encode_adult(train_rows: list[list[str]], test_rows: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """One-hot the categorical attributes (training categories) and standardise the numeric ones.

    Categories that only occur in the test rows encode as all zeros; the numeric mean and
    standard deviation come from the training rows only.

    Returns:
        Training and test features as float32 [N, D], columns in attribute order.
    """
    train_cols, test_cols = [], []
    for j, (name, numeric) in enumerate(ADULT_COLUMNS):
        tr = [r[j] for r in train_rows]
        te = [r[j] for r in test_rows]
        if numeric:
            try:
                a, b = np.asarray(tr, dtype=np.float64), np.asarray(te, dtype=np.float64)
            except ValueError as e:
                raise DataError(f"Adult: attribute {name} must be numeric ({_one_line(e)})") from e
            mu = a.mean() if len(a) else 0.0
            sd = a.std() if len(a) else 1.0
            sd = sd if sd > 0 else 1.0
            train_cols.append(((a - mu) / sd)[:, None])
            test_cols.append(((b - mu) / sd)[:, None])
        else:
            categories = {c: i for i, c in enumerate(sorted(set(tr)))}
            for values, out in ((tr, train_cols), (te, test_cols)):
                onehot = np.zeros((len(values), len(categories)))
                idx = np.fromiter((categories.get(v, -1) for v in values), dtype=np.int64, count=len(values))
                known = idx >= 0
                onehot[np.flatnonzero(known), idx[known]] = 1.0
                out.append(onehot)
    return np.hstack(train_cols).astype(np.float32), np.hstack(test_cols).astype(np.float32)


class AdultDataModule(FileDataModule):
    """Adult: 30,162 training and 15,060 test rows (after dropping missing values), 2 classes.

    Reads ``adult.data`` and ``adult.test`` from ``<data_dir>/adult``; ``download: true`` fetches
    them from the UCI repository (MD5 as used by catboost's and other public loaders). Features
    are float32 [N, 104] with the real files: 6 standardised numeric attributes and 98 one-hot
    columns. ``mean``/``std`` are ``None`` because the features are standardised here already.

    Args:
        **kwargs: See :class:`FederatedDataModule`.
    """

    dataset_name: ClassVar[str] = "Adult"
    folder: ClassVar[str] = "adult"
    source: ClassVar[str] = _BASE
    mean = None
    std = None
    resources: ClassVar[tuple[RemoteFile, ...]] = (
        RemoteFile(
            "adult.data",
            (_BASE + "adult.data",),
            md5="5d7c39d7b8804f071cdd1f2a7c460872",
            size=3974305,
        ),
        RemoteFile(
            "adult.test",
            (_BASE + "adult.test",),
            md5="35238206dfdf7f1fe215bbb874adecdc",
            size=2003153,
        ),
    )

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """Parse and encode both files together (the test encoding needs the training statistics)."""
        return self.split_of_both(train, self._read_both)

    def _read_both(self) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        paths = [self.root / f.name for f in self.resources]
        if not all(p.is_file() for p in paths):
            raise self.missing()
        (train_rows, y_train), (test_rows, y_test) = read_adult_csv(paths[0]), read_adult_csv(paths[1])
        if not train_rows:
            raise DataError(f"{paths[0]}: no complete rows")
        x_train, x_test = encode_adult(train_rows, test_rows)
        return (torch.from_numpy(x_train), torch.from_numpy(y_train)), (
            torch.from_numpy(x_test),
            torch.from_numpy(y_test),
        )
