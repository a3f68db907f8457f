"""prepare_data(download=True) of every datamodule against the loopback server."""

from __future__ import annotations

import hashlib

import pytest
import torch
from native_formats import (
    adult_file_bytes,
    cifar_tar_bytes,
    emnist_zip_bytes,
    mnist_file_bytes,
    purchase_arrays,
    purchase_csv_bytes,
    purchase_tgz_bytes,
    svhn_arrays,
)

from fedshard_lightning.data import (
    AdultDataModule,
    CIFAR10DataModule,
    CIFAR100DataModule,
    EMNISTDataModule,
    FashionMNISTDataModule,
    MNISTDataModule,
    Purchase100DataModule,
    SVHNDataModule,
)
from fedshard_lightning.data.download import RemoteFile
from fedshard_lightning.errors import DataError


def _svhn_files() -> dict[str, bytes]:
    import io

    from scipy.io import savemat

    out = {}
    for name, n in (("train_32x32.mat", 20), ("test_32x32.mat", 10)):
        x, y = svhn_arrays(n, seed=n)
        buf = io.BytesIO()
        savemat(buf, {"X": x, "y": y})
        out[name] = buf.getvalue()
    return out


def _purchase_files() -> dict[str, bytes]:
    features, labels = purchase_arrays(300)
    return {"dataset_purchase.tgz": purchase_tgz_bytes(purchase_csv_bytes(features, labels))}


