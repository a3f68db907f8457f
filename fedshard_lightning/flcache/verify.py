"""Checks of :class:`~fedshard_lightning.flcache.cache.FLCache`: blob checksums, the manifest chain, tensor schemas.

Every manifest names its parent version and the parent manifest's SHA-256, so the manifests of
old versions are covered by the chain that ``CURRENT`` anchors: a byte flipped in any version on
the current history is found by ``cache verify --all`` (:meth:`Verification.verify_all`), not only
one in the current version. Versions off the chain (a commit killed before ``CURRENT`` named it,
or written before the chain existed) get their blobs checked only. A commit that fails (disk
full, read-only) is rolled back here too: its folder and the blobs it created are removed.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

from torch import Tensor

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.io import sha256_file
from fedshard_lightning.flcache.schema import check_schema

__all__ = ["Verification"]


class Verification:
    """Checks of :class:`~fedshard_lightning.flcache.cache.FLCache` (a mixin over its versions, manifests and blobs)."""

    checked: set[str]  # digests this instance has hashed and found intact (FLCache keeps it)

    def check_loaded(
        self, tensors: dict[str, Tensor], manifest: dict[str, Any], kind: str, name: str, what: str
    ) -> None:
        """Refuse loaded tensors whose names, shapes or dtypes differ from the manifest's record.

        Args:
            tensors: What was loaded (a file's tensors, or a stack's ``[N, ...]`` tensors).
            manifest: The version's manifest.
            kind: ``files`` or ``stacks``.
            name: The file or stack name.
            what: The file, for the message.
        """
        schemas = manifest.get("schemas")
        if schemas is None:
            return  # written before schemas were recorded: checked against the model only
        if not isinstance(schemas, dict) or not isinstance(schemas.get(kind), dict):
            raise CacheError(f"{what}: the manifest's tensor schemas are malformed; the cache is damaged")
        expected = schemas[kind].get(name)
        if expected is None:
            raise CacheError(f"{what}: the manifest records no tensor schema for it; the cache is damaged")
        fix = "the cache was modified after it was written; restore the run directory from a backup or fit again"
        check_schema(tensors, expected, what, fix, rows=kind == "stacks")

    def _roll_back(self, name: str, tmp: Path, final: Path) -> None:
        """Undo a commit that failed (disk full, read-only, killed by an error) before CURRENT named it."""
        with contextlib.suppress(CacheError, OSError):
            if self.exists() and self._read_json(self.root / "CURRENT").get("version") == name:
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

    def verify(self, version: str | None = None) -> None:
        """Check every blob of a version against its digest (only its indexes when gc pruned it).

        Blobs this instance already hashed on reading are not hashed again, so ``test`` loading a
        version and then verifying it reads every blob once; ``cache verify`` uses a fresh instance.
        """
        version = version or self.current()
        manifest = self.manifest(version)
        pruned = version in self.pruned()
        for name in manifest.get("stacks", {}):
            digests = self.stack_digests(name, version, manifest)
            if pruned:
                continue
            for d in set(digests):
                self._verify_blob(d, f"a row of stack {name} of version {version}")
        if not pruned:
            for fname, digest in manifest.get("files", {}).items():
                self._verify_blob(digest, f"{fname} of version {version}")

    def _verify_blob(self, digest: str, what: str) -> None:
        if digest in self.checked:  # read and hashed by this process already (e.g. by the load)
            return
        path = self.blob_path(digest)
        if not path.is_file() or sha256_file(path) != digest:
            raise CacheError(
                f"cache file {path} ({what}) is missing or corrupted (checksum mismatch); restore the run "
                "directory from a backup"
            )
        self.checked.add(digest)

    def history(self) -> list[str]:
        """Versions on the chain from ``CURRENT`` back to the first commit, each manifest checked, newest first."""
        version: str | None = self.current()  # CURRENT holds the current manifest's checksum
        chain: list[str] = []
        while version is not None:
            if version in chain:
                raise CacheError(
                    f"{self.root}/{version}/manifest.json: its parent chain loops; the cache is damaged"
                )
            chain.append(version)
            raw = self._read_json(self.root / version / "manifest.json")
            parent, digest = raw.get("parent"), raw.get("parent_sha256")
            if parent is None:
                break
            if not isinstance(parent, str) or not isinstance(digest, str) or parent not in self.versions():
                raise CacheError(
                    f"{self.root}/{version}/manifest.json names a missing parent version {parent!r}; "
                    "the cache is damaged"
                )
            if not (self.root / parent / "manifest.json").is_file():
                raise CacheError(
                    f"{self.root}/{parent}/manifest.json is missing (named as the parent of {version}); the cache "
                    "is damaged: restore the run directory from a backup"
                )
            if sha256_file(self.root / parent / "manifest.json") != digest:
                raise CacheError(
                    f"{self.root}/{parent}/manifest.json does not match its checksum in {version}'s manifest: "
                    "it was modified after it was committed; restore the run directory from a backup"
                )
            version = parent
        return chain

    def verify_all(self) -> dict[str, list[str]]:
        """Every version: the manifest chain from ``CURRENT`` and every blob; returns chained and other versions."""
        chain = self.history()
        for version in self.versions():
            self.verify(version)
        return {"chain": chain, "other": [v for v in self.versions() if v not in chain]}
