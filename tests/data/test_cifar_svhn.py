from __future__ import annotations

import io
import pickle
import tarfile

import numpy as np
import pytest
import torch
from native_formats import cifar_tar_bytes, write_svhn_mat

from fedshard_lightning.data import CIFAR10DataModule, CIFAR100DataModule, SVHNDataModule
from fedshard_lightning.data.cifar10 import read_cifar_batch
from fedshard_lightning.data.download import extract
from fedshard_lightning.errors import ConfigError, DataError


def _check_channel_normalisation(dm, mean, std) -> None:
    x = dm.train_x[:4]
    m = torch.tensor(mean)[:, None, None]
    s = torch.tensor(std)[:, None, None]
    torch.testing.assert_close(dm.transform(x), (x.float() / 255.0 - m) / s)
    value = int(x[1, 2, 3, 4])  # blue channel
    assert dm.transform(x)[1, 2, 3, 4].item() == pytest.approx((value / 255 - mean[2]) / std[2], rel=1e-5)


@pytest.mark.parametrize("extracted", [True, False])
@pytest.mark.parametrize("protocol", ["py2", 2])
def test_cifar10_loads(tmp_path, extracted, protocol):
    data, batches = cifar_tar_bytes("cifar10", n_per_batch=12, protocol=protocol)
    root = tmp_path / "cifar10"
    root.mkdir()
    (root / "cifar-10-python.tar.gz").write_bytes(data)
    if extracted:
        extract(root / "cifar-10-python.tar.gz", root)
        (root / "cifar-10-python.tar.gz").unlink()
    dm = CIFAR10DataModule(data_dir=str(tmp_path), num_clients=5, partition="iid")
    dm.setup()
    assert dm.train_x.shape == (60, 3, 32, 32) and dm.train_x.dtype == torch.uint8
    assert dm.test_x.shape == (12, 3, 32, 32) and dm.test_y.dtype == torch.int64
    expected = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    assert np.array_equal(dm.train_x.reshape(60, -1).numpy(), expected)
    # plane layout: the first 1024 values of a row are the red channel, row-major
    assert dm.train_x[0, 0, 0, 1] == expected[0, 1] and dm.train_x[0, 1, 0, 0] == expected[0, 1024]
    assert dm.test_y.tolist() == batches["test_batch"][b"labels"]
    assert int(dm.train_y.min()) >= 0 and int(dm.train_y.max()) <= 9
    assert dm.client_sizes == [12] * 5
    _check_channel_normalisation(dm, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


@pytest.mark.parametrize(
    ("label", "key", "classes"), [("fine", b"fine_labels", 100), ("coarse", b"coarse_labels", 20)]
)
def test_cifar100_loads(tmp_path, label, key, classes):
    data, batches = cifar_tar_bytes("cifar100", n_per_batch=10, protocol=4)
    root = tmp_path / "cifar100"
    root.mkdir()
    (root / "cifar-100-python.tar.gz").write_bytes(data)
    dm = CIFAR100DataModule(data_dir=str(tmp_path), label=label, num_clients=2, partition="iid")
    dm.setup()
    assert dm.train_x.shape == (50, 3, 32, 32) and dm.train_x.dtype == torch.uint8
    assert dm.test_x.shape == (10, 3, 32, 32)
    assert dm.train_y.tolist() == batches["train"][key]
    assert int(dm.train_y.max()) < classes
    assert dm.hparams_for_fingerprint()["label"] == label
    _check_channel_normalisation(dm, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))


def test_cifar100_rejects_unknown_label():
    with pytest.raises(ConfigError, match="fine"):
        CIFAR100DataModule(label="medium")


def test_cifar_fingerprint_depends_on_label(tmp_path):
    data, _ = cifar_tar_bytes("cifar100", n_per_batch=10)
    (tmp_path / "cifar100").mkdir()
    (tmp_path / "cifar100" / "cifar-100-python.tar.gz").write_bytes(data)
    fine = CIFAR100DataModule(data_dir=str(tmp_path), label="fine", num_clients=2, partition="iid")
    coarse = CIFAR100DataModule(data_dir=str(tmp_path), label="coarse", num_clients=2, partition="iid")
    assert fine.fingerprint() != coarse.fingerprint()


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_restricted_unpickler_refuses_code():
    payload = pickle.dumps({b"data": _Evil()}, protocol=2)
    with pytest.raises(DataError, match=r"refusing to unpickle (posix|os|nt)\.system"):
        read_cifar_batch(payload, "data_batch_1")


