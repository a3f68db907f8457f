"""FLCache: the on-disk state that training leaves for unlearning (SPEC section 6).

Layout of ``RUN_DIR/cache`` (format 2, content-addressed)::

    CURRENT                   {"version": "0014-unlearn-0002", "manifest_sha256": "..."}
    PRUNED                    versions whose models ``cache gc`` dropped (their manifests stay)
    FINAL_ONLY                only in a cache that ``drop`` emptied: why (enable_checkpointing false)
    blobs/ab/ab12...ef        one safetensors file per blob, named by the SHA-256 of its bytes
    0001-stage-1/manifest.json   one folder per committed version, holding only its manifest
    0002-stage-2/manifest.json ...

Every tensor file is a blob shared by every version that holds the same bytes: a version's
manifest maps file names to blob digests (``files``), and a *stack* (one model per row, e.g. the
shard models of a stage) to one blob per row (``stacks``). A stack's row digests are a snapshot
blob (``[N, 32]`` digests, shared across versions) plus the rows that differ from it (``delta``);
a new snapshot is written once the delta outgrows ``sqrt(N)`` rows, so a manifest stays small and
a version that retrained ``m`` shards adds ``m`` model blobs plus a few hundred bytes.

Writes are atomic and crash-safe: new blobs go to ``.NAME.tmp-PID`` and are renamed into place,
then made durable with one ``syncfs`` (a per-file ``fsync`` costs 3 ms here: 200 s for 65,536
shards); the version folder is written under a temporary name and renamed; ``CURRENT`` is
replaced last. A crash at any moment leaves the previous version current and intact, plus at most
some unreferenced blobs that ``gc`` removes. Loading checks every blob's SHA-256 (its name), so a
flipped byte or a swapped file is refused, and nothing is ever unpickled. Version and file names
read from ``CURRENT`` and manifests must be plain names inside the cache folder; blob paths are
built from validated hex digests only. Writers (``commit``, ``set_current``, ``gc``) hold an
exclusive ``flock`` on the cache folder. Temporary files that a killed writer left behind (of a
process that no longer exists) are removed by the next write.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load
from torch import Tensor

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.gc import Retention
from fedshard_lightning.flcache.io import (
    _flock,
    atomic_write_json,
    sha256_file,
)
from fedshard_lightning.flcache.manifest_key import pointer
from fedshard_lightning.flcache.reader import CacheReader
from fedshard_lightning.flcache.schema import check_loaded
from fedshard_lightning.flcache.stacks import StackStore, StackWrite
from fedshard_lightning.flcache.verify import Verification
from fedshard_lightning.flcache.writer import Committer

__all__ = ["FLCache", "StackWrite"]


class FLCache:
    """Versioned, atomic, content-addressed store of manifests, tensor files and stacks of models.

    One object over five collaborators that share its folder: :attr:`reader` (versions, manifests,
    blobs, the request log; no torch), :attr:`stacks` (stacks of models), :attr:`writer` (commits),
    :attr:`verification` (checksums and the manifest chain) and :attr:`retention` (``gc``). The
    methods below are the cache's whole interface; each says which collaborator answers.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.reader = CacheReader(self.root)
        self.stacks = StackStore(self.reader)
        self.writer = Committer(self.reader, self.stacks, self.lock)
        self.verification = Verification(self.reader, self.stacks)
        self.retention = Retention(self.reader, self.stacks, self.lock)
        self.row_schema: dict[str, Any] | None = None  # the model every stack row must match, when known

    # Reading (the reader).
    def exists(self) -> bool:
        """True when a committed version exists."""
        return self.reader.exists()

    def current(self) -> str:
        """Name of the current version."""
        return self.reader.current()

    def versions(self) -> list[str]:
        """Committed version folders, oldest first."""
        return self.reader.versions()

    def manifest(self, version: str | None = None) -> dict[str, Any]:
        """The manifest of a version (default: current)."""
        return self.reader.manifest(version)

    def pruned(self) -> set[str]:
        """Versions whose models ``gc`` dropped (their manifests and stack indexes stay readable)."""
        return self.reader.pruned()

    def blob_path(self, digest: str) -> Path:
        """Where the blob with this SHA-256 lives."""
        return self.reader.blob_path(digest)

    @property
    def checked(self) -> set[str]:
        """Blobs whose bytes this instance has hashed and found intact (``verify`` skips them)."""
        return self.reader.checked

    # Stacks.
    def stack_digests(
        self, name: str, version: str | None = None, manifest: dict[str, Any] | None = None
    ) -> list[str]:
        """Blob digest of every row of stack ``name`` in a version (snapshot plus delta)."""
        return self.stacks.digests(name, version, manifest)

    def stack(
        self,
        name: str,
        version: str | None = None,
        device: str | torch.device = "cpu",
        manifest: dict[str, Any] | None = None,
    ) -> dict[str, Tensor]:
        """Stacked tensors ``[N, ...]`` of stack ``name`` in a version, every row blob verified."""
        return self.stacks.load(name, version, device, manifest, self.row_schema)

    # Writing (the writer), checks (verification) and retention.
    def commit(
        self,
        name: str,
        manifest: dict[str, Any],
        tensors: dict[str, dict[str, Tensor]],
        reuse: dict[str, str] | None = None,
        stacks: dict[str, StackWrite] | None = None,
    ) -> str:
        """Write a new version atomically and make it current (:meth:`Committer.commit`)."""
        return self.writer.commit(name, manifest, tensors, reuse, stacks)

    def verify(self, version: str | None = None) -> None:
        """Check every blob of a version against its digest (:meth:`Verification.verify`)."""
        self.verification.verify(version)

    def history(self) -> list[str]:
        """Versions on the chain from ``CURRENT`` back to the first commit, newest first."""
        return self.verification.history()

    def verify_all(self) -> dict[str, list[str]]:
        """Every version: the manifest chain from ``CURRENT`` and every blob (:meth:`Verification.verify_all`)."""
        return self.verification.verify_all()

    def gc(self, keep: int) -> dict[str, Any]:
        """Drop the blobs that no kept version uses (:meth:`Retention.gc`)."""
        return self.retention.gc(keep)

    def drop(self, note: dict[str, Any]) -> int:
        """Remove every version and blob, leaving ``note`` (:meth:`Retention.drop`); the bytes removed."""
        return self.retention.drop(note)

    def final_only(self) -> dict[str, Any] | None:
        """The note of a dropped cache, else ``None`` (:meth:`CacheReader.final_only`)."""
        return self.reader.final_only()

    # Files of a version.

    def path_of(self, name: str, version: str | None = None, manifest: dict[str, Any] | None = None) -> Path:
        """The blob that holds file ``name`` of a version (default: current)."""
        version = version or self.current()
        files = (manifest if manifest is not None else self.manifest(version)).get("files", {})
        if name not in files:
            raise CacheError(f"the cache version {version} has no file {name!r}")
        return self.blob_path(files[name])

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
                saves parsing it again for every file.

        ``NAME.safetensors`` where the version has a stack ``NAME`` returns the stacked rows (the
        file that format 1 stored), so readers of whole stage files keep working.
        """
        version = version or self.current()
        manifest = manifest if manifest is not None else self.manifest(version)
        files = manifest.get("files", {})
        stem = name.removesuffix(".safetensors")
        if name not in files and stem != name and stem in manifest.get("stacks", {}):
            return self.stack(stem, version, device, manifest)  # a stack reads as the file it was in format 1
        if name not in files:
            raise CacheError(f"the cache version {version} has no file {name!r}")
        what = f"{name} of cache version {version}"
        data = self.reader.read_blob(files[name], what, version)
        try:
            out = load(data)
        except (SafetensorError, ValueError) as e:
            raise CacheError(
                f"{self.blob_path(files[name])} ({what}) is not a valid safetensors file ({e}); refusing to load it"
            ) from None
        check_loaded(out, manifest, "files", name, f"{self.blob_path(files[name])} ({what})")
        # Sorted like load_file's: safetensors.torch.load (from bytes) returns a hash map's order,
        # which differs between processes (DDP ranks would then gather parameters in different orders).
        return {k: out[k].to(device) for k in sorted(out)}

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Exclusive lock of the cache for writers (blocking; not re-entrant)."""
        self.root.mkdir(parents=True, exist_ok=True)
        return _flock(self.root)

    def set_current(self, version: str) -> None:
        """Point CURRENT at an existing committed version (used to restore after a replay)."""
        if version in self.pruned():
            raise CacheError(f"version {version} was pruned by `cache gc`; it cannot become current again")
        self.manifest(version)
        with self.lock():
            atomic_write_json(
                self.root / "CURRENT", pointer(version, sha256_file(self.root / version / "manifest.json"))
            )

    def next_name(self, label: str) -> str:
        """A fresh, ordered version name like ``0004-label``."""
        existing = [int(v.split("-", 1)[0]) for v in self.versions() if v.split("-", 1)[0].isdigit()]
        return f"{max(existing, default=0) + 1:04d}-{label}"
