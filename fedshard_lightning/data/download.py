"""Verified, resumable downloads and atomic extraction of dataset files (stdlib ``urllib`` only).

Every file is described by a :class:`RemoteFile` carrying its published checksum, so a
truncated transfer, a corrupt mirror or a file a user dropped in by hand is caught before any
training sees it. Downloads land in ``<name>.part`` and are renamed to their final name only once
verified, so a file under its final name is always complete; archives are unpacked into a
temporary folder and moved into place, with a marker file recording that the unpacking finished.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from fedshard_lightning.data.extract import _locked, _one_line, extract
from fedshard_lightning.errors import DataError

__all__ = [
    "MissingFilesError",
    "RemoteFile",
    "extract",
    "fetch",
    "file_digests",
    "find_first",
    "load_or_download",
    "missing_files_error",
    "set_aside",
    "unofficial",
    "verify",
]

_CHUNK = 1 << 20
#: Files at least this large get a progress bar (when stderr is a terminal).
PROGRESS_MIN_BYTES = 1 << 20
#: Seconds before the second round of attempts; doubles per round (tests set it to 0).
RETRY_BACKOFF_S = 1.0
#: Some dataset hosts (NIST) refuse urllib's default User-Agent with HTTP 403.
USER_AGENT = "Mozilla/5.0 (compatible; fedshard-lightning dataset fetcher)"
_HEX = re.compile(r"[0-9a-f]+")
_log = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class RemoteFile:
    """One downloadable file and its published checksum.

    Args:
        name: File name on disk (no folders).
        urls: Where to get it: the official location first, then mirrors.
        sha256: Published SHA-256 hex digest, where one is known.
        md5: Published MD5 hex digest (what CIFAR, SVHN, MNIST and torchvision publish).
        size: Size in bytes, where known; a cheap first check and the progress-bar total.
    """

    name: str
    urls: tuple[str, ...]
    sha256: str | None = None
    md5: str | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        if not self.name or Path(self.name).name != self.name or self.name in (".", ".."):
            raise ValueError(f"RemoteFile name {self.name!r} must be a plain file name")
        if isinstance(self.urls, str) or not self.urls:
            raise ValueError(f"RemoteFile {self.name}: urls must be a non-empty tuple of URLs")
        object.__setattr__(self, "urls", tuple(self.urls))
        if self.sha256 is None and self.md5 is None:
            raise ValueError(f"RemoteFile {self.name}: set sha256 or md5, a download is never trusted blind")
        for algo, digest, length in (("sha256", self.sha256, 64), ("md5", self.md5, 32)):
            if digest is not None and (len(digest) != length or not _HEX.fullmatch(digest)):
                raise ValueError(f"RemoteFile {self.name}: {algo} must be {length} lowercase hex digits")

    def with_urls(self, *urls: str) -> RemoteFile:
        """The same file (same checksums) fetched from other URLs, e.g. a local mirror."""
        return replace(self, urls=tuple(urls))

    @property
    def expected(self) -> str:
        """The checksums to match, as ``algo digest`` words."""
        parts = []
        if self.sha256 is not None:
            parts.append(f"sha256 {self.sha256}")
        if self.md5 is not None:
            parts.append(f"md5 {self.md5}")
        return ", ".join(parts)


def _digests(path: Path, file: RemoteFile) -> dict[str, str]:
    """Hash ``path`` once with every algorithm ``file`` names."""
    hashers = {}
    if file.sha256 is not None:
        hashers["sha256"] = hashlib.sha256()
    if file.md5 is not None:
        hashers["md5"] = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            for h in hashers.values():
                h.update(chunk)
    return {algo: h.hexdigest() for algo, h in hashers.items()}


def file_digests(path: Path) -> dict[str, str]:
    """SHA-256 and MD5 of ``path`` in one read (what the run's fingerprint and the checks compare)."""
    hashers = {"sha256": hashlib.sha256(), "md5": hashlib.md5(usedforsecurity=False)}
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            for h in hashers.values():
                h.update(chunk)
    return {algo: h.hexdigest() for algo, h in hashers.items()}


def unofficial(file: RemoteFile, digests: dict[str, str]) -> str | None:
    """``algo OFFICIAL official, HERE here`` where ``digests`` are not ``file``'s published ones, else None."""
    for algo, want in (("sha256", file.sha256), ("md5", file.md5)):
        if want is not None and digests.get(algo) != want:
            return f"{algo} {want} official, {digests.get(algo)} here"
    return None


def _mismatch(path: Path, file: RemoteFile, quick: bool = False) -> str | None:
    """None when ``path`` matches ``file``, else ``expected ..., got ...`` with checksums and sizes.

    With ``quick``, a wrong size is reported without hashing the file.
    """
    actual_size = path.stat().st_size
    size_ok = file.size is None or actual_size == file.size
    if quick and not size_ok:
        return f"expected {file.size} bytes, got {actual_size} bytes"
    digests = _digests(path, file)
    wanted = {"sha256": file.sha256, "md5": file.md5}
    if size_ok and all(digest == wanted[algo] for algo, digest in digests.items()):
        return None
    size = f" ({file.size} bytes)" if file.size is not None else ""
    got = ", ".join(f"{algo} {digest}" for algo, digest in digests.items())
    return f"expected {file.expected}{size}, got {got} ({actual_size} bytes)"


def verify(path: Path, file: RemoteFile) -> bool:
    """Whether ``path`` exists and matches every checksum (and the size) of ``file``."""
    path = Path(path)
    return path.is_file() and _mismatch(path, file, quick=True) is None


class _Truncated(OSError):
    """The server closed the connection before sending the announced length."""


class _ProgressBar:
    """A rich byte-progress bar on stderr, or nothing (not a terminal, small file, or disabled)."""

    def __init__(self, name: str, total: int | None, initial: int, progress: bool) -> None:
        self._progress = None
        if progress and sys.stderr.isatty() and (total is None or total >= PROGRESS_MIN_BYTES):
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._task = self._progress.add_task(name, total=total, completed=initial)

    def __enter__(self) -> _ProgressBar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, n: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=n)


