"""Two unlearning processes on one run: the second stops at once and changes nothing."""

from __future__ import annotations

import fcntl
import os

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
