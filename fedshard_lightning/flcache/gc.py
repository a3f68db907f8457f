"""``FLCache.gc``: drop the models of old versions, keep every manifest, stack index and request log."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.io import BLOBS, _fsync_dir, atomic_write_json, remove_stale_tmp

__all__ = ["LOG_FIELDS", "Retention"]

# Append-only manifest fields (the trainer's request log): every entry is a JSON blob and a
# manifest lists their digests, so a version adds its new entries only. Inline, the log made a
# manifest O(requests) and the cache O(requests^2) (150 KB per manifest after 100 requests).
LOG_FIELDS = ("requests",)


class Retention:
    """Retention of :class:`~fedshard_lightning.flcache.cache.FLCache` (a mixin over its versions and blobs)."""

    def pruned(self) -> set[str]:
        """Versions whose models ``gc`` dropped (their manifests and stack indexes stay readable)."""
        path = self.root / "PRUNED"
        if not path.is_file():
            return set()
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            raise CacheError(f"{path} is not valid JSON; the cache is damaged") from None
        if not isinstance(data, dict) or not isinstance(data.get("versions"), list):
            raise CacheError(f"{path} does not list versions; the cache is damaged")
        return {str(v) for v in data["versions"]}

    def log_digests(self, manifest_path: Path) -> list[str]:
        """Blob digests of the log entries (e.g. the request reports) that a stored manifest names."""
        raw = self._read_json(manifest_path)
        out = []
        for field in LOG_FIELDS:
            ref = raw.get(field)
            if isinstance(ref, dict) and isinstance(ref.get("blobs"), list):
                out.extend(ref["blobs"])
        return out

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
        if not self.exists():
            raise CacheError(f"{self.root} has no committed FLCache (no CURRENT); nothing to collect")
        with self.lock():
            versions = self.versions()
            current = self.current()
            kept = set(versions[-keep:]) | {current}
            already = self.pruned()
            if already & kept:
                raise CacheError(
                    f"versions {sorted(already & kept)} were pruned by an earlier gc; they cannot be kept again"
                )
            live: set[str] = set()
            for version in versions:
                manifest = self.manifest(version)
                live.update(self.log_digests(self.root / version / "manifest.json"))  # history stays
                for sname, entry in manifest["stacks"].items():
                    live.add(entry["snapshot"])
                    if version in kept:
                        live.update(self.stack_digests(sname, version, manifest))
                if version in kept:
                    live.update(manifest["files"].values())
            missing = sorted(d for d in live if not self.blob_path(d).is_file())
            if missing:
                raise CacheError(
                    f"kept versions use {len(missing)} missing blobs (e.g. {self.blob_path(missing[0])}); "
                    "the cache is damaged, nothing was removed"
                )
            pruned = sorted(already | (set(versions) - kept))
            atomic_write_json(self.root / "PRUNED", {"versions": pruned})
            removed = removed_bytes = kept_bytes = 0
            blobs = self.root / BLOBS
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
