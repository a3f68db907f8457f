from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch
from native_formats import emnist_zip_bytes, idx_bytes, write_idx, write_mnist_files

from fedshard_lightning.data import EMNISTDataModule, FashionMNISTDataModule, MNISTDataModule
from fedshard_lightning.data.mnist import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, read_idx
from fedshard_lightning.errors import ConfigError, DataError


def _check_normalisation(dm, mean: float, std: float) -> None:
    x = dm.train_x[:3]
    expected = (x.float() / 255.0 - mean) / std
    torch.testing.assert_close(dm.transform(x), expected)
    value = int(x[0, 0, 0, 0])
    assert dm.transform(x)[0, 0, 0, 0].item() == pytest.approx((value / 255.0 - mean) / std, rel=1e-5)


@pytest.mark.parametrize(
    ("cls", "folder", "mean", "std"),
    [(MNISTDataModule, "mnist", 0.1307, 0.3081), (FashionMNISTDataModule, "fashion_mnist", 0.2860, 0.3530)],
)
@pytest.mark.parametrize("compress", [True, False])
def test_mnist_format_loads(tmp_path, cls, folder, mean, std, compress):
    written = write_mnist_files(tmp_path / folder, n_train=40, n_test=20, compress=compress)
    dm = cls(data_dir=str(tmp_path), num_clients=4, partition="iid")
    dm.prepare_data()  # download is off: does nothing
    dm.setup()
    assert dm.train_x.shape == (40, 1, 28, 28) and dm.train_x.dtype == torch.uint8
    assert dm.test_x.shape == (20, 1, 28, 28) and dm.test_x.dtype == torch.uint8
    assert dm.train_y.dtype == torch.int64 and int(dm.train_y.min()) >= 0 and int(dm.train_y.max()) <= 9
    assert np.array_equal(dm.train_x[:, 0].numpy(), written["train"][0])
    assert np.array_equal(dm.test_y.numpy(), written["test"][1])
    assert dm.num_classes == 10
    assert sorted(torch.cat(dm.client_indices).tolist()) == list(range(40))
    assert dm.mean == (mean,) and dm.std == (std,)
    _check_normalisation(dm, mean, std)


@pytest.mark.parametrize(("split", "classes"), [("balanced", 47), ("letters", 26), ("digits", 10)])
def test_emnist_from_archive_and_extracted(tmp_path, split, classes):
    data, written = emnist_zip_bytes(split, classes=classes)
    root = tmp_path / "emnist"
    root.mkdir()
    (root / "gzip.zip").write_bytes(data)
    dm = EMNISTDataModule(data_dir=str(tmp_path), split=split, num_clients=3, partition="iid")
    dm.setup()  # read straight from the archive
    assert dm.train_x.shape == (60, 1, 28, 28) and dm.train_x.dtype == torch.uint8
    assert dm.test_x.shape == (30, 1, 28, 28)
    # orientation fixed: the loaded images are the untransposed originals
    assert np.array_equal(dm.train_x[:, 0].numpy(), written["train"][0])
    first = 1 if split == "letters" else 0
    assert np.array_equal(dm.train_y.numpy(), written["train"][1].astype(np.int64) - first)
    assert int(dm.train_y.min()) == 0 and int(dm.train_y.max()) == classes - 1
    assert dm.num_classes == classes
    _check_normalisation(dm, 0.1751, 0.3332)
    # the same data from extracted members
    from fedshard_lightning.data.download import extract

    (tmp_path / "b").mkdir()
    extract(root / "gzip.zip", tmp_path / "b" / "emnist", members=dm.members())
    dm2 = EMNISTDataModule(data_dir=str(tmp_path / "b"), split=split, num_clients=3, partition="iid")
    dm2.setup()
    assert torch.equal(dm2.train_x, dm.train_x) and torch.equal(dm2.test_y, dm.test_y)


def test_emnist_orientation_of_a_single_stroke(tmp_path):
    image = np.zeros((1, 28, 28), dtype=np.uint8)
    image[0, 2, 20] = 255  # row 2, column 20: a mark near the top right
    root = tmp_path / "emnist" / "gzip"
    write_idx(root / "emnist-mnist-train-images-idx3-ubyte.gz", np.repeat(image.transpose(0, 2, 1), 2, 0))
    write_idx(root / "emnist-mnist-train-labels-idx1-ubyte.gz", np.array([0, 1], dtype=np.uint8))
    write_idx(root / "emnist-mnist-test-images-idx3-ubyte.gz", image.transpose(0, 2, 1))
    write_idx(root / "emnist-mnist-test-labels-idx1-ubyte.gz", np.array([3], dtype=np.uint8))
    dm = EMNISTDataModule(data_dir=str(tmp_path), split="mnist", num_clients=1, partition="iid")
    dm.setup()
    assert dm.test_x[0, 0, 2, 20] == 255 and dm.test_x[0, 0, 20, 2] == 0