def test_tampered_cifar_archive_is_refused(tmp_path):
    payload = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [_Evil()]})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    (tmp_path / "cifar10").mkdir()
    (tmp_path / "cifar10" / "cifar-10-python.tar.gz").write_bytes(buf.getvalue())
    with pytest.raises(DataError, match="refusing to unpickle"):
        CIFAR10DataModule(data_dir=str(tmp_path), num_clients=1).setup()


def test_corrupt_cifar_pickle_is_a_data_error():
    with pytest.raises(DataError, match="test_batch"):
        read_cifar_batch(b"\x80\x02}q\x00(", "test_batch")
    with pytest.raises(DataError, match="not a CIFAR batch"):
        read_cifar_batch(pickle.dumps([1, 2, 3]), "test_batch")


def test_svhn_loads(tmp_path):
    x_train, y_train = write_svhn_mat(tmp_path / "svhn" / "train_32x32.mat", 30, seed=0)
    write_svhn_mat(tmp_path / "svhn" / "test_32x32.mat", 10, seed=1)
    dm = SVHNDataModule(data_dir=str(tmp_path), num_clients=3, partition="iid")
    dm.setup()
    assert dm.train_x.shape == (30, 3, 32, 32) and dm.train_x.dtype == torch.uint8
    assert dm.test_x.shape == (10, 3, 32, 32)
    assert dm.train_x.is_contiguous()
    # X[h, w, c, n] -> [n, c, h, w]
    assert dm.train_x[7, 1, 3, 5] == x_train[3, 5, 1, 7]
    # label 10 is digit 0
    assert dm.train_y.tolist() == (y_train[:, 0].astype(int) % 10).tolist()
    assert int(dm.train_y.min()) == 0 and int(dm.train_y.max()) == 9
    _check_channel_normalisation(dm, (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970))


@pytest.mark.parametrize(
    ("cls", "names"),
    [
        (CIFAR10DataModule, ["cifar-10-python.tar.gz", "data_batch_1", "test_batch"]),
        (CIFAR100DataModule, ["cifar-100-python.tar.gz", "train", "test"]),
        (SVHNDataModule, ["train_32x32.mat", "test_32x32.mat"]),
    ],
)
def test_missing_files_error_is_one_line(tmp_path, cls, names):
    with pytest.raises(DataError) as info:
        cls(data_dir=str(tmp_path), num_clients=2).setup()
    message = str(info.value)
    assert "\n" not in message and cls.dataset_name in message and str(tmp_path / cls.folder) in message
    assert all(name in message for name in names)
    assert "http" in message and "download: true" in message


def test_svhn_bad_file_is_a_data_error(tmp_path):
    (tmp_path / "svhn").mkdir()
    (tmp_path / "svhn" / "train_32x32.mat").write_bytes(b"MATLAB 5.0 but not really")
    with pytest.raises(DataError, match=r"train_32x32\.mat"):
        SVHNDataModule(data_dir=str(tmp_path), num_clients=1).setup()


@pytest.mark.parametrize(
    ("cls", "folder", "archive"),
    [
        (CIFAR10DataModule, "cifar10", "cifar-10-python.tar.gz"),
        (CIFAR100DataModule, "cifar100", "cifar-100-python.tar.gz"),
    ],
)
def test_corrupt_cifar_archive_error_is_one_line(tmp_path, cls, folder, archive):
    """tarfile lists every compression it tried on separate lines; the DataError keeps one."""
    (tmp_path / folder).mkdir()
    (tmp_path / folder / archive).write_bytes(b"\x1f\x8b" + b"0" * 100)
    dm = cls(num_clients=2, partition="iid", min_client_size=1, data_dir=str(tmp_path))
    with pytest.raises(DataError, match="corrupt or truncated") as info:
        dm.setup()
    assert "\n" not in str(info.value)
