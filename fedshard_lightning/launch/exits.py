"""How a command's process ends: the one-line answer to every failure, and its exit status.

The CLI (:func:`fedshard_lightning.cli.main`) and the commands that need no config
(:mod:`fedshard_lightning.cli.no_config`, answered before Lightning and torch are imported) share
it, so both answer a user error, an interrupt or an OS fault with the same line and exit status.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from typing import NoReturn

from fedshard_lightning.errors import FedShardError, PeerStopped, Terminated
from fedshard_lightning.launch.os_faults import describe
from fedshard_lightning.launch.peer_watch import stand_down, stopped_peer

__all__ = ["PEER_STOPPED", "one_line", "one_line_errors"]

PEER_STOPPED = 8  # exit status: another process of a DDP run stopped (killed, or failed)
_PEER_LOST = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe", re.IGNORECASE)


def one_line(message: str, limit: int = 600) -> str:
    """The message on one line; a long one loses its middle (a long path), never its end (the reason)."""
    text = " ".join(str(message).split())
    if len(text) <= limit:
        return text
    tail = limit // 2
    return text[: limit - tail - 5] + " ... " + text[-tail:]


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """User errors exit 2, Ctrl-C 130, SIGTERM 143, a stopped DDP peer 8, OS faults 3..7: one line on stderr."""
    try:
        try:
            yield
        finally:
            stand_down()  # the command is over (done, or failing with its own line): no peer to stop it
    except FedShardError as e:
        _say(f"error: {one_line(str(e))}")
        _exit(2)
    except PeerStopped as e:  # the launcher's watcher saw a worker stop while this process trained
        _peer_stopped(stopped_peer() or "a worker", e)
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        _say("terminated (SIGTERM)" if terminated else "interrupted")
        _exit(143 if terminated else 130)
    except OSError as e:  # disk full, read-only, ulimit -f, no permission: one line, exit 3..7
        code, line = describe(e)
        _say(one_line(line))
        _exit(code)
    except RuntimeError as e:
        lost = _peer_lost(e)
        if lost is None:
            raise
        # The launcher names the stopped rank; a worker (no watcher) names the socket.
        _peer_stopped(stopped_peer(wait_s=1.0) or lost, e)


def _peer_stopped(which: str, e: BaseException) -> NoReturn:
    """The one line for a run whose other process stopped, and exit status 8."""
    removed = getattr(e, "removed_run_dir", None)  # set by fit when the run held nothing to keep
    again = "(an interrupted fit resumes with --ckpt_path RUN_DIR)"
    if removed:
        again = f"(nothing was committed, so {removed} was removed: run the fit again)"
    _say(
        f"error: another process of this DDP run stopped ({which}); its own line, if it wrote one, "
        f"is above; run the command again once its cause is gone {again}"
    )
    _exit(PEER_STOPPED)


def _exit(status: int) -> NoReturn:
    """Exit with ``status``, the gloo process group destroyed first.

    A process that exits on an error with the group alive (a peer's loss, SIGTERM) may abort while
    torch tears gloo's threads down: ``terminate called without an active exception`` after the
    line, status 134 instead of ours (3 of 20 two-process trials of the peer's side). NCCL is left
    as it was: its destruction can wait on the peers.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # exiting anyway: a failed teardown must not replace the line
            if dist.get_backend() == "gloo":
                dist.destroy_process_group()
    raise SystemExit(status) from None


def _say(line: str) -> None:
    """Write the line on rank zero only: DDP ranks fail alike, and rank zero speaks for the run.

    A rank other than zero (``RANK``, or ``LOCAL_RANK`` as Fabric's launcher sets it) stays quiet;
    its exit status is the same.
    """
    try:
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
    except ValueError:
        rank = 0
    if rank == 0:
        sys.stderr.write(line + "\n")


def _peer_lost(e: RuntimeError) -> str | None:
    """What a collective says when another process of the run is gone (gloo), else None.

    Only while a process group exists: elsewhere the same words are some other failure, whose
    traceback must stay.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    found = _PEER_LOST.search(str(e))
    return found.group(0) if found else None