def _download(url: str, part: Path, file: RemoteFile, progress: bool, timeout: float) -> None:
    """Transfer ``url`` into ``part``, resuming an existing partial file with an HTTP Range request."""
    offset = part.stat().st_size if part.exists() else 0
    if file.size is not None and offset > file.size:
        part.unlink()
        offset = 0
    if file.size is not None and offset == file.size:
        return  # complete but unverified: the caller verifies it
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    request = urllib.request.Request(url, headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset:
            return  # nothing left to send: the .part is complete (verified by the caller)
        raise
    with response:
        status = response.status
        mode = "ab"
        if offset and status == 206:
            content_range = response.headers.get("Content-Range", "")
            if not content_range.startswith(f"bytes {offset}-"):
                part.unlink()  # cannot splice this answer onto the partial file: restart next time
                raise _Truncated(f"server answered Range {offset}- with Content-Range {content_range!r}")
        else:
            offset, mode = 0, "wb"  # no Range support (200): start over
        length = response.headers.get("Content-Length")
        expected_body = int(length) if length is not None and length.isdigit() else None
        total = offset + expected_body if expected_body is not None else file.size
        received = 0
        with open(part, mode) as out, _ProgressBar(file.name, total, offset, progress) as bar:
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
        if expected_body is not None and received < expected_body:
            raise _Truncated(f"connection closed after {received} of {expected_body} bytes")


def _retryable(error: BaseException) -> bool:
    """Server-side and network errors are worth a retry; 'not found' or 'forbidden' are not."""
    if isinstance(error, urllib.error.HTTPError):
        return error.code >= 500 or error.code in (408, 425, 429)
    return not isinstance(error, ValueError)  # ValueError: a malformed URL


def fetch(file: RemoteFile, root: Path, progress: bool = True, retries: int = 3, timeout: float = 60) -> Path:
    """Download ``file`` into ``root`` unless a verified copy is already there.

    Idempotent: a complete, verified file is returned without touching the network; a file
    under the final name that fails verification (one placed by hand, say) is renamed
    ``<name>.bad`` and fetched again. The transfer goes
    to ``<name>.part`` (resumed with an HTTP Range request after an interruption, restarted if the
    server ignores ranges) and is checked before the atomic rename, so a bad download never
    appears under the final name.

    Args:
        file: What to fetch and the checksum it must match.
        root: Target folder (created if needed).
        progress: Show a progress bar for large files when stderr is a terminal.
        retries: Rounds of attempts: each round tries every URL in order (official first, then
            mirrors), with exponential backoff between rounds; a URL answering 404/403 or
            serving a bad file is dropped.
        timeout: Socket timeout in seconds.

    Returns:
        The path of the verified file.

    Raises:
        DataError: Every URL failed, or the downloaded bytes do not match the checksum (the bad
            download is removed).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{file.name}.lock"):
        return _fetch_locked(file, root, progress, retries, timeout)


def _fetch_locked(file: RemoteFile, root: Path, progress: bool, retries: int, timeout: float) -> Path:
    final = root / file.name
    part = root / (file.name + ".part")
    if final.exists():
        if verify(final, file):
            return final
        set_aside(final, _mismatch(final, file, quick=True) or "")
    errors: dict[str, str] = {}  # last error per URL
    mismatch: str | None = None
    active = list(file.urls)  # URLs still worth trying, in order (official first)
    for round_ in range(max(1, retries)):
        if round_:
            time.sleep(RETRY_BACKOFF_S * 2 ** (round_ - 1))
        for url in list(active):
            resumed = part.exists() and part.stat().st_size > 0
            try:
                _download(url, part, file, progress, timeout)
            except (OSError, http.client.HTTPException, ValueError) as e:
                errors[url] = _one_line(e)
                if not _retryable(e):
                    active.remove(url)
                continue
            mismatch = _mismatch(part, file)
            if mismatch is None:
                os.replace(part, final)
                return final
            part.unlink()
            errors[url] = "checksum mismatch"
            if not resumed:
                active.remove(url)  # a fresh full copy from this URL is bad: it will not improve
        if not active:
            break
    by_hand = (
        f"or put {file.name} ({file.expected}) into {root} yourself, extracted or not, and run with "
        "--data.download false"
    )
    if mismatch is not None:
        raise DataError(
            f"download of {file.name} failed verification: {mismatch}; the bad download was removed "
            f"(tried {len(file.urls)} URL(s): {', '.join(file.urls)}); {by_hand}"
        )
    tried = "; ".join(f"{url}: {error}" for url, error in errors.items())
    raise DataError(
        f"could not download {file.name} into {root} ({max(1, retries)} rounds): {tried}; "
        f"check the network and retry, {by_hand}"
    )


def set_aside(path: Path, reason: str) -> Path:
    """Rename a file that fails verification to ``<name>.bad`` (never delete what a user placed).

    A second bad copy becomes ``<name>.bad.2`` and so on, so no earlier one is overwritten either.
    """
    bad = path.with_name(path.name + ".bad")
    n = 1
    while bad.exists():
        n += 1
        bad = path.with_name(f"{path.name}.bad.{n}")
    os.replace(path, bad)
    message = f"{path} fails verification ({reason}): kept as {bad.name}, fetching a verified copy"
    _log.warning(message)
    return bad


class MissingFilesError(DataError):
    """Dataset files are absent (as opposed to present but corrupt)."""


def missing_files_error(dataset: str, directory: Path, expected: list[str], source: str) -> DataError:
    """One-line error for absent dataset files: what, where, from where, and the download switch."""
    return MissingFilesError(
        f"{dataset}: files not found in {directory}: expected {', '.join(expected)}; "
        f"get them from {source} or set download: true (data.download: true) to fetch them"
    )


def find_first(directory: Path, names: Iterable[str]) -> Path | None:
    """The first of ``names`` that exists as a file in ``directory`` (e.g. ``x.gz`` before ``x``)."""
    for name in names:
        path = Path(directory) / name
        if path.is_file():
            return path
    return None


def load_or_download(datamodule: Any, load: Callable[[bool], _T], train: bool) -> _T:
    """``load(train)``, downloading first if files are missing and ``datamodule.download`` is set.

    Lightning's Trainer calls ``prepare_data`` before ``setup``, but a Fabric loop may call only
    ``setup``; with ``download: true`` that must still fetch the files rather than fail.
    """
    try:
        return load(train)
    except MissingFilesError:
        if not datamodule.download:
            raise
    datamodule.prepare_data()
    return load(train)
