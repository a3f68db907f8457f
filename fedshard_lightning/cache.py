"""FLCache: the on-disk state that training leaves for unlearning (SPEC section 6).

Layout of ``RUN_DIR/cache``::

    CURRENT                 {"version": "0003-unlearn-0001", "manifest_sha256": "..."}
    0001-stage-1/           one immutable folder per committed version
        manifest.json       structure (tree, alphas, rounds, ...), fingerprint, file checksums
        stage_1.safetensors tensors (never pickled)
    0002-stage-2/ ...

A version folder is written under a temporary name, every file fsync'ed, then renamed into place;
``CURRENT`` is replaced atomically last, so a crash at any moment leaves the previous version
current and intact. Files that a new version shares with its base are hard links (no copies).
Loading checks every file's SHA-256 against the manifest, so a flipped byte or a swapped file is
refused, and nothing is ever unpickled. Version and file names read from ``CURRENT`` and manifests
must be plain names inside the cache folder. Temporary files and folders that a killed writer left
behind (``.NAME.tmp-PID`` of a process that no longer exists) are removed by the next write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from fedshard_lightning.errors import CacheError

__all__ = [
    "FLCache",
    "atomic_save_tensors",
    "atomic_write_bytes",
    "atomic_write_json",
    "load_tensors",
    "remove_stale_tmp",
    "sha256_file",
]

FORMAT = "fedshard-flcache/1"

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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, fsync, rename over ``path``."""
    path = Path(path)
    remove_stale_tmp(path.parent, path.name)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any, indent: int | None = 2) -> None:
    """JSON version of :func:`atomic_write_bytes`; ``indent=None`` writes one line (C encoder, compact)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=indent, sort_keys=True) + "\n").encode())


def atomic_save_tensors(
    path: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None
) -> str:
    """Save with safetensors atomically; returns the file's SHA-256."""
    path = Path(path)
    remove_stale_tmp(path.parent, path.name)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    digest = sha256_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return digest


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


