from __future__ import annotations

import numpy as np
import pytest
import torch
from native_formats import (
    adult_file_bytes,
    purchase_arrays,
    purchase_csv_bytes,
    purchase_tgz_bytes,
    write_adult_files,
)

from fedshard_lightning.data import AdultDataModule, Purchase100DataModule
from fedshard_lightning.data.adult import ADULT_COLUMNS, read_adult_csv
from fedshard_lightning.data.purchase import read_purchase_csv
from fedshard_lightning.errors import ConfigError, DataError


def test_adult_parses_the_uci_layout(tmp_path):
    parsed = write_adult_files(tmp_path / "adult", n_train=30, n_test=15)
    rows, labels = read_adult_csv(tmp_path / "adult" / "adult.test")
    assert len(rows) == 15  # junk first line, '?' row and blank lines skipped
    assert rows == [r[:-1] for r in parsed["adult.test"]]
    assert labels.tolist() == [int(r[-1] == ">50K.") for r in parsed["adult.test"]]
    assert all(v == v.strip() for r in rows for v in r)


def test_adult_datamodule_encodes_features(tmp_path):
    parsed = write_adult_files(tmp_path / "adult", n_train=30, n_test=15)
    dm = AdultDataModule(data_dir=str(tmp_path), num_clients=3, partition="iid")
    dm.setup()
    train_rows = parsed["adult.data"]
    categorical = [j for j, (_, numeric) in enumerate(ADULT_COLUMNS) if not numeric]
    width = 6 + sum(len({r[j] for r in train_rows}) for j in categorical)
    assert dm.train_x.shape == (30, width) and dm.train_x.dtype == torch.float32
    assert dm.test_x.shape == (15, width) and dm.test_y.dtype == torch.int64
    assert set(dm.train_y.tolist()) == {0, 1} and dm.num_classes == 2
    assert dm.train_y.tolist() == [int(r[-1] == ">50K") for r in train_rows]
    # age is the first column, standardised with the training statistics
    ages = np.array([float(r[0]) for r in train_rows])
    expected = (ages - ages.mean()) / ages.std()
    np.testing.assert_allclose(dm.train_x[:, 0].numpy(), expected, rtol=1e-5, atol=1e-6)
    test_ages = np.array([float(r[0]) for r in parsed["adult.test"]])
    np.testing.assert_allclose(dm.test_x[:, 0].numpy(), (test_ages - ages.mean()) / ages.std(), rtol=1e-5)
    # each categorical attribute contributes exactly one 1 per training row
    numeric = _numeric_positions(train_rows)
    onehot = dm.train_x[:, [c for c in range(width) if c not in numeric]]
    assert set(torch.unique(onehot).tolist()) == {0.0, 1.0}
    torch.testing.assert_close(onehot.sum(1), torch.full((30,), 8.0))
    # mean/std are None: transform passes the already standardised features through
    assert dm.mean is None and dm.std is None
    torch.testing.assert_close(dm.transform(dm.train_x[:4]), dm.train_x[:4])


def _numeric_positions(train_rows) -> list[int]:
    """Column positions of the numeric attributes in the encoded matrix."""
    positions, col = [], 0
    for j, (_, numeric) in enumerate(ADULT_COLUMNS):
        if numeric:
            positions.append(col)
            col += 1
        else:
            col += len({r[j] for r in train_rows})
    return positions


def test_adult_unseen_test_category_is_all_zeros(tmp_path):
    files = adult_file_bytes(n_train=12, n_test=4)
    (tmp_path / "adult").mkdir()
    (tmp_path / "adult" / "adult.data").write_bytes(files["adult.data"])
    test = files["adult.test"].decode().replace("United-States", "Atlantis").replace("Cuba", "Atlantis")
    test = test.replace("India", "Atlantis")
    (tmp_path / "adult" / "adult.test").write_text(test)
    dm = AdultDataModule(data_dir=str(tmp_path), num_clients=2, partition="iid")
    dm.setup()
    countries = len(
        {r.split(", ")[13] for r in files["adult.data"].decode().splitlines() if r.count(",") == 14}
    )
    assert torch.all(dm.test_x[:, -countries:] == 0)


def test_adult_bad_row_names_file_and_line(tmp_path):
    (tmp_path / "adult").mkdir()
    (tmp_path / "adult" / "adult.data").write_text("39, State-gov, 77516\n")
    (tmp_path / "adult" / "adult.test").write_text("")
    with pytest.raises(DataError, match=r"adult\.data:1: 3 fields"):
        AdultDataModule(data_dir=str(tmp_path), num_clients=1).setup()


def _purchase_check(dm, n: int, d: int = 600) -> None:
    dm.setup()
    n_test = len(dm.test_y)
    assert len(dm.train_y) + n_test == n and n_test == pytest.approx(0.2 * n, abs=1)
    assert dm.train_x.shape == (n - n_test, d) and dm.train_x.dtype == torch.float32
    assert dm.train_y.dtype == torch.int64
    assert int(dm.train_y.min()) == 0 and int(dm.train_y.max()) == 99
    assert set(torch.unique(dm.train_x).tolist()) <= {0.0, 1.0}
    assert dm.mean is None and dm.std is None
    torch.testing.assert_close(dm.transform(dm.train_x[:5]), dm.train_x[:5])


