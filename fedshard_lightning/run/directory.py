"""The run directory: creating it, finding it again, its lock, its request journal and crash recovery.

A run directory holds everything a run leaves behind::

    runs/version_3/
        config.yaml            resolved config (CLI runs)
        model.safetensors      the current global model (after every applied unlearning request)
        metrics.json           final metrics of fit
        logs/metrics.csv       per-round metrics (CSV logger)
        cache/                 FLCache (see fedshard_lightning.flcache.cache)
        unlearning/0001/report.json, unlearn_report.json, unlearning/journal.jsonl

The cache is the truth: :func:`recover_reports` re-creates request reports and journal entries
that a crash between the cache commit and those files left missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import unicodedata
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fedshard_lightning.errors import CacheError, ConfigError, FedShardError
from fedshard_lightning.flcache.cache import FLCache
from fedshard_lightning.flcache.io import (
    atomic_write_bytes,
    atomic_write_json,
    read_json_object,
    remove_stale_tmp,
)
from fedshard_lightning.launch.os_faults import EXIT_CODES
from fedshard_lightning.run.deployed import model_is_stale

__all__ = [
    "WRITTEN_FOLDERS",
    "Journal",
    "check_real_folders",
    "existing_run_dir",
    "model_is_stale",
    "new_run_dir",
    "recover_reports",
    "resume_hint",
    "run_lock",
]


def new_run_dir(root_dir: str, run_name: str | None, config_yaml: str | None = None) -> Path:
    """A new folder under the root, never an existing one; ``cache/`` inside marks it as a run.

    The CLI's resolved config (``config_yaml``) is written at once, before any data is read: a fit
    killed later is resumed with its own settings, and a folder without it (killed in between) is
    refused by a resume rather than trained with the package defaults.
    """
    root = Path(root_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if EXIT_CODES.get(e.errno, 2) > 2:  # a fault of the disk; 2: a path that is not a folder
            raise
        raise ConfigError(
            f"trainer.default_root_dir={str(root)!r}: cannot create it ({e.strerror})"
        ) from None
    if run_name and any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in run_name):
        raise ConfigError(
            f"trainer.run_name={run_name!r}: must not hold control characters (a newline, a tab, ...): "
            "they make a folder name that shells and listings misprint"
        )
    if run_name and (
        Path(run_name).name != run_name or run_name in (".", "..") or os.sep in run_name or "/" in run_name
    ):
        raise ConfigError(
            f"trainer.run_name={run_name!r}: must be a plain folder name, created inside "
            "trainer.default_root_dir (no '/', no '..')"
        )
    if run_name:
        candidates: Iterator[Path] = iter([root / run_name])
    else:
        nums = [
            int(p.name[8:]) for p in root.iterdir() if p.name.startswith("version_") and p.name[8:].isdigit()
        ]
        start = max(nums, default=-1) + 1
        candidates = (root / f"version_{n}" for n in range(start, start + 10_000))
    for path in candidates:
        try:
            path.mkdir()
        except FileExistsError:
            if run_name:
                raise ConfigError(
                    f"trainer.run_name={run_name!r}: {path} exists already; choose another name, or "
                    f"resume it with --ckpt_path {path}"
                ) from None
            continue
        except OSError as e:
            if EXIT_CODES.get(e.errno, 2) > 2:  # a fault of the disk; 2: a path that is not a folder
                raise  # disk full, read-only, no permission: the CLI's one line with its own exit status
            raise ConfigError(
                f"trainer.default_root_dir={str(root)!r}: cannot create {path} ({e.strerror})"
            ) from None
        try:
            (path / "cache").mkdir()
            if config_yaml is not None:
                atomic_write_bytes(path / "config.yaml", config_yaml.encode())
        except BaseException:  # disk full, read-only: leave no folder that looks like a run
            shutil.rmtree(path, ignore_errors=True)
            raise
        return path
    raise ConfigError(f"trainer.default_root_dir={str(root)!r}: no free version_N folder name")


def existing_run_dir(ckpt_path: str | None, command: str) -> Path:
    """The run directory named by ``--ckpt_path``, refused when it is not one."""
    if not ckpt_path:
        raise ConfigError(f"{command} needs --ckpt_path RUN_DIR (the folder that fit created)")
    path = Path(ckpt_path)
    if not path.is_dir():
        raise CacheError(f"ckpt_path={ckpt_path!r}: no such run directory")
    check_real_folders(path)
    cache = path / "cache"
    if command == "fit" and not _resumable(path):
        if _stopped_before_settings(path):
            raise CacheError(
                f"ckpt_path={ckpt_path!r} holds no config.yaml and no committed version: its fit stopped "
                "before it recorded its settings, so there is nothing to resume (a resume would train other "
                f"settings); remove the folder (rm -r {shlex.quote(str(path))}) and run fit again without --ckpt_path"
            )
        raise CacheError(
            f"ckpt_path={ckpt_path!r} is not a run directory that fit created (config.yaml or "
            "cache/FINGERPRINT and cache/ expected); start a new run without --ckpt_path"
        )
    if not cache.is_dir() and not (path / "model.safetensors").is_file():
        raise CacheError(
            f"ckpt_path={ckpt_path!r} is not a fedshard_lightning run directory (no cache/ inside)"
        )
    return path


#: The folders the commands write into, relative to the run directory.
WRITTEN_FOLDERS = (
    "cache",
    "cache/blobs",
    "logs",
    "unlearning",
    "tensorboard",
    "wandb_files",
    "wandb_files/wandb",
)


def check_real_folders(run_dir: Path) -> None:
    """Refuse a run whose written folders are symbolic links (or not folders), before anything is written.

    A planted link would send the new blobs, logs or reports outside the run (or into another
    one). Checked: :data:`WRITTEN_FOLDERS`, the blob fan-out folders and the entries of ``logs/``.
    """
    found = [run_dir / name for name in WRITTEN_FOLDERS]
    for parent in (run_dir / "logs", run_dir / "cache" / "blobs"):
        if parent.is_dir() and not parent.is_symlink():
            found += [p for p in parent.iterdir() if p.is_symlink()]
    for folder in found:
        if folder.is_symlink():
            raise CacheError(
                f"{folder} is a symbolic link; the folders a run writes into must be real folders (writes "
                "would land outside the run): replace it with a real folder"
            )
        if folder.exists() and not folder.is_dir():
            raise CacheError(f"{folder} is not a folder; the run directory is damaged (remove or rename it)")


def _resumable(path: Path) -> bool:
    """A folder that fit created and recorded its settings in: the config or fingerprint, or a commit.

    Without any of them a resume cannot know the run's settings; it would train the defaults.
    """
    cache = path / "cache"
    marks = [path / "config.yaml", cache / "FINGERPRINT", cache / "CURRENT"]
    return cache.is_dir() and not cache.is_symlink() and any(m.is_file() for m in marks)


def _stopped_before_settings(path: Path) -> bool:
    """Whether a folder holds only what a fit leaves before it records its settings.

    That is its ``cache/`` and ``logs/`` folders and the temporary files of a config or fingerprint
    write that was cut short; any other file means the folder is not (only) such a leftover.
    """
    cache = path / "cache"
    if not cache.is_dir() or cache.is_symlink():
        return False
    if not all(p.name in ("cache", "logs") or p.name.startswith(".config.yaml.tmp-") for p in path.iterdir()):
        return False
    return all(p.name.startswith(".FINGERPRINT.tmp-") for p in cache.iterdir())


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the run directory while a request reads and commits it.

    Two ``unlearn`` processes on one run would each read the same version and the later commit
    would drop the other's request; the second one now stops at once with a one-line error.
    The lock is ``flock`` on the directory itself (no file is created), taken by the launching
    process only (DDP workers have ``LOCAL_RANK`` or ``RANK`` > 0), and released on exit, even by a kill.
    """
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        fcntl = None
    if rank != 0 or fcntl is None:
        yield
        return
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FedShardError(
                f"ckpt_path={run_dir}: another process is unlearning from this run (or resuming, testing or "
                "auditing it) now; wait for it to finish, then run this command again"
            ) from None
        yield
    finally:
        os.close(fd)


