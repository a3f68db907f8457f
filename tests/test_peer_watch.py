"""The launcher's watch over its DDP workers: a stopped worker stops the launcher as Ctrl-C does.

Before, Fabric's observer SIGKILLed the launcher within 5 s of a worker's death unless the launcher
reached a collective first: exit 137, no line, no resume command (4 of 10 killed fits). References:
the README's exit-status table (8: another process of a DDP run stopped) and ``Popen.returncode``
of the killed worker. The end-to-end check under Fabric is in ``test_multiprocess_errors.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from fedshard_lightning.errors import PeerStopped
from fedshard_lightning.launch import exits, peer_watch
from fedshard_lightning.launch.exits import PEER_STOPPED, one_line_errors
from fedshard_lightning.launch.peer_watch import PeerWatcher, describe_exit, launch_watched, stopped_peer


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    monkeypatch.setattr(peer_watch, "_procs", [])
    monkeypatch.setattr(peer_watch, "_done", threading.Event())
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def _worker() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _train(seconds: float) -> None:
    """The launcher's own work between collectives: Python, no wait on the workers."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        sum(range(100))


def test_a_killed_worker_stops_the_launcher_with_its_rank_named():
    worker = _worker()
    watcher = PeerWatcher([worker], poll_s=0.05, grace_s=0.1, kill_after_s=30.0)
    watcher.start()
    os.kill(worker.pid, signal.SIGKILL)
    assert worker.wait() == -signal.SIGKILL  # the reference: the OS's account of the worker
    with pytest.raises(PeerStopped):  # stopped mid-work: _train would otherwise return after 120 s
        _train(120.0)
    watcher.join(timeout=30.0)  # it saw the main thread run on, and left it alone
    assert not watcher.is_alive()
    assert stopped_peer() == f"rank 1, pid {worker.pid}, killed by SIGKILL"


def test_a_launcher_handling_an_exception_is_left_to_finish_its_cleanup():
    worker = _worker()
    watcher = PeerWatcher([worker], poll_s=0.05, grace_s=0.05, kill_after_s=30.0)
    watcher.start()
    worker.kill()
    worker.wait()
    try:
        raise RuntimeError("gloo: Connection closed by peer")
    except RuntimeError:
        _train(0.5)  # the cleanup (the run folder's removal, the resume line) is not interrupted
    with pytest.raises(PeerStopped):
        _train(10.0)
    watcher.join(timeout=5.0)
    assert not watcher.is_alive()


def test_workers_that_finish_end_the_watch(monkeypatch):
    worker = subprocess.Popen([sys.executable, "-c", "pass"])
    watcher = PeerWatcher([worker], poll_s=0.05)
    watcher.start()
    watcher.join(timeout=10.0)
    assert not watcher.is_alive() and worker.returncode == 0 and stopped_peer() is None


def test_a_launcher_stuck_in_one_call_is_killed_after_its_line(monkeypatch, capsys):
    # NCCL can wait forever on a dead peer; the async exception only lands between bytecodes.
    killed = []
    monkeypatch.setattr(PeerWatcher, "_kill_all", lambda self, failed: killed.append(failed))
    worker = _worker()
    watcher = PeerWatcher([worker], poll_s=0.05, grace_s=0.05, kill_after_s=0.3)
    watcher.start()
    worker.kill()
    with pytest.raises(PeerStopped):  # raised once the call returns
        time.sleep(1.0)
        _train(5.0)
    watcher.join(timeout=5.0)
    assert killed == [describe_exit(1, worker.pid, -signal.SIGKILL)]


def test_the_line_names_the_rank_and_exit_status_8(monkeypatch, capsys):
    monkeypatch.setattr(exits, "stopped_peer", lambda wait_s=0.0: "rank 1, pid 42, killed by SIGKILL")
    with pytest.raises(SystemExit) as e, one_line_errors():
        raise PeerStopped()
    assert e.value.code == PEER_STOPPED == 8
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        "error: another process of this DDP run stopped (rank 1, pid 42, killed by SIGKILL)"
    )
    assert "resumes with --ckpt_path RUN_DIR" in err
    stopped = PeerStopped()
    stopped.removed_run_dir = "/runs/version_3"  # killed before fit's first commit: nothing to resume
    with pytest.raises(SystemExit), one_line_errors():
        raise stopped
    err = capsys.readouterr().err
    assert "nothing was committed, so /runs/version_3 was removed" in err and "--ckpt_path" not in err


def test_a_command_that_is_over_is_not_stopped():
    # Its atexit work (loggers, W&B) runs after the command; a worker failing then (its own
    # teardown) must not cut it with PeerStopped.
    worker = _worker()
    watcher = PeerWatcher([worker], poll_s=0.05, grace_s=0.05)
    watcher.start()
    with pytest.raises(SystemExit), one_line_errors():
        raise SystemExit(0)  # the command returned
    worker.kill()
    _train(1.0)  # no PeerStopped
    watcher.join(timeout=5.0)
    assert not watcher.is_alive()


def test_describe_exit():
    assert describe_exit(2, 7, -15) == "rank 2, pid 7, killed by SIGTERM"
    assert describe_exit(1, 7, 2) == "rank 1, pid 7, exit status 2"


def test_the_launch_starts_our_watcher_in_place_of_fabrics_observer():
    # The name is Lightning's; if it goes, Fabric's killing observer would come back unnoticed.
    from lightning.fabric.strategies.launchers import subprocess_script

    original = subprocess_script._launch_process_observer
    seen = []

    class Fabric:
        def launch(self) -> None:
            seen.append(subprocess_script._launch_process_observer)
            subprocess_script._launch_process_observer([])  # no workers: the watcher ends at once

    launch_watched(Fabric())
    assert seen and seen[0] is not original
    assert subprocess_script._launch_process_observer is original
