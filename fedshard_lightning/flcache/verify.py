"""Checks of :class:`~fedshard_lightning.flcache.cache.FLCache`: blob checksums, the manifest chain, tensor schemas.

Every manifest names its parent version and the parent manifest's SHA-256, so the manifests of
old versions are covered by the chain that ``CURRENT`` anchors: a byte flipped in any version on
the current history is found by ``cache verify --all`` (:meth:`Verification.verify_all`), not only
one in the current version. Versions off the chain (a commit killed before ``CURRENT`` named it,
or written before the chain existed) get their blobs checked only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.io import sha256_file

if TYPE_CHECKING:
    from fedshard_lightning.flcache.reader import CacheReader
    from fedshard_lightning.flcache.stacks import StackStore

__all__ = ["Verification"]


class Verification:
    """Checks of :class:`~fedshard_lightning.flcache.cache.FLCache`, over its reader and its stacks.

    Blobs the reader already hashed on reading (``reader.checked``) are not hashed again.
    """

    def __init__(self, reader: CacheReader, stacks: StackStore) -> None:
        self.reader = reader
        self.stacks = stacks

    def verify(self, version: str | None = None) -> None:
        """Check every blob of a version against its digest (only its indexes when gc pruned it).

        Blobs this instance already hashed on reading are not hashed again, so ``test`` loading a
        version and then verifying it reads every blob once; ``cache verify`` uses a fresh instance.
        """
        version = version or self.reader.current()
        manifest = self.reader.manifest(version)
        pruned = version in self.reader.pruned()
        for name in manifest.get("stacks", {}):
            digests = self.stacks.digests(name, version, manifest)
            if pruned:
                continue
            for d in set(digests):
                self._verify_blob(d, f"a row of stack {name} of version {version}")
        if not pruned:
            for fname, digest in manifest.get("files", {}).items():
                self._verify_blob(digest, f"{fname} of version {version}")

    def _verify_blob(self, digest: str, what: str) -> None:
        if digest in self.reader.checked:  # read and hashed by this process already (e.g. by the load)
            return
        path = self.reader.blob_path(digest)
        if not path.is_file() or sha256_file(path) != digest:
            raise CacheError(
                f"cache file {path} ({what}) is missing or corrupted (checksum mismatch); restore the run "
                "directory from a backup"
            )
        self.reader.checked.add(digest)

    def history(self) -> list[str]:
        """Versions on the chain from ``CURRENT`` back to the first commit, each manifest checked, newest first."""
        version: str | None = self.reader.current()  # CURRENT holds the current manifest's checksum
        chain: list[str] = []
        while version is not None:
            if version in chain:
                raise CacheError(
                    f"{self.reader.root}/{version}/manifest.json: its parent chain loops; the cache is damaged"
                )
            chain.append(version)
            raw = self.reader.read_json(self.reader.root / version / "manifest.json")
            parent, digest = raw.get("parent"), raw.get("parent_sha256")
            if parent is None:
                break
            if (
                not isinstance(parent, str)
                or not isinstance(digest, str)
                or parent not in self.reader.versions()
            ):
                raise CacheError(
                    f"{self.reader.root}/{version}/manifest.json names a missing parent version {parent!r}; "
                    "the cache is damaged"
                )
            if not (self.reader.root / parent / "manifest.json").is_file():
                raise CacheError(
                    f"{self.reader.root}/{parent}/manifest.json is missing (named as the parent of {version}); the cache "
                    "is damaged: restore the run directory from a backup"
                )
            if sha256_file(self.reader.root / parent / "manifest.json") != digest:
                raise CacheError(
                    f"{self.reader.root}/{parent}/manifest.json does not match its checksum in {version}'s manifest: "
                    "it was modified after it was committed; restore the run directory from a backup"
                )
            version = parent
        return chain

    def verify_all(self) -> dict[str, list[str]]:
        """Every version: the manifest chain from ``CURRENT`` and every blob; returns chained and other versions."""
        chain = self.history()
        for version in self.reader.versions():
            self.verify(version)
        return {"chain": chain, "other": [v for v in self.reader.versions() if v not in chain]}
