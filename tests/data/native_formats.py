"""Writers of tiny datasets in the exact native formats the datamodules read.

Each writer produces the real file names and layouts (IDX magic numbers and dimensions, gzip,
CIFAR pickle dicts with byte keys inside a tar.gz with the real member names, SVHN .mat files,
Adult CSVs with the junk first line and trailing '.', Purchase CSV/npz/tgz) and returns the
arrays it wrote, so tests can compare what the datamodule loads with what was written.
"""

from __future__ import annotations

import csv
import gzip
import io
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np

IDX_TYPE_UBYTE = 0x08


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """IDX encoding of a uint8 array: magic 0x0000 08 <ndim>, big-endian dims, then the bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    if magic is None:
        magic = (IDX_TYPE_UBYTE << 8) | array.ndim
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.tobytes()


def write_idx(path: Path, array: np.ndarray, magic: int | None = None, compress: bool = True) -> Path:
    """Write ``array`` as an IDX file, gzipped when ``compress`` (the way the datasets ship)."""
    data = idx_bytes(array, magic)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data, mtime=0) if compress else data)
    return path


def digit_arrays(n: int, classes: int = 10, seed: int = 0, h: int = 28, w: int = 28):
    """Random uint8 images [n, h, w] and labels [n] covering every class."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, h, w), dtype=np.uint8)
    labels = (np.arange(n) % classes).astype(np.uint8)
    rng.shuffle(labels)
    return images, labels


def write_mnist_files(root: Path, n_train: int = 40, n_test: int = 20, seed: int = 0, compress: bool = True):
    """The four MNIST/Fashion-MNIST IDX files; returns {split: (images, labels)}."""
    out = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images, labels = digit_arrays(n, seed=seed + (split == "test"))
        suffix = ".gz" if compress else ""
        write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}", images, compress=compress)
        write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", labels, compress=compress)
        out[split] = (images, labels)
    return out


def mnist_file_bytes(n_train: int = 40, n_test: int = 20, seed: int = 0) -> dict[str, bytes]:
    """The four gzipped IDX files as bytes, keyed by their real names (for the loopback server)."""
    out = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images, labels = digit_arrays(n, seed=seed + (split == "test"))
        out[f"{prefix}-images-idx3-ubyte.gz"] = gzip.compress(idx_bytes(images), mtime=0)
        out[f"{prefix}-labels-idx1-ubyte.gz"] = gzip.compress(idx_bytes(labels), mtime=0)
    return out


def emnist_zip_bytes(split: str = "balanced", classes: int = 47, n_train: int = 60, n_test: int = 30):
    """A ``gzip.zip`` like NIST's, holding one split; images stored transposed as EMNIST does.

    Returns:
        (zip bytes, {split: (images as they should load, labels as in the file)}).
    """
    first = 1 if split == "letters" else 0
    buf = io.BytesIO()
    out = {}
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for side, n in (("train", n_train), ("test", n_test)):
            images, _ = digit_arrays(n, seed=7 + (side == "test"))
            labels = (np.arange(n) % classes + first).astype(np.uint8)
            stored = np.ascontiguousarray(images.transpose(0, 2, 1))  # column-major, as in EMNIST
            zf.writestr(f"gzip/emnist-{split}-{side}-images-idx3-ubyte.gz", gzip.compress(idx_bytes(stored)))
            zf.writestr(f"gzip/emnist-{split}-{side}-labels-idx1-ubyte.gz", gzip.compress(idx_bytes(labels)))
            out[side] = (images, labels)
        zf.writestr("gzip/emnist-other-train-images-idx3-ubyte.gz", b"not needed")
    return buf.getvalue(), out


