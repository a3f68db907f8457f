"""Two processes on one run (unlearn, or fit --ckpt_path): the second stops at once and changes nothing."""

from __future__ import annotations

import fcntl
import os

import pytest
from _reliability_helpers import cli, copy_run, error_lines, snapshot


def test_second_unlearn_on_a_locked_run_gets_one_line_and_writes_nothing(reference_run, tmp_path):
    run = copy_run(reference_run, tmp_path / "run")
    before = snapshot(tmp_path)
    args = [
        "unlearn",
        "--config",
        str(reference_run / "config.yaml"),
        "--ckpt_path",
        str(run),
        "--clients",
        "[1]",
    ]
    fd = os.open(run, os.O_RDONLY)  # stands for a first unlearn still running in another process
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, _, err = cli(args)
    finally:
        os.close(fd)
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert "another process is unlearning from this run" in lines[0] and str(run) in lines[0]
    assert snapshot(tmp_path) == before
    code, _, err = cli(args)  # once the first process is gone, the request goes through
    assert code == 0, err


def _partial(reference_run, path):
    """A run killed after its first commit (stage 1 of 3): ``fit --ckpt_path`` resumes it."""
    import shutil

    from fedshard_lightning.flcache import FLCache

    run = copy_run(reference_run, path)
    FLCache(run / "cache").set_current("0001-stage-1")
    for version in ("0002-stage-2", "0003-stage-3"):
        shutil.rmtree(run / "cache" / version)
    for name in ("model.safetensors", "metrics.json"):
        (run / name).unlink()
    return run


def test_second_fit_resume_on_a_locked_run_gets_one_line_and_writes_nothing(reference_run, tmp_path):
    run = _partial(reference_run, tmp_path / "run")
    before = snapshot(tmp_path)
    args = ["fit", "--config", str(run / "config.yaml"), "--ckpt_path", str(run)]
    fd = os.open(run, os.O_RDONLY)  # stands for a first resume still running
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, _, err = cli(args)
    finally:
        os.close(fd)
    lines = [line for line in error_lines(err) if not line.startswith("run directory:")]
    assert code == 2 and len(lines) == 1, err
    assert "another process" in lines[0] and str(run) in lines[0]
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_two_concurrent_resumes_one_refuses_one_finishes(reference_run, tmp_path):
    """A real second process: while it holds the run, an in-process resume stops in one line.

    Its outcome depends on scheduling (the in-process resume must reach the lock before the other
    process's resume finishes), so it runs -m slow; the refusal under a held lock, with nothing
    written, is test_second_fit_resume_on_a_locked_run_gets_one_line_and_writes_nothing.
    """
    import time

    from _reliability_helpers import spawn

    run = _partial(reference_run, tmp_path / "run")
    proc = spawn(["fit", "--config", str(run / "config.yaml"), "--ckpt_path", str(run)], tmp_path / "a.log")
    held = False
    try:
        while proc.poll() is None and not held:  # wait until the other process holds the run lock
            fd = os.open(run, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                held = True
            finally:
                os.close(fd)
            time.sleep(0.001)
        code, _, err = cli(["fit", "--config", str(run / "config.yaml"), "--ckpt_path", str(run)])
    finally:
        assert proc.wait(timeout=600) == 0, (tmp_path / "a.log").read_text()
    assert held, "the first resume finished before it could be raced"
    lines = [line for line in error_lines(err) if not line.startswith("run directory:")]
    assert code == 2 and len(lines) == 1 and "another process" in lines[0], err
    versions = sorted(p.name for p in (run / "cache").iterdir() if p.is_dir() and p.name != "blobs")
    assert versions == ["0001-stage-1", "0002-stage-2", "0003-stage-3"], "one resume committed, once"
    assert (run / "model.safetensors").read_bytes() == (reference_run / "model.safetensors").read_bytes()
