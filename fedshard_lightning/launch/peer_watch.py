"""The launcher's watch over its DDP workers: a stopped worker stops the launcher cleanly, with exit 8.

Fabric's launcher (``strategy: ddp``) starts a thread that polls the workers every 5 s and, when
one has exited with a non-zero status, SIGKILLs every process, itself included. A killed worker
thus took the launcher down with status 137 and no line, whenever the launcher was training
rather than waiting in a collective (where gloo reports the lost peer at once): 4 of 10 trials
that SIGKILLed rank 1 during a digits fit. This module starts our watcher in its place. It gives
the launcher a moment to stop by itself (gloo's error, or the launcher's own), then stops it as
Ctrl-C does, with :class:`~fedshard_lightning.errors.PeerStopped`, so the fit prints the command
that resumes it and the CLI its one line; only a launcher that still has not stopped 30 s later
(stuck in a collective that never notices, as NCCL can) is killed as Fabric did, after its line.

No Lightning or torch import at module level: :mod:`fedshard_lightning.launch.exits` reads
:func:`stopped_peer` to name the stopped rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fedshard_lightning.errors import PeerStopped

if TYPE_CHECKING:  # `runs` imports this module (via no_config): it starts in milliseconds
    import subprocess

__all__ = ["PeerWatcher", "describe_exit", "launch_watched", "stand_down", "stopped_peer"]

_procs: list[subprocess.Popen] = []  # the workers this process launched, procs[i] being rank i + 1
_done = threading.Event()  # the command is over: nothing left to stop


def stand_down() -> None:
    """End the watch: the command has finished or is exiting on its own error.

    Its atexit work (loggers, W&B) must not be cut by :class:`PeerStopped` when a worker fails
    late, e.g. in its own teardown.
    """
    _done.set()


def stopped_peer(wait_s: float = 0.0) -> str | None:
    """The first worker of this launcher that failed, as ``rank 1, pid 123, killed by SIGKILL``, or None.

    Waits up to ``wait_s`` for one: gloo reports a lost peer as soon as its socket closes, a moment
    before the worker's exit can be collected; the wait lets the line name the rank, not the socket.
    """
    deadline = time.monotonic() + wait_s
    while True:
        for rank, proc in enumerate(_procs, start=1):
            code = proc.poll()
            if code:
                return describe_exit(rank, proc.pid, code)
        if not _procs or time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def describe_exit(rank: int, pid: int, code: int) -> str:
    """``rank 1, pid 123, killed by SIGKILL`` or ``rank 1, pid 123, exit status 2``."""
    if code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exit status {code}"
    return f"rank {rank}, pid {pid}, {how}"


def _raise_in(thread_id: int, exc: type[BaseException]) -> bool:
    """Raise ``exc`` in another thread of this process at its next bytecode (CPython)."""
    import ctypes

    set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async.argtypes = [ctypes.c_ulong, ctypes.py_object]
    set_async.restype = ctypes.c_int
    return set_async(thread_id, exc) == 1


def _handling(current: Any) -> bool:
    """Whether a thread handles an exception: ``sys._current_exceptions()`` gives a triple up to 3.11."""
    if isinstance(current, tuple):
        return current[0] is not None
    return current is not None


class PeerWatcher(threading.Thread):
    """Poll the workers; when one fails, stop the launcher's main thread as Ctrl-C does.

    Args:
        procs: The workers, ``procs[i]`` being local rank ``i + 1`` (Fabric's ``launcher.procs``).
        poll_s: Seconds between polls (``Popen.poll`` costs microseconds).
        grace_s: Seconds the launcher gets to stop by itself once a worker has failed: a launcher
            waiting in a collective has gloo's error then, and one that failed alike (bad input
            refused on every rank) prints its own line.
        kill_after_s: Seconds after which a launcher that still runs is killed, as Fabric did.
    """

    def __init__(
        self,
        procs: list[subprocess.Popen],
        poll_s: float = 0.5,
        grace_s: float = 2.0,
        kill_after_s: float = 30.0,
    ) -> None:
        super().__init__(daemon=True, name="fedshard-peer-watch")  # ends with the process
        self.procs, self.poll_s, self.grace_s, self.kill_after_s = procs, poll_s, grace_s, kill_after_s
        self.main_id = threading.main_thread().ident or 0

    def start(self) -> None:
        """Start watching; from now on :func:`stopped_peer` names a failed worker."""
        _procs.extend(self.procs)
        super().start()

    def run(self) -> None:
        """Wait for a failed worker, give the launcher ``grace_s``, then stop it (or, stuck, kill it)."""
        failed = self._wait_for_a_failure()
        if failed is None:
            return
        time.sleep(self.grace_s)
        if sys.implementation.name != "cpython":  # no way to raise in the main thread: as Fabric did
            self._kill_all(failed)
        while not self._stop_main():
            if sys.is_finalizing():
                return
            time.sleep(self.poll_s)
        if _done.is_set():
            return
        stuck_at = self._main_position()
        deadline = time.monotonic() + self.kill_after_s
        while time.monotonic() < deadline:
            time.sleep(self.poll_s)
            if self._main_position() != stuck_at:
                return  # it runs Python again: the exception was raised, and it stops (or was caught)
        self._kill_all(failed)  # stuck in one call since: a collective that never notices

    def _stop_main(self) -> bool:
        """Raise :class:`PeerStopped` in the main thread, unless it is handling an exception.

        A main thread handling one is already stopping: raising into its except or finally block
        would cut its cleanup short (the run folder's removal, the resume line).
        """
        if _done.is_set():
            return True
        if _handling(sys._current_exceptions().get(self.main_id)):
            return False
        return _raise_in(self.main_id, PeerStopped)

    def _main_position(self) -> tuple[Any, int] | None:
        """The main thread's innermost frame and instruction; unchanged while it waits inside one call."""
        frame = sys._current_frames().get(self.main_id)
        return None if frame is None else (frame, frame.f_lasti)

    def _wait_for_a_failure(self) -> str | None:
        """The first failed worker, described; None once every worker has exited with status 0."""
        while not _done.is_set():
            time.sleep(self.poll_s)
            failed = stopped_peer()
            if failed is not None:
                return failed
            if all(proc.returncode == 0 for proc in self.procs):
                return None
        return None

    def _kill_all(self, failed: str) -> None:
        """Fabric's last resort, after the line the launcher could not write itself."""
        sys.stderr.write(
            f"error: another process of this DDP run stopped ({failed}) and this one could not stop "
            "by itself; killing it (an interrupted fit resumes with --ckpt_path RUN_DIR)\n"
        )
        sys.stderr.flush()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _our_watcher(launchers: Any) -> Iterator[None]:
    """Start :class:`PeerWatcher` where Fabric's launcher starts its killing observer."""
    name = "_launch_process_observer"
    original = getattr(launchers, name, None)
    if original is None:  # a Lightning without the observer: nothing to replace
        yield
        return
    setattr(launchers, name, lambda procs: PeerWatcher(procs).start())
    try:
        yield
    finally:
        setattr(launchers, name, original)


def launch_watched(fabric: Any) -> None:
    """``fabric.launch()``, with the workers watched by :class:`PeerWatcher` instead of Fabric's observer."""
    from lightning.fabric.strategies.launchers import subprocess_script

    with _our_watcher(subprocess_script):
        fabric.launch()