class FLCache:
    """Versioned, atomic, checksummed store of manifests and tensor files."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    # -- reading ---------------------------------------------------------------------------------
    def exists(self) -> bool:
        """True when a committed version exists."""
        return (self.root / "CURRENT").is_file()

    def current(self) -> str:
        """Name of the current version."""
        ptr = self._read_json(self.root / "CURRENT")
        version = ptr.get("version")
        if isinstance(version, str) and not _plain_name(version):
            raise CacheError(
                f"{self.root}/CURRENT names {version!r}, which is not a version folder of this cache; "
                "the cache is damaged"
            )
        if not isinstance(version, str) or not (self.root / version / "manifest.json").is_file():
            raise CacheError(
                f"{self.root}/CURRENT points to a missing version {version!r}; the cache is damaged"
            )
        if sha256_file(self.root / version / "manifest.json") != ptr.get("manifest_sha256"):
            raise CacheError(f"{self.root}/{version}/manifest.json does not match its checksum in CURRENT")
        return version

    def versions(self) -> list[str]:
        """Committed version folders, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def manifest(self, version: str | None = None) -> dict[str, Any]:
        """The manifest of a version (default: current)."""
        version = version or self.current()
        if not _plain_name(version):
            raise CacheError(f"{version!r} is not a version folder of {self.root}")
        data = self._read_json(self.root / version / "manifest.json")
        if data.get("format") != FORMAT:
            raise CacheError(
                f"{self.root / version}/manifest.json is not an FLCache manifest (format {FORMAT})"
            )
        files = data.get("files")
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and _plain_name(k) and isinstance(v, str) and _SHA256.match(v)
            for k, v in files.items()
        ):
            raise CacheError(
                f"{self.root / version}/manifest.json has a malformed file list (plain file names with "
                "SHA-256 checksums expected); the cache is damaged"
            )
        return data

    def tensors(
        self,
        name: str,
        version: str | None = None,
        device: str | torch.device = "cpu",
        manifest: dict[str, Any] | None = None,
    ) -> dict[str, Tensor]:
        """Tensors of file ``name`` in a version, verified against the manifest.

        Args:
            name: File name inside the version.
            version: Version folder (default: current).
            device: Device of the returned tensors.
            manifest: That version's manifest when the caller holds it already (``manifest(version)``);
                saves parsing it again for every file (a manifest holds O(K * P) client ids).
        """
        version = version or self.current()
        files = (manifest if manifest is not None else self.manifest(version)).get("files", {})
        if name not in files:
            raise CacheError(f"the cache version {version} has no file {name!r}")
        return load_tensors(self.root / version / name, files[name], device)

    def verify(self, version: str | None = None) -> None:
        """Check every file of a version against its checksum."""
        version = version or self.current()
        for name, digest in self.manifest(version).get("files", {}).items():
            path = self.root / version / name
            if not path.is_file() or sha256_file(path) != digest:
                raise CacheError(f"cache file {path} is missing or corrupted (checksum mismatch)")

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any]:
        if not path.is_file():
            raise CacheError(f"missing {path}; this is not a complete fedshard_lightning run directory")
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise CacheError(
                f"{path} is not valid JSON (truncated or replaced); the cache is damaged"
            ) from None
        except OSError as e:
            raise CacheError(f"cannot read {path} ({e.strerror or e})") from None
        if not isinstance(data, dict):
            raise CacheError(f"{path} does not hold a JSON object")
        return data

    # -- writing ---------------------------------------------------------------------------------
    def commit(
        self,
        name: str,
        manifest: dict[str, Any],
        tensors: dict[str, dict[str, Tensor]],
        reuse: dict[str, str] | None = None,
    ) -> str:
        """Write a new version atomically and make it current.

        Args:
            name: Folder name of the new version (must be new).
            manifest: Structure to store; ``format`` and ``files`` are filled in.
            tensors: New tensor files, name -> tensors.
            reuse: Files taken unchanged from the current version, name -> name there (hard links).

        Returns:
            The committed version's name.
        """
        if not _plain_name(name):
            raise CacheError(f"cache version name {name!r} must be a plain folder name")
        self.root.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(self.root)
        final = self.root / name
        if final.exists():
            raise CacheError(f"cache version {final} exists already; refusing to overwrite it")
        tmp = self.root / f".{name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        files: dict[str, str] = {}
        if reuse:
            base = self.current()
            base_files = self.manifest(base)["files"]
            for new_name, old_name in reuse.items():
                src = self.root / base / old_name
                try:
                    os.link(src, tmp / new_name)
                except OSError:
                    shutil.copy2(src, tmp / new_name)
                files[new_name] = base_files[old_name]
        for fname, tens in tensors.items():
            files[fname] = atomic_save_tensors(tmp / fname, tens)
        body = {**manifest, "format": FORMAT, "files": files}
        # One line: a manifest holds O(K * P) client ids; indenting them made it 2.5x larger and
        # json's pure-Python encoder (used whenever indent is set) 10x slower at K = 4096.
        atomic_write_json(tmp / "manifest.json", body, indent=None)
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        atomic_write_json(
            self.root / "CURRENT", {"version": name, "manifest_sha256": sha256_file(final / "manifest.json")}
        )
        return name

    def set_current(self, version: str) -> None:
        """Point CURRENT at an existing committed version (used to restore after a replay)."""
        self.manifest(version)
        atomic_write_json(
            self.root / "CURRENT",
            {"version": version, "manifest_sha256": sha256_file(self.root / version / "manifest.json")},
        )

    def next_name(self, label: str) -> str:
        """A fresh, ordered version name like ``0004-label``."""
        existing = [int(v.split("-", 1)[0]) for v in self.versions() if v.split("-", 1)[0].isdigit()]
        return f"{max(existing, default=0) + 1:04d}-{label}"