class Journal:
    """``unlearning/journal.jsonl``: one fsync'ed line per request event (started, committed)."""

    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.path = run_dir / "unlearning" / "journal.jsonl"
        self.enabled = enabled

    def append(self, entry: dict[str, Any]) -> None:
        """Append one event (rank zero only)."""
        if not self.enabled:
            return
        folder = self.path.parent
        if folder.is_symlink():
            raise CacheError(
                f"{folder} is a symbolic link; a run directory's folders must be real (remove it)"
            )
        made_folder = not folder.exists()
        existed = self.path.exists() or self.path.is_symlink()
        entry = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), **entry}
        try:
            folder.mkdir(parents=True, exist_ok=True)
            try:  # never follow a link planted in the run directory: it could point at any file
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError:
                if self.path.is_symlink():
                    raise CacheError(
                        f"{self.path} is a symbolic link; the journal must be a regular file (remove the link)"
                    ) from None
                raise
            with os.fdopen(fd, "a") as f:
                # A crash mid-append leaves a torn last line: start on a line of our own after it.
                torn = existed and _ends_without_newline(self.path)
                f.write(("\n" if torn else "") + json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # disk full, read-only: leave the run directory as it was
            if not existed:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            if made_folder:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            if e.filename is None and e.errno is not None:
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            raise

    def committed(self) -> set[int]:
        """Request numbers with a ``committed`` line (lines torn by a crash are skipped)."""
        return set(self.committed_entries())

    def committed_entries(self) -> dict[int, dict[str, Any]]:
        """The ``committed`` lines by request number (lines torn by a crash are skipped)."""
        done: dict[int, dict[str, Any]] = {}
        if self.path.is_file():
            for line in self.path.read_bytes().decode("utf-8", errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    continue
                if not isinstance(entry, dict) or entry.get("event") != "committed":
                    continue
                request = entry.get("request")
                if isinstance(request, int) and not isinstance(request, bool):  # a damaged line is skipped
                    done[request] = entry
        return done


def _ends_without_newline(path: Path) -> bool:
    """Whether a non-empty file's last byte is not a newline."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _version_with_requests(cache: FLCache, n: int) -> str | None:
    """The oldest cache version whose manifest holds at least ``n`` requests (where request n landed)."""
    for version in cache.versions():
        try:  # the raw manifest: the request log is a list of blob digests (format 2), none is read
            raw = json.loads((cache.root / version / "manifest.json").read_bytes())
        except (OSError, ValueError):
            continue
        log = raw.get("requests", []) if isinstance(raw, dict) else []
        if len(log.get("blobs", []) if isinstance(log, dict) else log) >= n:
            return version
    return None


def recover_reports(run_dir: Path, cache: FLCache, requests: list[dict[str, Any]], journal: Journal) -> None:
    """Write the report and the journal entry of every request the cache holds but the files miss.

    Also re-creates ``unlearn_report.json`` (the last request's) when a kill left only its
    temporary file or a failed write left the previous request's, and removes such leftovers of
    killed writers.
    """
    for name in ("unlearn_report.json", "model.safetensors", "metrics.json"):
        remove_stale_tmp(run_dir, name)
    committed = journal.committed()
    for i, report in enumerate(requests, start=1):
        rpath = run_dir / "unlearning" / f"{i:04d}" / "report.json"
        if rpath.is_file() and i in committed:
            continue  # nothing to recover (the common case: no version scan)
        version = report.get("cache_version") or _version_with_requests(cache, i)
        if not rpath.is_file():
            report = {**report, "cache_version": version}
            rpath.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(rpath, report)
            atomic_write_json(run_dir / "unlearn_report.json", report)
        if i not in committed:
            entry = {
                "event": "committed",
                "request": i,
                "clients": report["clients"],
                "cache_version": version,
            }
            journal.append({**entry, "recovered": True})
    last = run_dir / "unlearn_report.json"
    # Missing, or stale: a fault after the per-request report (disk full) left the previous request's.
    if requests and (read_json_object(last) or {}).get("request") != len(requests):
        rpath = run_dir / "unlearning" / f"{len(requests):04d}" / "report.json"
        atomic_write_bytes(last, rpath.read_bytes())


def resume_hint(run_dir: Path, cli: bool) -> str:
    """The exact command that resumes an interrupted fit (the run's config.yaml is read by the CLI)."""
    if cli:
        return f"resume with: python -m fedshard_lightning fit --ckpt_path {run_dir}"
    return f"resume with: FederatedTrainer(...same settings...).fit(model, datamodule, ckpt_path={str(run_dir)!r})"
