"""FLCache's reader of versions and manifests, without torch.

:class:`CacheReader` is the collaborator of :class:`~fedshard_lightning.flcache.cache.FLCache` that
finds the current version, reads and checks manifests, blobs and the request log (JSON blobs, each
checked against its SHA-256), and knows which versions ``gc`` pruned. It imports no tensor library,
so ``python -m fedshard_lightning runs`` lists many runs without the seconds that torch takes to
import.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.io import _SHA256, BLOBS, _plain_name, sha256_file
from fedshard_lightning.flcache.manifest_key import check_pointer

__all__ = ["FORMAT", "LOG_FIELDS", "CacheReader"]

FORMAT = "fedshard-flcache/2"
# Append-only manifest fields (the trainer's request log): every entry is a JSON blob and a
# manifest lists their digests, so a version adds its new entries only. Inline, the log made a
# manifest O(requests) and the cache O(requests^2) (150 KB per manifest after 100 requests).
LOG_FIELDS = ("requests",)


class CacheReader:
    """Versions, manifests and the request log of an FLCache folder (see the module docstring)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        # Blobs whose bytes this process has hashed and found intact: `verify` after a load skips them.
        self.checked: set[str] = set()

    def exists(self) -> bool:
        """True when a committed version exists."""
        return (self.root / "CURRENT").is_file()

    def final_only(self) -> dict[str, Any] | None:
        """The note of a cache that ``drop`` emptied (the run kept only its final model), else ``None``."""
        path = self.root / "FINAL_ONLY"
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return {}
        return data if isinstance(data, dict) else {}

    def current(self) -> str:
        """Name of the current version."""
        ptr = self.read_json(self.root / "CURRENT")
        version = ptr.get("version")
        if isinstance(version, str) and (not _plain_name(version) or version == BLOBS):
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
        check_pointer(ptr, self.root / "CURRENT")
        return version

    def versions(self) -> list[str]:
        """Committed version folders, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.is_dir() and not p.name.startswith(".") and p.name != BLOBS
        )

    def manifest(self, version: str | None = None) -> dict[str, Any]:
        """The manifest of a version (default: current)."""
        version = version or self.current()
        if not _plain_name(version) or version == BLOBS:
            raise CacheError(f"{version!r} is not a version folder of {self.root}")
        data = self.read_json(self.root / version / "manifest.json")
        if data.get("format") != FORMAT:
            if data.get("format") == "fedshard-flcache/1":
                raise CacheError(
                    f"{self.root / version}/manifest.json is an FLCache of format 1 (one file per stage), "
                    f"written by an older fedshard_lightning; this version reads {FORMAT}: fit the run again"
                )
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
        stacks = data.setdefault("stacks", {})
        if not isinstance(stacks, dict) or not all(
            isinstance(k, str) and _plain_name(k) and self._valid_stack(v) for k, v in stacks.items()
        ):
            raise CacheError(
                f"{self.root / version}/manifest.json has a malformed stack list (row counts, snapshot "
                "and delta digests expected); the cache is damaged"
            )
        for field in LOG_FIELDS:
            if field in data:
                data[field] = self._read_log(data[field], f"{field} of {self.root / version}/manifest.json")
        return data

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
        raw = self.read_json(manifest_path)
        out = []
        for field in LOG_FIELDS:
            ref = raw.get(field)
            if isinstance(ref, dict) and isinstance(ref.get("blobs"), list):
                out.extend(ref["blobs"])
        return out

    def _read_log(self, ref: Any, what: str) -> list[Any]:
        """An append-only log field: stored as ``{"blobs": [digest, ...]}``, one JSON blob per entry.

        A plain list (the inline log of manifests written before the log moved to blobs) is read as is.
        """
        if isinstance(ref, list):
            return ref
        if not isinstance(ref, dict) or not isinstance(ref.get("blobs"), list):
            raise CacheError(f"{what} is malformed (a list of entry digests expected); the cache is damaged")
        entries = []
        for digest in ref["blobs"]:
            if not isinstance(digest, str) or not _SHA256.match(digest):
                raise CacheError(
                    f"{what} is malformed (a list of entry digests expected); the cache is damaged"
                )
            try:
                entries.append(json.loads(self.read_blob(digest, what, None).decode("utf-8")))
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                raise CacheError(f"{what}: entry {self.blob_path(digest)} is not valid JSON") from None
        return entries

    def blob_path(self, digest: str) -> Path:
        """Where the blob with this SHA-256 lives (``digest`` must be 64 lowercase hex digits)."""
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise CacheError(f"{digest!r} is not a SHA-256 digest; the cache is damaged")
        return self.root / BLOBS / digest[:2] / digest

    def read_blob(self, digest: str, what: str, version: str | None) -> bytes:
        """The bytes of a blob, checked against its digest (``what`` and ``version`` name it in errors)."""
        path = self.blob_path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            if version is not None and version in self.pruned():
                raise CacheError(
                    f"{what}: blob {path} is gone: `cache gc` pruned version {version} (its manifest "
                    "stays as history, its models do not)"
                ) from None
            raise CacheError(
                f"{what}: missing tensor file {path}; the run directory is incomplete or was moved"
            ) from None
        except OSError as e:
            raise CacheError(f"{what}: cannot read {path} ({e.strerror or e})") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise CacheError(
                f"{what}: checksum mismatch for {path}: the file was modified or corrupted; refusing to load it"
            )
        self.checked.add(digest)
        return data

    @staticmethod
    def _valid_stack(entry: Any) -> bool:
        if not isinstance(entry, dict):
            return False
        n, snap, delta = entry.get("rows"), entry.get("snapshot"), entry.get("delta")
        return (
            isinstance(n, int)
            and not isinstance(n, bool)
            and n >= 1
            and isinstance(snap, str)
            and bool(_SHA256.match(snap))
            and isinstance(delta, dict)
            and all(
                isinstance(k, str)
                and k.isdigit()
                and int(k) < n
                and isinstance(v, str)
                and bool(_SHA256.match(v))
                for k, v in delta.items()
            )
        )

    @staticmethod
    def read_json(path: Path) -> dict[str, Any]:
        """A JSON object from ``path``; a missing, unreadable or malformed file is a one-line error."""
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
