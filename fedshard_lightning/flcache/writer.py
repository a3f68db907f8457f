"""FLCache's writer: a new version committed atomically, its blobs content-addressed and durable.

:class:`Committer` is the collaborator of :class:`~fedshard_lightning.flcache.cache.FLCache` that
writes (over its reader and its stacks). A commit, under the cache's lock, writes each tensor file
and stack row as a blob unless an intact one exists, makes them durable with one ``syncfs``, writes
the manifest (files, stacks, schemas of every tensor, the hash chain to its parent) into a
temporary folder, renames it into place and replaces ``CURRENT`` last; on any failure it removes
what it created (its folder and the blobs it created).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import save
from torch import Tensor

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.io import (
    BLOBS,
    _fsync_dir,
    _plain_name,
    _sync_paths,
    atomic_write_json,
    remove_stale_tmp,
    sha256_file,
    writing,
)
from fedshard_lightning.flcache.manifest_key import pointer
from fedshard_lightning.flcache.reader import FORMAT, LOG_FIELDS
from fedshard_lightning.flcache.schema import schema_of
from fedshard_lightning.flcache.stacks import StackWrite

if TYPE_CHECKING:
    from fedshard_lightning.flcache.reader import CacheReader
    from fedshard_lightning.flcache.stacks import StackStore

__all__ = ["FORMAT", "Committer"]


class Committer:
    """Writes versions of :class:`~fedshard_lightning.flcache.cache.FLCache` (see the module docstring)."""

    def __init__(
        self, reader: CacheReader, stacks: StackStore, lock: Callable[[], AbstractContextManager[None]]
    ) -> None:
        self.reader = reader
        self.stacks = stacks
        self.lock = lock
        self._fresh: list[Path] = []  # blobs the running commit created

    def put(self, data: bytes, touched: list[Path], dirs: set[Path]) -> str:
        """Store ``data`` as a blob unless an intact one exists; return its digest.

        Both new and existing blobs go to ``touched``, to be made durable before the manifest that
        names them: an existing one may be the unsynced leftover of a writer that was killed.
        """
        digest = hashlib.sha256(data).hexdigest()
        path = self.reader.blob_path(digest)
        try:
            if path.stat().st_size == len(data):
                touched.append(path)
                return digest  # content-addressed: same name, same bytes (size checked against a torn file)
        except FileNotFoundError:
            pass
        if path.parent not in dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            dirs.add(path.parent)
        self._fresh.append(path)  # removed again if the commit fails (no manifest names it)
        tmp = path.with_name(f".{digest}.tmp-{os.getpid()}")
        with writing(tmp, path):
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        touched.append(path)
        return digest

    def commit(
        self,
        name: str,
        manifest: dict[str, Any],
        tensors: dict[str, dict[str, Tensor]],
        reuse: dict[str, str] | None = None,
        stacks: dict[str, StackWrite] | None = None,
    ) -> str:
        """Write a new version atomically and make it current.

        Args:
            name: Folder name of the new version (must be new).
            manifest: Structure to store; ``format``, ``files`` and ``stacks`` are filled in.
            tensors: Tensor files, name -> tensors (stored as blobs; identical bytes are stored once).
            reuse: Files taken unchanged from the current version, name -> name there (no copy).
            stacks: Stacks of models, name -> :class:`StackWrite` (one blob per row).

        Returns:
            The committed version's name.
        """
        if not _plain_name(name) or name == BLOBS:
            raise CacheError(f"cache version name {name!r} must be a plain folder name")
        with self.lock():
            remove_stale_tmp(self.reader.root)
            final = self.reader.root / name
            if final.exists():
                raise CacheError(f"cache version {final} exists already; refusing to overwrite it")
            tmp = self.reader.root / f".{name}.tmp-{os.getpid()}"
            if tmp.exists():
                shutil.rmtree(tmp)
            self._fresh = []
            try:
                tmp.mkdir()
                self._commit_locked(name, manifest, tensors, reuse, stacks, tmp, final)
            except BaseException:
                self._roll_back(name, tmp, final)
                raise
        return name

    def _roll_back(self, name: str, tmp: Path, final: Path) -> None:
        """Undo a commit that failed (disk full, read-only, killed by an error) before CURRENT named it."""
        with contextlib.suppress(CacheError, OSError):
            if (
                self.reader.exists()
                and self.reader.read_json(self.reader.root / "CURRENT").get("version") == name
            ):
                return  # committed after all: keep it
        for path in (tmp, final):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
        for blob in self._fresh:
            with contextlib.suppress(OSError):
                blob.unlink()
        for folder in {blob.parent for blob in self._fresh}:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: a folder this commit created
        self._fresh = []

    def _commit_locked(
        self,
        name: str,
        manifest: dict[str, Any],
        tensors: dict[str, dict[str, Tensor]],
        reuse: dict[str, str] | None,
        stacks: dict[str, StackWrite] | None,
        tmp: Path,
        final: Path,
    ) -> None:
        """:meth:`commit`'s body, under the lock, into the temporary folder ``tmp``."""
        parent = self.reader.current() if self.reader.exists() else None
        base_version = parent if (reuse or stacks) else None
        base = self.reader.manifest(base_version) if base_version is not None else None
        schemas: dict[str, dict[str, Any]] = {"files": {}, "stacks": {}}
        old_schemas = (base or {}).get("schemas", {}).get("files", {})
        touched: list[Path] = []
        dirs: set[Path] = set()
        files: dict[str, str] = {}
        for new_name, old_name in (reuse or {}).items():
            if base is None or old_name not in base["files"]:
                raise CacheError(f"cannot reuse {old_name!r}: the current version has no such file")
            files[new_name] = base["files"][old_name]
            if isinstance(old_schemas, dict) and old_name in old_schemas:
                schemas["files"][new_name] = old_schemas[old_name]
            if not self.reader.blob_path(files[new_name]).is_file():
                raise CacheError(f"cannot reuse {old_name!r}: its blob is gone (pruned by cache gc?)")
        for fname, tens in tensors.items():
            schemas["files"][fname] = schema_of(tens)
            files[fname] = self.put(
                save({k: v.detach().contiguous().cpu() for k, v in tens.items()}), touched, dirs
            )
        stack_entries = {
            sname: self.stacks.write(
                sname, st, base, base_version, lambda data: self.put(data, touched, dirs)
            )
            for sname, st in (stacks or {}).items()
        }
        logs = {
            field: {
                "blobs": [
                    self.put(json.dumps(entry, sort_keys=True).encode(), touched, dirs)
                    for entry in manifest[field]
                ]
            }
            for field in LOG_FIELDS
            if isinstance(manifest.get(field), list)
        }
        schemas["stacks"] = {n: schema_of(st.tensors, rows=True) for n, st in (stacks or {}).items()}
        chain = {}
        if parent is not None:  # the hash chain that lets `cache verify --all` check old manifests
            chain = {
                "parent": parent,
                "parent_sha256": sha256_file(self.reader.root / parent / "manifest.json"),
            }
        body = {
            **manifest,
            **logs,
            **chain,
            "format": FORMAT,
            "files": files,
            "stacks": stack_entries,
            "schemas": schemas,
        }
        _sync_paths(touched, dirs | {self.reader.root / BLOBS} if touched else dirs)
        # One line: json's pure-Python encoder (used whenever indent is set) is 10x slower.
        atomic_write_json(tmp / "manifest.json", body, indent=None)
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(self.reader.root)
        atomic_write_json(self.reader.root / "CURRENT", pointer(name, sha256_file(final / "manifest.json")))