def test_emnist_rejects_unknown_split():
    with pytest.raises(ConfigError) as info:
        EMNISTDataModule(split="bogus")
    for name in ("byclass", "bymerge", "balanced", "letters", "digits", "mnist"):
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("cls", "names"),
    [
        (MNISTDataModule, ["train-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]),
        (FashionMNISTDataModule, ["train-images-idx3-ubyte.gz"]),
        (EMNISTDataModule, ["gzip.zip", "gzip/emnist-balanced-train-images-idx3-ubyte.gz"]),
    ],
)
def test_missing_files_error_is_one_line(tmp_path, cls, names):
    dm = cls(data_dir=str(tmp_path), num_clients=2)
    dm.prepare_data()  # download is off: nothing fetched, no error yet
    with pytest.raises(DataError) as info:
        dm.setup()
    message = str(info.value)
    assert "\n" not in message
    assert cls.dataset_name in message
    assert str(tmp_path / cls.folder) in message
    for name in names:
        assert name in message
    assert "https://" in message and "download: true" in message


def test_read_idx_roundtrip_raw_and_gz(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    raw = write_idx(tmp_path / "raw-idx3-ubyte", images, compress=False)
    gz = write_idx(tmp_path / "img-idx3-ubyte.gz", images)
    assert np.array_equal(read_idx(raw, IDX_IMAGES_MAGIC), images)
    assert np.array_equal(read_idx(gz, IDX_IMAGES_MAGIC), images)
    ints = np.array([1, -2, 300], dtype=">i4")
    path = tmp_path / "ints-idx1"
    path.write_bytes((0x0C01).to_bytes(4, "big") + (3).to_bytes(4, "big") + ints.tobytes())
    assert read_idx(path).tolist() == [1, -2, 300]


def test_wrong_magic_number_names_the_file(tmp_path):
    labels = write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(5, dtype=np.uint8))
    with pytest.raises(DataError) as info:
        read_idx(labels, IDX_IMAGES_MAGIC)
    message = str(info.value)
    assert "train-labels-idx1-ubyte.gz" in message and "2049" in message and "2051" in message
    assert "\n" not in message
    junk = tmp_path / "junk"
    junk.write_bytes(b"PK\x03\x04 not an idx file")
    with pytest.raises(DataError, match="junk"):
        read_idx(junk)


def test_wrong_magic_number_through_the_datamodule(tmp_path):
    write_mnist_files(tmp_path / "mnist")
    swapped = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    swapped.write_bytes((tmp_path / "mnist" / "train-labels-idx1-ubyte.gz").read_bytes())
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz.*magic number 2049"):
        MNISTDataModule(data_dir=str(tmp_path), num_clients=2).setup()


@pytest.mark.parametrize("compress", [True, False])
def test_truncated_idx_is_a_data_error(tmp_path, compress):
    images = np.ones((10, 28, 28), dtype=np.uint8)
    data = idx_bytes(images)[:-100]
    path = tmp_path / ("t-idx3-ubyte.gz" if compress else "t-idx3-ubyte")
    path.write_bytes(gzip.compress(data) if compress else data)
    with pytest.raises(DataError) as info:
        read_idx(path, IDX_IMAGES_MAGIC)
    assert "truncated" in str(info.value) and path.name in str(info.value)


def test_truncated_gzip_stream_is_a_data_error(tmp_path):
    path = tmp_path / "cut-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros(5000, dtype=np.uint8)))[:40])
    with pytest.raises(DataError, match=r"cut-idx1-ubyte\.gz"):
        read_idx(path, IDX_LABELS_MAGIC)


@pytest.mark.parametrize("tail", [b"", b"\x00\x00", b"\x00\x00\x08\x03\x00\x00"])
def test_truncated_header_is_a_data_error(tmp_path, tail):
    path = tmp_path / "h-idx3-ubyte"
    path.write_bytes(tail)
    with pytest.raises(DataError, match="h-idx3-ubyte"):
        read_idx(path)


def test_mismatched_image_and_label_counts(tmp_path):
    write_mnist_files(tmp_path / "mnist")
    write_idx(tmp_path / "mnist" / "train-labels-idx1-ubyte.gz", np.zeros(3, dtype=np.uint8))
    with pytest.raises(DataError, match=r"40 images but .* 3 labels"):
        MNISTDataModule(data_dir=str(tmp_path), num_clients=2).setup()
