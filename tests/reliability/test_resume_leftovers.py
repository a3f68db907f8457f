"""What a fit killed before it recorded its settings leaves: refused with a way out, or resumed with its own.

A folder that holds only an empty ``cache/`` (or only a cut-short fingerprint write) knows
nothing of its run's settings: ``fit --ckpt_path`` must refuse it in one line that says how to go
on, never train the package defaults into it. A folder whose config.yaml was written (the CLI
writes it before anything else) resumes with that config, completing a cut-short fingerprint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _reliability_helpers import TINY, cli, copy_run, error_lines, tree_hash


def _leftover(run: Path, *cache_files: str, logs: bool = False) -> Path:
    """A run folder as a fit killed before its settings were recorded leaves it."""
    (run / "cache").mkdir(parents=True)
    for name in cache_files:
        (run / "cache" / name).write_text('{"fingerprint": "ab')  # a write cut short
    if logs:
        (run / "logs").mkdir()
    return run


@pytest.mark.parametrize(
    "files",
    [pytest.param((), id="empty-cache"), pytest.param((".FINGERPRINT.tmp-999999999",), id="fingerprint-tmp")],
)
@pytest.mark.parametrize("logs", [False, True], ids=["", "with-logs"])
def test_a_folder_without_settings_is_refused_with_the_way_out(tmp_path, files, logs):
    run = _leftover(tmp_path / "runs" / "r", *files, logs=logs)
    before = tree_hash(tmp_path)
    code, out, err = cli(["fit", *TINY, "--ckpt_path", str(run)])
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert "no config.yaml and no committed version" in lines[0] and "rm -r" in lines[0], lines[0]
    assert tree_hash(tmp_path) == before  # nothing trained, nothing written
    assert "run directory:" not in out
    # The way out works: the new run under the same name is the one the line asks for.
    code, _, err = cli(
        ["fit", *TINY, "--trainer.default_root_dir", str(run.parent), "--trainer.run_name", "r"]
    )
    assert code == 2 and "exists already" in err  # what the user tries first: it points back to the resume
    shutil.rmtree(run)
    code, _, err = cli(
        ["fit", *TINY, "--trainer.default_root_dir", str(run.parent), "--trainer.run_name", "r"]
    )
    assert code == 0, err


def test_a_new_run_records_its_config_before_reading_data(tmp_path, monkeypatch):
    """The config is on disk before setup starts: a kill during setup leaves a resumable folder."""
    from fedshard_lightning import trainer as trainer_module

    seen: dict[str, bool] = {}

    def stop(self, model, datamodule, run_dir, command):
        seen["config"] = (run_dir / "config.yaml").is_file()
        raise KeyboardInterrupt  # stands for the kill: the folder stays as it is

    monkeypatch.setattr(trainer_module.FederatedTrainer, "_setup", stop)
    code, _, _ = cli(["fit", *TINY, "--trainer.default_root_dir", str(tmp_path), "--trainer.run_name", "r"])
    assert seen == {"config": True}
    assert code != 0


def test_a_cut_short_fingerprint_is_completed_by_the_resume(tmp_path, reference_run):
    """config.yaml written, the fingerprint's write cut short: the resume trains the run's own settings."""
    run = copy_run(reference_run, tmp_path / "r")
    for p in list(run.iterdir()):
        if p.name != "config.yaml":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    _leftover(run, ".FINGERPRINT.tmp-999999999")
    code, _, err = cli(["fit", "--ckpt_path", str(run)])  # no flags: config.yaml alone gives the settings
    assert code == 0, err
    assert not (run / "cache" / ".FINGERPRINT.tmp-999999999").exists()
    assert (run / "cache" / "FINGERPRINT").is_file()
    assert (run / "model.safetensors").read_bytes() == (reference_run / "model.safetensors").read_bytes()