CASES = {
    "mnist": (MNISTDataModule, {}, lambda: mnist_file_bytes(40, 20), (40, 1, 28, 28)),
    "fmnist": (FashionMNISTDataModule, {}, lambda: mnist_file_bytes(30, 10, seed=5), (30, 1, 28, 28)),
    "emnist": (
        EMNISTDataModule,
        {"split": "digits"},
        lambda: {"gzip.zip": emnist_zip_bytes("digits", 10)[0]},
        (60, 1, 28, 28),
    ),
    "cifar10": (
        CIFAR10DataModule,
        {},
        lambda: {"cifar-10-python.tar.gz": cifar_tar_bytes("cifar10", 8)[0]},
        (40, 3, 32, 32),
    ),
    "cifar100": (
        CIFAR100DataModule,
        {},
        lambda: {"cifar-100-python.tar.gz": cifar_tar_bytes("cifar100", 8)[0]},
        (40, 3, 32, 32),
    ),
    "svhn": (SVHNDataModule, {}, _svhn_files, (20, 3, 32, 32)),
    "adult": (AdultDataModule, {}, lambda: adult_file_bytes(30, 15), None),
    "purchase": (Purchase100DataModule, {}, _purchase_files, (240, 600)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prepare_data_downloads_verifies_and_loads(server, tmp_path, monkeypatch, case):
    cls, kwargs, make_files, train_shape = CASES[case]
    files = make_files()
    real_names = {f.name for f in cls.resources}
    if real_names:  # the loopback copies stand in for exactly the official files
        assert set(files) == real_names
    mirrored = tuple(
        server.remote(name, data, md5=True, sha256=(i % 2 == 0)).with_urls(
            server.url(f"/official/{name}"),  # 404: the mirror must take over
            server.url(f"/files/{name}"),
        )
        for i, (name, data) in enumerate(files.items())
    )
    monkeypatch.setattr(cls, "resources", mirrored)
    dm = cls(data_dir=str(tmp_path), download=True, num_clients=2, partition="iid", **kwargs)
    dm.prepare_data()
    assert all((dm.root / name).is_file() for name in files)
    assert not list(dm.root.glob("*.part"))
    dm.setup()
    if train_shape is not None:
        assert tuple(dm.train_x.shape) == train_shape
    assert dm.train_y.dtype == torch.int64 and int(dm.train_y.min()) >= 0
    # a second prepare_data (e.g. another run) touches neither the network nor the files
    server.requests.clear()
    dm2 = cls(data_dir=str(tmp_path), download=True, num_clients=2, partition="iid", **kwargs)
    dm2.prepare_data()
    assert server.requests == []
    dm2.setup()
    assert torch.equal(dm2.train_x, dm.train_x)


def test_prepare_data_with_a_corrupt_download_fails_cleanly(server, tmp_path, monkeypatch):
    files = mnist_file_bytes(10, 5)
    resources = tuple(server.remote(name, data) for name, data in files.items())
    bad = RemoteFile(resources[0].name, resources[0].urls, md5=hashlib.md5(b"other").hexdigest())
    monkeypatch.setattr(MNISTDataModule, "resources", (bad, *resources[1:]))
    dm = MNISTDataModule(data_dir=str(tmp_path), download=True, num_clients=2)
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz"):
        dm.prepare_data()
    assert not (dm.root / "train-images-idx3-ubyte.gz").exists()
    assert not list(dm.root.glob("*.part"))


def test_prepare_data_without_download_does_nothing(server, tmp_path, monkeypatch):
    files = mnist_file_bytes(10, 5)
    monkeypatch.setattr(MNISTDataModule, "resources", tuple(server.remote(n, d) for n, d in files.items()))
    MNISTDataModule(data_dir=str(tmp_path), download=False).prepare_data()
    assert server.requests == []
    assert not (tmp_path / "mnist").exists()


def test_purchase_download_with_user_checksum(server, tmp_path, monkeypatch):
    data = _purchase_files()["dataset_purchase.tgz"]
    url = server.serve("/reza/dataset_purchase.tgz", data)
    monkeypatch.setattr("fedshard_lightning.data.purchase.PURCHASE_URLS", (url,))
    dm = Purchase100DataModule(
        data_dir=str(tmp_path), download=True, num_clients=2, archive_sha256=hashlib.sha256(data).hexdigest()
    )
    dm.prepare_data()
    assert (dm.root / "dataset_purchase").is_file()
    dm.setup()
    assert dm.train_x.shape == (240, 600)


@pytest.mark.parametrize("case", ["mnist", "cifar10", "adult"])
def test_setup_alone_downloads_when_download_is_set(server, tmp_path, monkeypatch, case):
    cls, kwargs, make_files, _ = CASES[case]
    resources = tuple(server.remote(name, data) for name, data in make_files().items())
    monkeypatch.setattr(cls, "resources", resources)
    dm = cls(data_dir=str(tmp_path), download=True, num_clients=2, partition="iid", **kwargs)
    dm.setup()  # a Fabric loop may skip prepare_data
    assert len(dm.train_y) > 0 and len(server.requests) == len(resources)


def test_hand_placed_archive_failing_verification_is_kept_as_bad(server, tmp_path, monkeypatch, caplog):
    archive, _ = cifar_tar_bytes("cifar10", 8)
    name = "cifar-10-python.tar.gz"
    monkeypatch.setattr(CIFAR10DataModule, "resources", (server.remote(name, archive),))
    root = tmp_path / "cifar10"
    root.mkdir()
    (root / name).write_bytes(archive[:-100])  # a truncated copy the user downloaded by hand
    dm = CIFAR10DataModule(data_dir=str(tmp_path), download=True, num_clients=2, partition="iid")
    with caplog.at_level("WARNING", logger="fedshard_lightning.data.download"):
        dm.prepare_data()
    assert (root / f"{name}.bad").read_bytes() == archive[:-100], "the user's file is kept, renamed"
    assert (root / name).read_bytes() == archive
    [line] = [r.getMessage() for r in caplog.records]
    assert f"kept as {name}.bad" in line and "\n" not in line
    dm.setup()
    assert tuple(dm.train_x.shape) == (40, 3, 32, 32)


@pytest.mark.parametrize("cls", [MNISTDataModule, FashionMNISTDataModule])
def test_download_skips_idx_files_present_uncompressed(server, tmp_path, monkeypatch, cls):
    """The loader reads ``x`` for ``x.gz``; download: true then fetches only what is absent, and
    still verifies a ``.gz`` that is there (here: the one file left compressed)."""
    import gzip

    files = mnist_file_bytes(10, 5)
    monkeypatch.setattr(cls, "resources", tuple(server.remote(n, d) for n, d in files.items()))
    root = tmp_path / cls.folder
    root.mkdir()
    names = list(files)
    for name in names[1:]:
        (root / name.removesuffix(".gz")).write_bytes(gzip.decompress(files[name]))
    dm = cls(data_dir=str(tmp_path), download=True, num_clients=2, partition="iid", min_client_size=1)
    dm.prepare_data()
    assert [r.path for r in server.requests] == [f"/files/{names[0]}"]
    assert not any((root / name).exists() for name in names[1:])
    dm.setup()
    assert tuple(dm.train_x.shape) == (10, 1, 28, 28)
