"""Environment faults (disk full, read-only, file too large, no permission) as one line and an exit code.

The CLI turns an ``OSError`` from any command into ``error: <what> at <path>: <fix>`` and a
distinct exit status per kind, so scripts can tell a full disk from bad input (status 2)::

    3  no space left (ENOSPC, EDQUOT)      5  file too large (EFBIG, ``ulimit -f``)
    4  read-only file system (EROFS)       6  permission denied (EACCES, EPERM)
    7  any other OS error (EIO, ...)

Every write is atomic (a temporary sibling renamed into place), so a fault leaves the last
committed version, its model and its reports as they were; the failed writer's temporary files
are removed on the way out.
"""

from __future__ import annotations

import contextlib
import errno
import re
import signal

from fedshard_lightning.errors import Terminated

__all__ = ["EXIT_CODES", "OTHER_OS_ERROR", "describe", "ignore_sigxfsz", "terminate_as_interrupt"]

EXIT_CODES = {
    errno.ENOSPC: 3,
    errno.EDQUOT: 3,
    errno.EROFS: 4,
    errno.EFBIG: 5,
    errno.EACCES: 6,
    errno.EPERM: 6,
    # A folder where a file belongs, or the other way round: the run directory was changed by
    # hand, not the disk failing; bad input (2), like any other damaged run directory.
    errno.EISDIR: 2,
    errno.ENOTDIR: 2,
}
OTHER_OS_ERROR = 7

_FIXES = {
    2: "a folder stands where a file belongs (or the other way round): restore that path from a backup",
    3: "free space on that disk (or point trainer.default_root_dir at another one)",
    4: "remount that file system writable (or copy the run to a writable disk)",
    5: "raise the file-size limit (ulimit -f) or write to a disk that allows larger files",
    6: "give this user write access there (or copy the run to a folder it owns)",
}
_AGAIN = "then run the command again (an interrupted fit resumes with --ckpt_path RUN_DIR); committed versions are intact"
_TMP = re.compile(r"/\.(?P<name>[^/]+)\.tmp-[0-9]+(?=/|$)")


def _path(e: OSError) -> str:
    """The file the error is about, with a writer's temporary name shown as the file it replaces."""
    path = str(e.filename) if e.filename is not None else "an unnamed file"
    return _TMP.sub(lambda m: "/" + m.group("name"), path)


def describe(e: OSError) -> tuple[int, str]:
    """(exit status, one-line message) of an OS error."""
    code = EXIT_CODES.get(e.errno or 0, OTHER_OS_ERROR)
    name = errno.errorcode.get(e.errno or 0, "OSError")
    reason = e.strerror or str(e)
    fix = _FIXES.get(code, "check the disk and the path")
    removed = getattr(e, "removed_run_dir", None)  # set by fit when the run held nothing to keep
    committed = getattr(e, "committed_request", None)  # set by unlearn after its cache commit
    again = _AGAIN
    if removed:
        again = f"then run the fit again (nothing was committed, so {removed} was removed)"
    elif committed:
        again = (
            f"then run any command on the run (test, audit, unlearn): request {committed:04d} is committed "
            "in the cache, and loading the run writes its model and reports"
        )
    return code, f"error: {reason} ({name}) at {_path(e)}: {fix}, {again}"


def ignore_sigxfsz() -> None:
    """Ignore SIGXFSZ, so a write over ``ulimit -f`` fails with EFBIG (one line) instead of killing us."""
    if hasattr(signal, "SIGXFSZ"):
        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def terminate_as_interrupt() -> None:
    """Turn SIGTERM into :class:`~fedshard_lightning.errors.Terminated`: the same clean stop as Ctrl-C.

    A batch system's cancel sends SIGTERM; its default action kills the process without a word,
    where an interrupted fit should flush its logs and print the command that resumes it.
    """

    def _raise(signum: int, frame: object) -> None:
        raise Terminated(f"signal {signum}")

    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, _raise)
