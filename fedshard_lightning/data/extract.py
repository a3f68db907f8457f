"""Atomic, idempotent unpacking of dataset archives (tar, zip, gzip), safe against hostile members.

An archive is unpacked into a temporary folder next to its destination and moved into place file
by file; a marker file records that the unpacking finished, so a later call does nothing and an
interrupted one leaves no half-written file. Concurrent runs sharing a data folder take turns
through an advisory lock (also used by :func:`fedshard_lightning.data.download.fetch`).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from fedshard_lightning.errors import DataError

__all__ = ["extract"]

_CHUNK = 1 << 20


def _one_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return " ".join(text.split())


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock, so concurrent runs sharing a data folder take turns."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _move_into(src: Path, dst: Path) -> None:
    """Rename every file of ``src`` into ``dst``, merging with folders already there.

    Each rename is atomic, and files from other extractions (e.g. another EMNIST split) are kept.
    """
    for entry in sorted(src.iterdir()):
        target = dst / entry.name
        if entry.is_dir() and target.is_dir() and not target.is_symlink():
            _move_into(entry, target)
            continue
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.replace(entry, target)


def _marker(archive: Path, dest: Path, members: list[str] | None) -> Path:
    key = archive.name
    if members is not None:
        key += "-" + hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest()[:12]
    return dest / f".{key}.extracted"


def _safe_tar_extract(tar: tarfile.TarFile, target: Path, names: set[str] | None) -> None:
    members = [m for m in tar.getmembers() if names is None or m.name in names]
    if names is not None and len(members) != len(names):
        missing = sorted(names - {m.name for m in members})
        raise DataError(f"{', '.join(missing)} not found in the archive")
    if hasattr(tarfile, "data_filter"):
        tar.extractall(target, members=members, filter="data")
        return
    for m in members:  # Python without extraction filters: refuse anything but plain files and folders
        path = Path(m.name)
        if path.is_absolute() or ".." in path.parts or not (m.isfile() or m.isdir()):
            raise DataError(f"unsafe member {m.name!r} in the archive")
    tar.extractall(target, members=members)


def extract(archive: Path, dest: Path, members: Iterable[str] | None = None) -> Path:
    """Unpack a ``.tar.gz``/``.tgz``/``.tar``, ``.zip`` or single-file ``.gz`` into ``dest``.

    Atomic and idempotent: everything is unpacked into a temporary folder next to ``dest`` and
    moved into place, then a marker file ``dest/.<archive>.extracted`` is written; a later call
    that finds the marker does nothing. An interrupted extraction leaves no half-written files
    under ``dest``.

    Args:
        archive: The archive file.
        dest: Folder to unpack into (created if needed).
        members: Only these member names (tar and zip), e.g. one split of a large archive.

    Returns:
        ``dest``.

    Raises:
        DataError: The archive is corrupt, unsupported, unsafe, or lacks a requested member.
    """
    archive, dest = Path(archive), Path(dest)
    names = None if members is None else sorted(set(members))
    marker = _marker(archive, dest, names)
    if marker.exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with _locked(marker.with_suffix(".lock")):
        if not marker.exists():  # another process may have finished while we waited
            _extract_locked(archive, dest, names, marker)
    return dest


def _extract_locked(archive: Path, dest: Path, names: list[str] | None, marker: Path) -> None:
    lower = archive.name.lower()
    tmp = Path(tempfile.mkdtemp(prefix=f".{archive.name}.", suffix=".tmp", dir=dest))
    try:
        try:
            if lower.endswith((".tar.gz", ".tgz", ".tar")):
                with tarfile.open(archive, "r:*") as tar:
                    _safe_tar_extract(tar, tmp, None if names is None else set(names))
            elif lower.endswith(".zip"):
                with zipfile.ZipFile(archive) as zf:
                    available = set(zf.namelist())
                    missing = [n for n in names or () if n not in available]
                    if missing:
                        raise DataError(f"{', '.join(missing)} not found in the archive")
                    zf.extractall(tmp, members=names)  # zipfile drops absolute and '..' components
            elif lower.endswith(".gz"):
                with gzip.open(archive, "rb") as src, open(tmp / archive.name[:-3], "wb") as out:
                    shutil.copyfileobj(src, out, _CHUNK)
            else:
                raise DataError("unsupported archive type (expected .tar.gz, .tgz, .tar, .zip or .gz)")
        except DataError as e:
            raise DataError(f"cannot extract {archive}: {e}") from None
        except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile) as e:
            raise DataError(f"cannot extract {archive}: corrupt or truncated archive ({_one_line(e)})") from e
        _move_into(tmp, dest)
        marker.write_text(f"{archive.name}\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
