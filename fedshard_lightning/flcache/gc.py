"""``FLCache.gc`` and ``FLCache.drop``: what of the cache a run keeps.

``gc`` drops the models of old versions and keeps every manifest, stack index and request log;
``drop`` keeps nothing but a note (a fit with ``trainer.enable_checkpointing: false`` keeps only
its final model, outside the cache).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedshard_lightning.errors import CacheError

if TYPE_CHECKING:
    from fedshard_lightning.flcache.reader import CacheReader
    from fedshard_lightning.flcache.stacks import StackStore
from fedshard_lightning.flcache.io import BLOBS, _fsync_dir, atomic_write_json, remove_stale_tmp

__all__ = ["FINAL_ONLY", "Retention", "final_only_error"]

FINAL_ONLY = "FINAL_ONLY"
"""The note a dropped cache leaves (``Retention.drop``): why it holds nothing, for the commands that need it."""


def final_only_error(run: Path, command: str) -> CacheError:
    """The one line of a command refused on a run that kept only its final model, and why it needs more."""
    why = {
        "fit": "it is complete already; its model is model.safetensors",
        "unlearn": "exact unlearning retrains from the FLCache's stage models",
        "audit": "the audit replays the FLCache's stages",
        "cache": "its FLCache holds nothing to collect or verify",
    }.get(command, "this command reads the FLCache")
    return CacheError(
        f"{run} kept only its final model (fit with trainer.enable_checkpointing false), so {command} "
        f"cannot run: {why}; fit again with enable_checkpointing true (the default) to unlearn, or "
        "use test / load_model on the final model"
    )


class Retention:
    """Retention of :class:`~fedshard_lightning.flcache.cache.FLCache`, over its reader and its stacks."""

    def __init__(
        self, reader: CacheReader, stacks: StackStore, lock: Callable[[], AbstractContextManager[None]]
    ) -> None:
        self.reader = reader
        self.stacks = stacks
        self.lock = lock

    def gc(self, keep: int) -> dict[str, Any]:
        """Drop the blobs that no kept version uses; keep every manifest and every stack index.

        The kept versions are the ``keep`` newest and the current one. Versions not kept are listed
        in ``PRUNED`` (written atomically *before* any blob is removed, so a crash in the middle
        leaves a consistent cache: kept versions intact, pruned ones marked, some garbage left for
        the next ``gc``). Their manifests and stack indexes stay: the history of requests and the
        digest of every model each version had remain provable. Unreferenced blobs that a killed
        writer left are removed too.

        Args:
            keep: Number of newest versions whose models stay loadable (>= 1).

        Returns:
            What was kept, pruned and removed (counts and bytes).
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise CacheError(f"keep={keep!r}: keep at least the newest version (an integer >= 1)")
        if not self.reader.exists():
            raise CacheError(f"{self.reader.root} has no committed FLCache (no CURRENT); nothing to collect")
        with self.lock():
            versions = self.reader.versions()
            current = self.reader.current()
            kept = set(versions[-keep:]) | {current}
            already = self.reader.pruned()
            if already & kept:
                raise CacheError(
                    f"versions {sorted(already & kept)} were pruned by an earlier gc; they cannot be kept again"
                )
            live: set[str] = set()
            for version in versions:
                manifest = self.reader.manifest(version)
                live.update(
                    self.reader.log_digests(self.reader.root / version / "manifest.json")
                )  # history stays
                for sname, entry in manifest["stacks"].items():
                    live.add(entry["snapshot"])
                    if version in kept:
                        live.update(self.stacks.digests(sname, version, manifest))
                if version in kept:
                    live.update(manifest["files"].values())
            missing = sorted(d for d in live if not self.reader.blob_path(d).is_file())
            if missing:
                raise CacheError(
                    f"kept versions use {len(missing)} missing blobs (e.g. {self.reader.blob_path(missing[0])}); "
                    "the cache is damaged, nothing was removed"
                )
            pruned = sorted(already | (set(versions) - kept))
            atomic_write_json(self.reader.root / "PRUNED", {"versions": pruned})
            removed = removed_bytes = kept_bytes = 0
            blobs = self.reader.root / BLOBS
            for sub in sorted(blobs.iterdir()) if blobs.is_dir() else []:
                if not sub.is_dir():
                    continue
                remove_stale_tmp(sub)
                for entry in os.scandir(sub):
                    if entry.name in live:
                        kept_bytes += entry.stat().st_size
                        continue
                    if entry.name.startswith("."):
                        continue  # a live writer's temporary file (stale ones went above)
                    removed_bytes += entry.stat().st_size
                    os.unlink(entry.path)
                    removed += 1
                _fsync_dir(sub)
            return {
                "kept": sorted(kept),
                "pruned": pruned,
                "removed_blobs": removed,
                "removed_bytes": removed_bytes,
                "kept_blobs": len(live),
                "kept_bytes": kept_bytes,
            }

    def drop(self, note: dict[str, Any]) -> int:
        """Remove every version and blob, leaving ``note`` in ``FINAL_ONLY``; return the bytes removed.

        The note is written atomically first, then ``CURRENT`` goes, then the versions and blobs: a
        crash at any point leaves a cache that every command reads as dropped (the note names why),
        never one that looks intact but misses blobs. ``FINGERPRINT`` stays (a resume is refused by
        the note, not retrained over).
        """
        with self.lock():
            atomic_write_json(self.reader.root / FINAL_ONLY, note)
            removed = 0
            for name in ("CURRENT", "PRUNED"):
                path = self.reader.root / name
                if path.is_file():
                    removed += path.stat().st_size
                    path.unlink()
            _fsync_dir(self.reader.root)
            for entry in sorted(self.reader.root.iterdir()):
                if entry.is_dir() and not entry.is_symlink():
                    removed += sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
                    shutil.rmtree(entry)
            _fsync_dir(self.reader.root)
            return removed