def test_purchase_from_csv(tmp_path):
    features, labels = purchase_arrays(400)
    (tmp_path / "purchase100").mkdir()
    (tmp_path / "purchase100" / "dataset_purchase").write_bytes(purchase_csv_bytes(features, labels))
    dm = Purchase100DataModule(data_dir=str(tmp_path), num_clients=4, partition="iid")
    _purchase_check(dm, 400)
    # rows are kept intact through the split: each training row is one of the written rows
    written = {tuple(r) for r in features.tolist()}
    assert all(tuple(int(v) for v in row) in written for row in dm.train_x[:20].tolist())


def test_purchase_from_tgz_and_npz(tmp_path):
    features, labels = purchase_arrays(300, seed=3)
    (tmp_path / "a" / "purchase100").mkdir(parents=True)
    (tmp_path / "a" / "purchase100" / "dataset_purchase.tgz").write_bytes(
        purchase_tgz_bytes(purchase_csv_bytes(features, labels))
    )
    from_tgz = Purchase100DataModule(data_dir=str(tmp_path / "a"), num_clients=2, partition="iid")
    _purchase_check(from_tgz, 300)
    (tmp_path / "b" / "purchase100").mkdir(parents=True)
    np.savez(tmp_path / "b" / "purchase100" / "purchase100.npz", features=features, labels=labels - 1)
    from_npz = Purchase100DataModule(data_dir=str(tmp_path / "b"), num_clients=2, partition="iid")
    _purchase_check(from_npz, 300)
    assert torch.equal(from_npz.train_x, from_tgz.train_x) and torch.equal(from_npz.test_y, from_tgz.test_y)
    (tmp_path / "c" / "purchase100").mkdir(parents=True)
    onehot = np.eye(100, dtype=np.float32)[labels - 1]
    np.savez(tmp_path / "c" / "purchase100" / "purchase100.npz", X=features, Y=onehot)
    from_xy = Purchase100DataModule(data_dir=str(tmp_path / "c"), num_clients=2, partition="iid")
    _purchase_check(from_xy, 300)
    assert torch.equal(from_xy.train_y, from_tgz.train_y)


def test_purchase_split_is_seeded(tmp_path):
    features, labels = purchase_arrays(300)
    (tmp_path / "purchase100").mkdir()
    np.savez(tmp_path / "purchase100" / "purchase100.npz", features=features, labels=labels)

    def make(seed, fraction=0.2):
        dm = Purchase100DataModule(
            data_dir=str(tmp_path), num_clients=2, partition="iid", seed=seed, test_fraction=fraction
        )
        dm.setup()
        return dm

    assert torch.equal(make(0).test_x, make(0).test_x)
    assert not torch.equal(make(0).test_y, make(1).test_y)
    assert len(make(0, 0.5).test_y) == 150
    assert make(0).hparams_for_fingerprint()["test_fraction"] == 0.2
    with pytest.raises(ConfigError, match="test_fraction"):
        Purchase100DataModule(test_fraction=1.0)


def test_purchase_general_csv_path_and_bad_labels():
    features = np.array([[0.5, 1.0], [0.0, 2.0]])
    data = b"1,0.5,1.0\n100,0.0,2.0\n"
    x, y = read_purchase_csv(data, "custom.csv")
    np.testing.assert_allclose(x, features)
    assert y.tolist() == [0, 99]
    with pytest.raises(DataError, match=r"1\.\.100"):
        read_purchase_csv(b"0,1,0\n", "dataset_purchase")
    with pytest.raises(DataError, match="dataset_purchase"):
        read_purchase_csv(b"3,1,x\n", "dataset_purchase")


def test_purchase_missing_files_and_download_refusal(tmp_path):
    dm = Purchase100DataModule(data_dir=str(tmp_path), num_clients=2)
    with pytest.raises(DataError) as info:
        dm.setup()
    message = str(info.value)
    assert "\n" not in message and "Purchase-100" in message and str(tmp_path / "purchase100") in message
    assert "purchase100.npz" in message and "dataset_purchase" in message
    assert "https://" in message and "download: true" in message
    refusing = Purchase100DataModule(data_dir=str(tmp_path), num_clients=2, download=True)
    with pytest.raises(DataError, match="archive_sha256"):
        refusing.prepare_data()


def test_adult_missing_files_error_is_one_line(tmp_path):
    with pytest.raises(DataError) as info:
        AdultDataModule(data_dir=str(tmp_path), num_clients=2).setup()
    message = str(info.value)
    assert "\n" not in message and "Adult" in message and str(tmp_path / "adult") in message
    assert "adult.data" in message and "adult.test" in message
    assert "https://archive.ics.uci.edu" in message and "download: true" in message


def test_corrupt_purchase_archive_error_is_one_line(tmp_path):
    """tarfile lists every compression it tried on separate lines; the DataError keeps one."""
    (tmp_path / "purchase100").mkdir()
    (tmp_path / "purchase100" / "dataset_purchase.tgz").write_bytes(b"\x1f\x8b" + b"0" * 100)
    dm = Purchase100DataModule(num_clients=2, partition="iid", min_client_size=1, data_dir=str(tmp_path))
    with pytest.raises(DataError, match="corrupt or truncated") as info:
        dm.setup()
    assert "\n" not in str(info.value)
