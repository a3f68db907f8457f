"""FLCache's file primitives: checksums, atomic writes, durable syncs, stale temporaries, the writer lock.

Every write goes to ``.NAME.tmp-PID`` and is renamed into place; leftovers of killed writers (whose
process no longer exists) are removed by the next write. Nothing here unpickles.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedshard_lightning.errors import CacheError

if TYPE_CHECKING:  # torch is imported where tensors are read or written: `runs` lists runs without it
    import torch
    from torch import Tensor

__all__ = [
    "atomic_save_tensors",
    "atomic_write_bytes",
    "atomic_write_json",
    "load_tensors",
    "read_json_object",
    "remove_stale_tmp",
    "sha256_file",
    "writing",
]

BLOBS = "blobs"
_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


def remove_stale_tmp(directory: Path, name: str | None = None) -> list[Path]:
    """Remove ``.NAME.tmp-PID`` leftovers of writers that were killed (their process is gone).

    Args:
        directory: Folder to clean.
        name: Only leftovers of this file or folder name; ``None``: every leftover.

    Returns:
        The removed paths.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = _TMP.match(entry.name)
        if m is None or (name is not None and m.group("name") != name) or _pid_alive(int(m.group("pid"))):
            continue
        path = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


@contextlib.contextmanager
def writing(tmp: Path, final: Path) -> Iterator[None]:
    """Remove the temporary ``tmp`` when its write fails, and name ``final`` in an OS error without a path.

    ``f.write`` raises ENOSPC or EFBIG without a file name; the CLI's one-line message needs one.
    """
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(OSError):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp)
            else:
                tmp.unlink()
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(final)) from None
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, fsync, rename over ``path``."""
    path = Path(path)
    remove_stale_tmp(path.parent, path.name)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(tmp, path):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any, indent: int | None = 2) -> None:
    """JSON version of :func:`atomic_write_bytes`; ``indent=None`` writes one line (C encoder, compact)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=indent, sort_keys=True) + "\n").encode())


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A run's small JSON record (metrics, numerics, W&B state), or None when missing or damaged.

    For records a run can do without; the cache's own manifests are read strictly instead.
    """
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError):  # ValueError: not JSON, or not UTF-8
        return None
    return data if isinstance(data, dict) else None


def atomic_save_tensors(
    path: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None
) -> str:
    """Save with safetensors atomically; returns the file's SHA-256."""
    # Serialized here and written by Python: safetensors' own writer reports a full disk as a
    # SafetensorError, not as the OSError (ENOSPC) that the CLI turns into one line.
    from safetensors.torch import save

    data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)
    atomic_write_bytes(Path(path), data)
    return hashlib.sha256(data).hexdigest()


def load_tensors(
    path: Path, expected_sha256: str | None = None, device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """Load a safetensors file (no pickle), checking its checksum first when given."""
    path = Path(path)
    if not path.is_file():
        raise CacheError(f"missing tensor file {path}; the run directory is incomplete or was moved")
    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise CacheError(
            f"checksum mismatch for {path}: the file was modified or corrupted; refusing to load it"
        )
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise CacheError(f"{path} is not a valid safetensors file ({e}); refusing to load it") from None


def _plain_name(name: str) -> bool:
    """A single path component that is not hidden: no separators, not ``.``/``..``."""
    return (
        bool(name)
        and not name.startswith(".")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and Path(name).name == name
    )


def _sync_paths(paths: Sequence[Path], directories: set[Path]) -> None:
    """Make new files and their directory entries durable: ``syncfs`` once, else ``fsync`` each."""
    if not paths and not directories:
        return
    if len(paths) > 32 and sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(next(iter(directories)), os.O_RDONLY)
            try:
                if libc.syncfs(fd) == 0:
                    return
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            pass
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in directories:
        _fsync_dir(d)


@contextlib.contextmanager
def _flock(path: Path, blocking: bool = True, busy: str | None = None) -> Iterator[None]:
    """Exclusive ``flock`` on a folder (no file is created; released on exit, even by a kill).

    Args:
        path: The folder.
        blocking: Wait for the lock; otherwise raise ``CacheError(busy)`` when it is taken.
        busy: Message of that error.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            raise CacheError(busy or f"{path} is locked by another process") from None
        yield
    finally:
        os.close(fd)
