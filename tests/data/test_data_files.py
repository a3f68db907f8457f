"""Dataset files that are not the official ones: used with a note; their hashes in the run's fingerprint.

References: ``hashlib`` over the written files (the note's and the fingerprint's hashes), and
the fingerprint a run fitted before the files were hashed recorded (it must still resume).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from _tiny import tiny_trainer
from native_formats import digit_arrays, write_idx, write_mnist_files

from fedshard_lightning.data import MNISTDataModule
from fedshard_lightning.errors import CacheError
from fedshard_lightning.models import MLP
from fedshard_lightning.module import bind_model
from fedshard_lightning.run.fingerprint import body_fingerprint, fingerprint_body, same_run


def _mnist(root):
    return MNISTDataModule(data_dir=str(root), num_clients=4, partition="iid")


def _model():
    torch.manual_seed(0)
    return MLP(hidden=(8,), lr=0.05)


def _digest(path, algo):
    return hashlib.new(algo, path.read_bytes()).hexdigest()


def test_unofficial_file_is_used_with_one_note_naming_it_and_both_hashes(tmp_path, capsys):
    write_mnist_files(tmp_path / "mnist", n_train=40, n_test=20)
    dm = _mnist(tmp_path)
    dm.setup()
    assert dm.train_x.shape[0] == 40  # used as it is
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 4  # one per file, none twice
    images = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    line = next(n for n in notes if str(images) in n)
    assert "md5 f68b3c2dcbeaaa9fbdd348bbdeb94873 official" in line
    assert f"{_digest(images, 'md5')} here" in line
    dm.load_split(train=True)  # read again: no second note
    assert "note:" not in capsys.readouterr().out


def test_uncompressed_twin_has_no_published_checksum_and_no_note(tmp_path, capsys):
    write_mnist_files(tmp_path / "mnist", n_train=40, n_test=20, compress=False)
    dm = _mnist(tmp_path)
    dm.setup()
    assert "note:" not in capsys.readouterr().out
    assert set(dm.data_files()) == {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                                    "t10k-labels-idx1-ubyte"}  # fmt: skip


def test_fingerprint_has_the_files_sha256(tmp_path):
    write_mnist_files(tmp_path / "mnist", n_train=40, n_test=20)
    dm = _mnist(tmp_path)
    dm.setup()
    model = _model()
    bind_model(model, dm.input_shape, dm.num_classes)
    body = fingerprint_body(model, dm, tiny_trainer(tmp_path).algorithm, 0)
    test_images = tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz"
    assert body["data_files"]["t10k-images-idx3-ubyte.gz"] == _digest(test_images, "sha256")
    # A run fitted before the files were hashed recorded the fingerprint without them.
    old = {k: v for k, v in body.items() if k != "data_files"}
    assert same_run(body_fingerprint(old), body, old)
    assert not same_run(body_fingerprint(old), body, body)


def test_resume_on_changed_data_files_is_refused_in_one_line(tmp_path):
    data = tmp_path / "data"
    write_mnist_files(data / "mnist", n_train=40, n_test=20)
    tr = tiny_trainer(tmp_path)
    tr.fit(_model(), _mnist(data))
    run = tr.run_dir
    cache_files = sorted(p.name for p in (run / "cache").rglob("*"))
    fp = json.loads((run / "cache" / "FINGERPRINT").read_text())["fingerprint"]
    # Other test images only: the labels and the partition (hashed before) are the same.
    write_idx(data / "mnist" / "t10k-images-idx3-ubyte.gz", digit_arrays(20, seed=5)[0])
    for call in (
        lambda: tiny_trainer(tmp_path).fit(_model(), _mnist(data), ckpt_path=str(run)),
        lambda: tiny_trainer(tmp_path).unlearn(_model(), _mnist(data), str(run), [1]),
    ):
        with pytest.raises(CacheError, match=r"was fitted on other data files \(\S+: sha256 [0-9a-f]{64} in the run, "
                           r"[0-9a-f]{64} now\); put back the files") as err:  # fmt: skip
            call()
        assert "\n" not in str(err.value)
    assert sorted(p.name for p in (run / "cache").rglob("*")) == cache_files  # nothing written
    assert json.loads((run / "cache" / "FINGERPRINT").read_text())["fingerprint"] == fp