def cifar_batch(n: int, seed: int, label_keys: dict[bytes, int]) -> dict[bytes, object]:
    """One CIFAR batch dict with the real byte-string keys and a [n, 3072] uint8 data array."""
    rng = np.random.default_rng(seed)
    batch: dict[bytes, object] = {
        b"batch_label": f"batch {seed}".encode(),
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        b"filenames": [f"img_{seed}_{i}.png".encode() for i in range(n)],
    }
    for key, classes in label_keys.items():
        batch[key] = [int(v) for v in rng.integers(0, classes, size=n)]
    return batch


def _py2_str(b: bytes) -> bytes:
    """A Python 2 ``str`` in a protocol-2 pickle (SHORT_BINSTRING / BINSTRING)."""
    return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<i", len(b)) + b


def _py2_int(v: int) -> bytes:
    return b"K" + bytes([v]) if 0 <= v < 256 else b"J" + struct.pack("<i", v)


def _py2_value(v) -> bytes:
    if isinstance(v, bytes):
        return _py2_str(v)
    if isinstance(v, int):
        return _py2_int(v)
    if isinstance(v, list):
        return b"](" + b"".join(_py2_value(x) for x in v) + b"e"
    if isinstance(v, np.ndarray):
        assert v.dtype == np.uint8 and v.ndim == 2
        return (
            b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85"
            + _py2_str(b"b")
            + b"\x87R"
            + b"(K\x01"
            + _py2_int(v.shape[0])
            + _py2_int(v.shape[1])
            + b"\x86"
            + b"cnumpy\ndtype\n"
            + _py2_str(b"u1")
            + b"K\x00K\x01\x87R"
            + b"(K\x03"
            + _py2_str(b"|")
            + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
            + b"\x89"
            + _py2_str(v.tobytes())
            + b"tb"
        )
    raise TypeError(type(v))


def py2_pickle(batch: dict[bytes, object]) -> bytes:
    """Protocol-2 pickle as Python 2's cPickle wrote the CIFAR files: str keys, numpy.core globals."""
    body = b"".join(_py2_str(k) + _py2_value(v) for k, v in batch.items())
    return b"\x80\x02}(" + body + b"u."


def cifar_tar_bytes(kind: str = "cifar10", n_per_batch: int = 12, protocol: int | str = "py2"):
    """``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz`` with the real member names.

    ``protocol="py2"`` writes the batches the way the real files are (Python 2 pickles); an int
    uses Python 3's pickle with that protocol.

    Returns:
        (tar.gz bytes, {member name: batch dict}).
    """
    if kind == "cifar10":
        folder = "cifar-10-batches-py"
        members = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        keys = {b"labels": 10}
        meta = {b"label_names": [b"airplane"] * 10, b"num_cases_per_batch": n_per_batch}
        meta_name = "batches.meta"
    else:
        folder = "cifar-100-python"
        members = ["train", "test"]
        keys = {b"fine_labels": 100, b"coarse_labels": 20}
        meta = {b"fine_label_names": [b"apple"] * 100, b"coarse_label_names": [b"fish"] * 20}
        meta_name = "meta"
    batches = {
        m: cifar_batch(n_per_batch * (5 if m == "train" else 1), seed=i, label_keys=keys)
        for i, m in enumerate(members)
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, obj in [*batches.items(), (meta_name, meta)]:
            data = py2_pickle(obj) if protocol == "py2" else pickle.dumps(obj, protocol=protocol)
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), batches


