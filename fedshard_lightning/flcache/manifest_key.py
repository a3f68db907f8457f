"""Optional tamper evidence: ``CURRENT`` signed with a secret key (HMAC-SHA256).

Checksums find accidents, not intent: whoever can write the run folder can change a blob and
rewrite its digest in the manifest and the manifest's digest in ``CURRENT``. With the environment
variable ``FEDSHARD_MANIFEST_KEY`` set, every write of ``CURRENT`` adds ``hmac``, an HMAC-SHA256
of the version name and its manifest's SHA-256 under that key, and every read of ``CURRENT``
checks it. ``CURRENT`` anchors the current manifest by its digest, that manifest anchors its blobs
by theirs and its parent manifest by the hash chain (``cache verify --all``), so a change anywhere
on the current history needs the key.

What it does not protect against: anyone who holds the key; a run folder replaced by an older
signed copy of itself (or an older ``CURRENT`` kept and put back: the request records catch that
while they are kept, :mod:`fedshard_lightning.run.request_history`); edits of files outside the cache
(``model.safetensors`` is rewritten from the cache by every command, the reports are re-created
from it); reading the data (nothing is encrypted). Runs written without the key cannot be read
with it set (their ``CURRENT`` is unsigned): set it from the first ``fit`` on.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Any

from fedshard_lightning.errors import CacheError

__all__ = ["KEY_VARIABLE", "check_pointer", "pointer"]

KEY_VARIABLE = "FEDSHARD_MANIFEST_KEY"


def _key() -> bytes | None:
    value = os.environ.get(KEY_VARIABLE, "")
    return value.encode("utf-8") if value else None


def _mac(key: bytes, version: str, manifest_sha256: str) -> str:
    message = f"fedshard-flcache-current\0{version}\0{manifest_sha256}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def pointer(version: str, manifest_sha256: str) -> dict[str, Any]:
    """The content of ``CURRENT`` for a version: signed when the key is set."""
    out: dict[str, Any] = {"version": version, "manifest_sha256": manifest_sha256}
    key = _key()
    if key is not None:
        out["hmac"] = _mac(key, version, manifest_sha256)
    return out


def check_pointer(ptr: dict[str, Any], path: Path) -> None:
    """Refuse an unsigned or wrongly signed ``CURRENT`` while the key is set (nothing to do without it)."""
    key = _key()
    if key is None:
        return
    given = ptr.get("hmac")
    if not isinstance(given, str):
        raise CacheError(
            f"{path} is not signed, but {KEY_VARIABLE} is set: the run was written without the key, or its "
            "signature was removed; unset the variable to read an unsigned run, or restore it from a backup"
        )
    want = _mac(key, str(ptr.get("version")), str(ptr.get("manifest_sha256")))
    if not hmac.compare_digest(given, want):
        raise CacheError(
            f"{path}: its signature does not match under {KEY_VARIABLE}: the cache was changed by someone "
            "without the key (or the key differs from the one it was written with); restore it from a backup"
        )
