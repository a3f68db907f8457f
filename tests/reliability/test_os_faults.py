"""Disk full, read-only, file too large: one line, the exit status of its kind, nothing committed lost.

The matrix (test_bad_input_matrix.py) fails the first write of a command; here the fault hits in
the middle of a commit (blobs written, manifest not yet), and real mechanisms are used where this
machine allows them: ``ulimit -f`` in a subprocess (EFBIG, SIGXFSZ ignored) and a tmpfs remounted
read-only (EROFS, as root chmod would not stop us).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
from _reliability_helpers import ROOT, TINY, cli, copy_run, error_lines, journal, tmp_leftovers, tree_hash

from fedshard_lightning.flcache import FLCache


def _unlearn(run, clients="[2]"):
    return ["unlearn", "--config", str(run / "config.yaml"), "--ckpt_path", str(run), "--clients", clients]


def _reference_unlearned(reference_run, tmp_path):
    ref = copy_run(reference_run, tmp_path / "ref")
    code, _, err = cli(_unlearn(ref))
    assert code == 0, err
    return (ref / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    ("err", "code"), [(errno.ENOSPC, 3), (errno.EROFS, 4), (errno.EFBIG, 5), (errno.EACCES, 6)]
)
def test_fault_in_the_middle_of_a_commit_rolls_back_and_the_rerun_is_exact(
    reference_run, tmp_path, monkeypatch, err, code
):
    run = copy_run(reference_run, tmp_path / "run")
    cache = FLCache(run / "cache")
    current, blobs = cache.current(), sorted((run / "cache" / "blobs").rglob("*"))
    model = (run / "model.safetensors").read_bytes()
    real_replace = os.replace

    def replace(src, dst):  # the manifest's rename: every blob of the new version is written by then
        if str(dst).endswith("manifest.json"):
            raise OSError(err, os.strerror(err), str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    status, _, stderr = cli(_unlearn(run))
    monkeypatch.undo()
    lines = error_lines(stderr)
    assert status == code and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "manifest.json" in lines[0] and ".tmp-" not in lines[0], lines[0]
    assert cache.current() == current and cache.versions()[-1] == current, "no new version"
    assert sorted((run / "cache" / "blobs").rglob("*")) == blobs, "the failed commit's blobs are removed"
    assert tmp_leftovers(run / "cache") == [] and (run / "model.safetensors").read_bytes() == model
    assert [e["event"] for e in journal(run)] == ["started"]
    status, _, stderr = cli(_unlearn(run))  # the fault is gone: the request goes through, exactly
    assert status == 0, stderr
    assert (run / "model.safetensors").read_bytes() == _reference_unlearned(reference_run, tmp_path)


def test_ulimit_f_gives_efbig_in_one_line(reference_run, tmp_path):
    """A real file-size limit in a subprocess: SIGXFSZ is ignored, so the write fails with EFBIG."""
    run = copy_run(reference_run, tmp_path / "run")
    before = FLCache(run / "cache").current()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    args = " ".join(f"'{a}'" for a in _unlearn(run))
    r = subprocess.run(
        ["bash", "-c", f"ulimit -f 8 && exec '{sys.executable}' -m fedshard_lightning {args}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = error_lines(r.stderr)
    assert r.returncode == 5, r.stderr
    assert len(lines) == 1 and "EFBIG" in lines[0] and str(run) in lines[0], r.stderr
    assert FLCache(run / "cache").current() == before and tmp_leftovers(run / "cache") == []


@pytest.fixture
def read_only_run(reference_run, tmp_path):
    """The run on a tmpfs remounted read-only (skipped where this machine cannot mount)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        run = copy_run(reference_run, mnt / "run")
        if subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode:
            pytest.skip("cannot remount the tmpfs read-only")
        yield run
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_read_only_run_can_be_tested_but_not_unlearned(read_only_run):
    run = read_only_run
    before = tree_hash(run)
    code, out, err = cli(["test", "--config", str(run / "config.yaml"), "--ckpt_path", str(run)])
    assert code == 0 and "test_accuracy=" in out, err  # reading needs no write
    code, _, err = cli(_unlearn(run))
    lines = error_lines(err)
    assert code == 4 and len(lines) == 1 and "EROFS" in lines[0] and str(run) in lines[0], err
    assert tree_hash(run) == before


def test_a_fresh_fit_that_fails_before_its_first_commit_says_nothing_is_left_to_resume(tmp_path, monkeypatch):
    """The failed run's folder is removed (it held nothing), so the one line must not suggest a resume."""
    real_replace = os.replace

    def replace(src, dst):  # the first version's manifest: nothing is committed yet
        if str(dst).endswith("manifest.json"):
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    root = tmp_path / "runs"
    status, _, stderr = cli(
        ["fit", *TINY, "--trainer.default_root_dir", str(root), "--trainer.run_name", "efbig"]
    )
    monkeypatch.undo()
    lines = error_lines(stderr)
    assert status == 5 and len(lines) == 1, stderr
    assert "--ckpt_path" not in lines[0] and "nothing was committed" in lines[0], lines[0]
    assert not (root / "efbig").exists()