def svhn_arrays(n: int, seed: int):
    """SVHN-shaped X [32, 32, 3, n] uint8 and y [n, 1] in 1..10 (10 = digit 0)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
    y = (np.arange(n) % 10 + 1).astype(np.uint8)[:, None]
    return x, y


def write_svhn_mat(path: Path, n: int, seed: int = 0):
    """A ``*_32x32.mat`` file written with scipy.io.savemat, variables X and y."""
    from scipy.io import savemat

    x, y = svhn_arrays(n, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    savemat(path, {"X": x, "y": y})
    return x, y


_WORKCLASS = ["Private", "Self-emp-not-inc", "State-gov", "Federal-gov"]
_EDUCATION = ["Bachelors", "HS-grad", "Masters", "Some-college"]
_MARITAL = ["Never-married", "Married-civ-spouse", "Divorced"]
_OCCUPATION = ["Adm-clerical", "Exec-managerial", "Tech-support", "Sales"]
_RELATIONSHIP = ["Not-in-family", "Husband", "Wife", "Own-child"]
_RACE = ["White", "Black", "Asian-Pac-Islander"]
_SEX = ["Male", "Female"]
_COUNTRY = ["United-States", "Cuba", "India"]


def adult_rows(n: int, seed: int, test: bool) -> list[list[str]]:
    """Adult rows in the real column order (14 attributes, then the income label)."""
    rng = np.random.default_rng(seed)
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    rows = []
    for i in range(n):
        label = ">50K" if i % 3 == 0 else "<=50K"
        rows.append(
            [
                str(int(rng.integers(17, 90))),
                pick(_WORKCLASS),
                str(int(rng.integers(10_000, 500_000))),
                pick(_EDUCATION),
                str(int(rng.integers(1, 17))),
                pick(_MARITAL),
                pick(_OCCUPATION),
                pick(_RELATIONSHIP),
                pick(_RACE),
                pick(_SEX),
                str(int(rng.integers(0, 5000))),
                str(int(rng.integers(0, 2000))),
                str(int(rng.integers(1, 99))),
                pick(_COUNTRY),
                label + ("." if test else ""),
            ]
        )
    return rows


def adult_file_bytes(n_train: int = 30, n_test: int = 15) -> dict[str, bytes]:
    """``adult.data`` and ``adult.test`` as UCI ships them: ', ' separators, '?' rows, trailing
    blank line; the test file starts with ``|1x3 Cross validator`` and labels end with '.'."""
    out = {}
    for name, n, test in (("adult.data", n_train, False), ("adult.test", n_test, True)):
        rows = adult_rows(n, seed=1 + test, test=test)
        rows.insert(2, [*rows[0][:6], "?", *rows[0][7:]])  # a row with a missing occupation
        lines = (["|1x3 Cross validator"] if test else []) + [", ".join(r) for r in rows] + ["", ""]
        out[name] = "\n".join(lines).encode()
    return out


def write_adult_files(root: Path, n_train: int = 30, n_test: int = 15) -> dict[str, list[list[str]]]:
    """Write both Adult files; returns the complete (no '?') rows of each as parsed strings."""
    root.mkdir(parents=True, exist_ok=True)
    parsed = {}
    for name, data in adult_file_bytes(n_train, n_test).items():
        (root / name).write_bytes(data)
        reader = csv.reader(io.StringIO(data.decode()), skipinitialspace=True)
        parsed[name] = [r for r in reader if len(r) == 15 and "?" not in r]
    return parsed


def purchase_arrays(n: int = 400, d: int = 600, seed: int = 0):
    """0/1 features [n, d] and labels 1..100 (every class at least 4 times)."""
    rng = np.random.default_rng(seed)
    features = rng.integers(0, 2, size=(n, d), dtype=np.uint8)
    labels = (np.arange(n) % 100 + 1).astype(np.int64)
    return features, labels


def purchase_csv_bytes(features: np.ndarray, labels: np.ndarray) -> bytes:
    """The ``dataset_purchase`` layout: label, then the 0/1 features, comma separated."""
    lines = [f"{y}," + ",".join(map(str, row.tolist())) for row, y in zip(features, labels)]
    return ("\n".join(lines) + "\n").encode()


def purchase_tgz_bytes(csv_data: bytes) -> bytes:
    """``dataset_purchase.tgz`` holding the CSV as ``dataset_purchase``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:  # level 9 is slow on this text
        info = tarfile.TarInfo("dataset_purchase")
        info.size = len(csv_data)
        tar.addfile(info, io.BytesIO(csv_data))
    return buf.getvalue()
