"""Run-directory edges: run_name escapes, journal symlinks, killed report writes."""

from __future__ import annotations

import os

import pytest
from _tiny import tiny_data, tiny_model, tiny_trainer

from fedshard_lightning.errors import CacheError, ConfigError
from fedshard_lightning.models import MLP


def _fresh():
    return tiny_model(MLP), tiny_data((6,), per_client=12, classes=3, partition="iid")


def _trainer(root, **kw):
    return tiny_trainer(root, rounds=1, **kw)


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", "/tmp/abs"])
def test_run_name_stays_inside_the_root(tmp_path, name):
    root = tmp_path / "root" / "runs"
    with pytest.raises(ConfigError, match="plain folder name"):
        _trainer(root, run_name=name).fit(*_fresh())
    assert not (tmp_path / "escape").exists() and not (tmp_path / "root" / "escape").exists()


def test_journal_symlink_is_refused_and_its_target_untouched(tmp_path):
    tr = _trainer(tmp_path / "runs")
    tr.fit(*_fresh())
    target = tmp_path / "outside.txt"
    target.write_text("precious\n")
    (tr.run_dir / "unlearning").mkdir(exist_ok=True)
    os.symlink(target, tr.run_dir / "unlearning" / "journal.jsonl")
    with pytest.raises(CacheError, match="symbolic link"):
        _trainer(tmp_path / "runs").unlearn(*_fresh(), str(tr.run_dir), [3])
    assert target.read_text() == "precious\n"


def test_killed_report_write_is_recreated_and_its_temp_removed(tmp_path):
    tr = _trainer(tmp_path / "runs")
    tr.fit(*_fresh())
    run = tr.run_dir
    _trainer(tmp_path / "runs").unlearn(*_fresh(), str(run), [3])
    want = (run / "unlearn_report.json").read_bytes()
    (run / "unlearn_report.json").unlink()
    stale = run / ".unlearn_report.json.tmp-999999999"  # a writer killed mid-write (no such process)
    stale.write_bytes(want[:10])
    _trainer(tmp_path / "runs").test(*_fresh(), str(run))  # reading alone changes nothing
    _trainer(tmp_path / "runs").audit(*_fresh(), str(run))  # loading a run repairs it
    assert (run / "unlearn_report.json").read_bytes() == want
    assert not stale.exists()


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"memory_budget_mb": -1}, "trainer.memory_budget_mb"),
        ({"memory_budget_mb": float("nan")}, "trainer.memory_budget_mb"),
        ({"max_chunk_clients": 0}, "trainer.max_chunk_clients"),
        ({"num_threads": -2}, "trainer.num_threads"),
    ],
)
def test_trainer_ranges_refused_at_construction(tmp_path, kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        _trainer(tmp_path, **kw)


@pytest.mark.parametrize("fraction", [1.5, 0, -0.1, 1.0])
def test_data_test_fraction_range(fraction):
    from fedshard_lightning.data import DigitsDataModule

    with pytest.raises(ConfigError, match=r"data\.test_fraction"):
        DigitsDataModule(test_fraction=fraction)


def test_test_never_reports_a_model_that_disagrees_with_the_cache(tmp_path):
    """A stale (pre-unlearning) or damaged model.safetensors is repaired from the cache by `test`."""
    tr = _trainer(tmp_path / "runs")
    tr.fit(*_fresh())
    run = tr.run_dir
    before = (run / "model.safetensors").read_bytes()
    _trainer(tmp_path / "runs").unlearn(*_fresh(), str(run), [3, 5])
    after = (run / "model.safetensors").read_bytes()
    want = _trainer(tmp_path / "runs").test(*_fresh(), str(run))
    assert before != after
    (run / "model.safetensors").write_bytes(before)  # an unlearn killed just after its commit
    got = _trainer(tmp_path / "runs").test(*_fresh(), str(run))
    assert got["test_accuracy"] == want["test_accuracy"] and got["test_loss"] == want["test_loss"]
    assert (run / "model.safetensors").read_bytes() == after
    damaged = bytearray(after)
    damaged[-3] ^= 0xFF  # one flipped byte in the weights
    (run / "model.safetensors").write_bytes(bytes(damaged))
    got = _trainer(tmp_path / "runs").test(*_fresh(), str(run))
    assert got["test_loss"] == want["test_loss"]
    assert (run / "model.safetensors").read_bytes() == after
    (run / "model.safetensors").unlink()  # missing altogether
    got = _trainer(tmp_path / "runs").test(*_fresh(), str(run))
    assert got["test_loss"] == want["test_loss"] and (run / "model.safetensors").read_bytes() == after