def _logged(run):
    """{log folder: the request numbers of its rows}, read with the csv module."""
    import csv

    out = {}
    for folder in sorted((run / "logs").glob("unlearn-*")):
        path = folder / "metrics.csv"
        rows = list(csv.DictReader(path.read_text().splitlines())) if path.is_file() else []
        out[folder.name] = [int(float(r["unlearn/request"])) for r in rows if r.get("unlearn/request")]
    return out


def test_disk_full_at_a_requests_log_row_keeps_logs_unlearn_n_holding_request_n(
    reference_run, tmp_path, monkeypatch
):
    """ENOSPC writing request 2's CSV row (after its commit) left an empty logs/unlearn-2: the retry
    logged request 2 into unlearn-3 and every later request N into unlearn-(N+1)."""
    import builtins

    run = copy_run(reference_run, tmp_path / "run")
    assert cli(_unlearn(run, "[2]"))[0] == 0
    real_open = builtins.open

    def full_disk(file, mode="r", *args, **kwargs):
        if str(file).endswith("unlearn-2/metrics.csv") and "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk)
    status, _, stderr = cli(_unlearn(run, "[5]"))
    monkeypatch.undo()
    assert status == 3 and "unlearn-2/metrics.csv" in stderr, stderr
    assert FLCache(run / "cache").manifest()["requests"][-1]["clients"] == [5], "request 2 was committed"
    assert cli(_unlearn(run, "[5]"))[0] == 0  # space freed, run again: nothing to do, the lost row is logged
    assert cli(_unlearn(run, "[6]"))[0] == 0
    # The reference: the request numbers the reports give, one folder each, no empty folder.
    numbers = [
        json.loads((run / "unlearning" / f"{i:04d}" / "report.json").read_text())["request"]
        for i in (1, 2, 3)
    ]
    assert numbers == [1, 2, 3]
    assert _logged(run) == {f"unlearn-{n}": [n] for n in numbers}


def test_disk_full_at_unlearn_report_json_is_repaired_by_the_next_load(reference_run, tmp_path, monkeypatch):
    """ENOSPC writing unlearn_report.json after request 2's commit left request 1's there; `test` (and
    `audit`) repaired the journal but kept the stale file until the next `unlearn`."""
    run = copy_run(reference_run, tmp_path / "run")
    assert cli(_unlearn(run, "[2]"))[0] == 0
    real_replace = os.replace

    def full_disk(src, dst):
        if str(dst).endswith("unlearn_report.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full_disk)
    status, _, stderr = cli(_unlearn(run, "[5]"))
    monkeypatch.undo()
    assert status == 3, stderr
    assert json.loads((run / "unlearn_report.json").read_text())["request"] == 1, (
        "the fault hit after the commit"
    )
    # Its one line says the request is in (it had said "run the command again", which then answered
    # "already unlearned by request 0002; nothing to do").
    assert stderr.strip().endswith(
        "then run any command on the run (test, audit, unlearn): request 0002 is committed in the cache, "
        "and loading the run writes its model and reports"
    ), stderr
    assert cli(["test", "--ckpt_path", str(run)])[0] == 0
    # The reference: the cache's request log (2 requests) and the request's own report file.
    assert [r["clients"] for r in FLCache(run / "cache").manifest()["requests"]] == [[2], [5]]
    report = (run / "unlearning" / "0002" / "report.json").read_bytes()
    assert json.loads(report)["request"] == 2 and (run / "unlearn_report.json").read_bytes() == report


@pytest.mark.parametrize("command", ["test", "audit"])
def test_a_full_disk_while_test_or_audit_logs_leaves_no_partial_file(
    reference_run, tmp_path, monkeypatch, command
):
    """The row's write fails halfway, as a full disk fails it (ENOSPC without a file name)."""
    import builtins

    run = copy_run(reference_run, tmp_path / "run")
    before = tree_hash(run)
    real_open = builtins.open

    class HalfWritten:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if str(file).endswith("metrics.csv") and any(m in mode for m in "wa"):
            return HalfWritten(f)
        return f

    monkeypatch.setattr(builtins, "open", fake_open)
    status, _, stderr = cli([command, "--ckpt_path", str(run)])
    monkeypatch.undo()
    lines = error_lines(stderr)
    assert status == 3 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert f"logs/{command}-1/metrics.csv" in lines[0] and "unnamed" not in lines[0], lines[0]
    assert tree_hash(run) == before, "a partial file or folder was left"
