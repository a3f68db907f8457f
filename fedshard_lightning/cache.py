"""FLCache: the on-disk state that training leaves for unlearning (SPEC section 6).

Layout of ``RUN_DIR/cache`` (format 2, content-addressed)::

    CURRENT                   {"version": "0014-unlearn-0002", "manifest_sha256": "..."}
    PRUNED                    versions whose models ``cache gc`` dropped (their manifests stay)
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
import hashlib
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save, save_file
from torch import Tensor

from fedshard_lightning.errors import CacheError

__all__ = [
    "FLCache",
    "StackWrite",
    "atomic_save_tensors",
    "atomic_write_bytes",
    "atomic_write_json",
    "load_tensors",
    "remove_stale_tmp",
    "sha256_file",
]

FORMAT = "fedshard-flcache/2"
BLOBS = "blobs"
# Append-only manifest fields (the trainer's request log): every entry is a JSON blob and a
# manifest lists their digests, so a version adds its new entries only. Inline, the log made a
# manifest O(requests) and the cache O(requests^2) (150 KB per manifest after 100 requests).
LOG_FIELDS = ("requests",)

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


def _sync_paths(paths: Sequence[Path], directories: set[Path]) -> None:
    """Make new files and their directory entries durable: ``syncfs`` once, else ``fsync`` each."""
    if not paths and not directories:
        return
    if len(paths) > 32 and sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(next(iter(directories)), os.O_RDONLY)
            try:
                if libc.syncfs(fd) == 0:
                    return
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            pass
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in directories:
        _fsync_dir(d)


@contextlib.contextmanager
def _flock(path: Path, blocking: bool = True, busy: str | None = None) -> Iterator[None]:
    """Exclusive ``flock`` on a folder (no file is created; released on exit, even by a kill).

    Args:
        path: The folder.
        blocking: Wait for the lock; otherwise raise ``CacheError(busy)`` when it is taken.
        busy: Message of that error.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            raise CacheError(busy or f"{path} is locked by another process") from None
        yield
    finally:
        os.close(fd)


@dataclass
class StackWrite:
    """A stack to commit: one blob per row of ``tensors`` (each entry ``[N, ...]``).

    Attributes:
        tensors: Name -> stacked tensor; row ``i`` of every entry is one model.
        rows: Rows that changed since the current version (the others are taken from its stack of
            the same name and size, unread); ``None``: every row is serialized and hashed (blobs
            that exist already are not written again).
    """

    tensors: dict[str, Tensor]
    rows: Sequence[int] | None = None


class _RowCodec:
    """Safetensors bytes of every row of a stack, and stacks back from row bytes.

    All rows of a stack have the same header, so it is taken once from safetensors' own
    serialization of row 0, and a row's file is that header followed by its data (checked equal
    to ``safetensors.torch.save`` of row 0, else every row goes through safetensors): 10x faster
    than calling ``save`` per row (142 us for an MLP 64-64).
    """

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        self.n = next(iter(self.cpu.values())).shape[0]
        first = save({k: v[0].contiguous() for k, v in self.cpu.items()})
        hlen = int.from_bytes(first[:8], "little")
        header = json.loads(first[8 : 8 + hlen])
        order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        self.prefix = first[: 8 + hlen]
        self.data = torch.cat([self.cpu[k].reshape(self.n, -1).view(torch.uint8) for k in order], dim=1)
        self.numpy = self.data.numpy()
        self.fast = True
        self.fast = first == self.row(0)  # else safetensors' own bytes for every row

    def row(self, i: int) -> bytes:
        """The safetensors file of row ``i``."""
        if self.fast:
            return self.prefix + self.numpy[i].tobytes()
        return save({k: v[i].contiguous() for k, v in self.cpu.items()})


def _stack_rows(datas: list[bytes], what: str) -> dict[str, Tensor]:
    """Stack row files (safetensors bytes) into ``[N, ...]`` tensors.

    The first row is parsed by safetensors; the others must carry the very same header bytes and
    length to be copied by offset (one parse per stack instead of per row), else each is parsed.
    """
    try:
        first = load(datas[0])
    except (SafetensorError, ValueError) as e:
        raise CacheError(
            f"{what}: row 0 is not a valid safetensors file ({e}); refusing to load it"
        ) from None
    hlen = int.from_bytes(datas[0][:8], "little")
    prefix = datas[0][: 8 + hlen]
    header = json.loads(datas[0][8 : 8 + hlen])
    order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    width = len(datas[0]) - len(prefix)
    if all(len(d) == len(datas[0]) and d.startswith(prefix) for d in datas) and sorted(order) == sorted(
        first
    ):
        buf = torch.empty(len(datas), width, dtype=torch.uint8)
        view = buf.numpy()
        for i, d in enumerate(datas):
            view[i] = memoryview(d)[len(prefix) :]
        out = {}
        for k in order:
            b, e = header[k]["data_offsets"]
            t = first[k]
            out[k] = buf[:, b:e].contiguous().view(t.dtype).reshape(len(datas), *t.shape)
        return out
    rows = []
    for i, d in enumerate(datas):
        try:
            rows.append(load(d))
        except (SafetensorError, ValueError) as e:
            raise CacheError(
                f"{what}: row {i} is not a valid safetensors file ({e}); refusing to load it"
            ) from None
    keys = sorted(rows[0])
    if any(sorted(r) != keys for r in rows):
        raise CacheError(f"{what}: rows hold different tensors; the cache is damaged")
    try:
        return {k: torch.stack([r[k] for r in rows]) for k in keys}
    except RuntimeError as e:
        raise CacheError(f"{what}: rows do not stack ({e}); the cache is damaged") from None


class FLCache:
    """Versioned, atomic, content-addressed store of manifests, tensor files and stacks of models."""

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

    def manifest(self, version: str | None = None) -> dict[str, Any]:
        """The manifest of a version (default: current)."""
        version = version or self.current()
        if not _plain_name(version) or version == BLOBS:
            raise CacheError(f"{version!r} is not a version folder of {self.root}")
        data = self._read_json(self.root / version / "manifest.json")
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

    def log_digests(self, manifest_path: Path) -> list[str]:
        """Blob digests of the log entries (e.g. the request reports) that a stored manifest names."""
        raw = self._read_json(manifest_path)
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
                entries.append(json.loads(self._read_blob(digest, what, None).decode("utf-8")))
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                raise CacheError(f"{what}: entry {self.blob_path(digest)} is not valid JSON") from None
        return entries

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

    def blob_path(self, digest: str) -> Path:
        """Where the blob with this SHA-256 lives (``digest`` must be 64 lowercase hex digits)."""
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise CacheError(f"{digest!r} is not a SHA-256 digest; the cache is damaged")
        return self.root / BLOBS / digest[:2] / digest

    def _read_blob(self, digest: str, what: str, version: str | None) -> bytes:
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
        return data

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
        data = self._read_blob(files[name], what, version)
        try:
            out = load(data)
        except (SafetensorError, ValueError) as e:
            raise CacheError(
                f"{self.blob_path(files[name])} ({what}) is not a valid safetensors file ({e}); refusing to load it"
            ) from None
        # Sorted like load_file's: safetensors.torch.load (from bytes) returns a hash map's order,
        # which differs between processes (DDP ranks would then gather parameters in different orders).
        return {k: out[k].to(device) for k in sorted(out)}

    def stack_digests(
        self, name: str, version: str | None = None, manifest: dict[str, Any] | None = None
    ) -> list[str]:
        """Blob digest of every row of stack ``name`` in a version (snapshot plus delta)."""
        version = version or self.current()
        stacks = (manifest if manifest is not None else self.manifest(version)).get("stacks", {})
        if name not in stacks:
            raise CacheError(f"the cache version {version} has no stack {name!r}")
        entry = stacks[name]
        digests = self._snapshot(entry["snapshot"], entry["rows"], f"index of {name} in {version}")
        for k, v in entry["delta"].items():
            digests[int(k)] = v
        return digests

    def _snapshot(self, digest: str, rows: int, what: str) -> list[str]:
        data = self._read_blob(digest, what, None)
        try:
            t = load(data)["digests"]
        except (SafetensorError, ValueError, KeyError) as e:
            raise CacheError(f"{what}: {self.blob_path(digest)} is not a stack index ({e})") from None
        if t.dtype != torch.uint8 or tuple(t.shape) != (rows, 32):
            raise CacheError(f"{what}: the index holds {tuple(t.shape)} digests, expected ({rows}, 32)")
        raw = t.numpy().tobytes()
        return [raw[i * 32 : i * 32 + 32].hex() for i in range(rows)]

    def stack(
        self,
        name: str,
        version: str | None = None,
        device: str | torch.device = "cpu",
        manifest: dict[str, Any] | None = None,
    ) -> dict[str, Tensor]:
        """Stacked tensors ``[N, ...]`` of stack ``name`` in a version, every row blob verified."""
        version = version or self.current()
        digests = self.stack_digests(name, version, manifest)
        what = f"stack {name} of cache version {version}"
        seen: dict[str, bytes] = {}
        datas = []
        for i, d in enumerate(digests):
            if d not in seen:
                seen[d] = self._read_blob(d, f"row {i} of {what}", version)
            datas.append(seen[d])
        out = _stack_rows(datas, what)
        return {k: out[k].to(device) for k in sorted(out)}

    def verify(self, version: str | None = None) -> None:
        """Check every blob of a version against its digest (only its indexes when gc pruned it)."""
        version = version or self.current()
        manifest = self.manifest(version)
        pruned = version in self.pruned()
        for name in manifest.get("stacks", {}):
            digests = self.stack_digests(name, version, manifest)
            if pruned:
                continue
            for d in set(digests):
                self._verify_blob(d)
        if not pruned:
            for digest in manifest.get("files", {}).values():
                self._verify_blob(digest)

    def _verify_blob(self, digest: str) -> None:
        path = self.blob_path(digest)
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
    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Exclusive lock of the cache for writers (blocking; not re-entrant)."""
        self.root.mkdir(parents=True, exist_ok=True)
        return _flock(self.root)

    def _put(self, data: bytes, touched: list[Path], dirs: set[Path]) -> str:
        """Store ``data`` as a blob unless an intact one exists; return its digest.

        Both new and existing blobs go to ``touched``, to be made durable before the manifest that
        names them: an existing one may be the unsynced leftover of a writer that was killed.
        """
        digest = hashlib.sha256(data).hexdigest()
        path = self.blob_path(digest)
        try:
            if path.stat().st_size == len(data):
                touched.append(path)
                return digest  # content-addressed: same name, same bytes (size checked against a torn file)
        except FileNotFoundError:
            pass
        if path.parent not in dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            dirs.add(path.parent)
        tmp = path.with_name(f".{digest}.tmp-{os.getpid()}")
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
            remove_stale_tmp(self.root)
            final = self.root / name
            if final.exists():
                raise CacheError(f"cache version {final} exists already; refusing to overwrite it")
            tmp = self.root / f".{name}.tmp-{os.getpid()}"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            base_version = self.current() if self.exists() and (reuse or stacks) else None
            base = self.manifest(base_version) if base_version is not None else None
            touched: list[Path] = []
            dirs: set[Path] = set()
            files: dict[str, str] = {}
            for new_name, old_name in (reuse or {}).items():
                if base is None or old_name not in base["files"]:
                    raise CacheError(f"cannot reuse {old_name!r}: the current version has no such file")
                files[new_name] = base["files"][old_name]
                if not self.blob_path(files[new_name]).is_file():
                    raise CacheError(f"cannot reuse {old_name!r}: its blob is gone (pruned by cache gc?)")
            for fname, tens in tensors.items():
                files[fname] = self._put(
                    save({k: v.detach().contiguous().cpu() for k, v in tens.items()}), touched, dirs
                )
            stack_entries = {
                sname: self._write_stack(sname, st, base, base_version, touched, dirs)
                for sname, st in (stacks or {}).items()
            }
            logs = {
                field: {
                    "blobs": [
                        self._put(json.dumps(entry, sort_keys=True).encode(), touched, dirs)
                        for entry in manifest[field]
                    ]
                }
                for field in LOG_FIELDS
                if isinstance(manifest.get(field), list)
            }
            body = {**manifest, **logs, "format": FORMAT, "files": files, "stacks": stack_entries}
            _sync_paths(touched, dirs | {self.root / BLOBS} if touched else dirs)
            # One line: json's pure-Python encoder (used whenever indent is set) is 10x slower.
            atomic_write_json(tmp / "manifest.json", body, indent=None)
            _fsync_dir(tmp)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            atomic_write_json(
                self.root / "CURRENT",
                {"version": name, "manifest_sha256": sha256_file(final / "manifest.json")},
            )
        return name

    def _write_stack(
        self,
        name: str,
        st: StackWrite,
        base: dict[str, Any] | None,
        base_version: str | None,
        touched: list[Path],
        dirs: set[Path],
    ) -> dict[str, Any]:
        """Row blobs of the changed rows, and the stack's index entry (snapshot plus delta)."""
        if not st.tensors:
            raise CacheError(f"stack {name!r} holds no tensors")
        n = next(iter(st.tensors.values())).shape[0]
        if n < 1 or any(v.ndim == 0 or v.shape[0] != n for v in st.tensors.values()):
            raise CacheError(f"stack {name!r}: every entry needs the same leading number of rows")
        entry = (base or {}).get("stacks", {}).get(name)
        same = entry is not None and entry["rows"] == n
        snapshot: list[str] | None = None
        if st.rows is not None and same:
            digests = self.stack_digests(name, base_version, base)
            rows = sorted({int(i) for i in st.rows})
            if rows and not 0 <= rows[0] <= rows[-1] < n:
                raise CacheError(f"stack {name!r}: rows out of range 0..{n - 1}")
        else:
            digests, rows = [""] * n, list(range(n))
        if rows:
            codec = _RowCodec(st.tensors)
            for i in rows:
                digests[i] = self._put(codec.row(i), touched, dirs)
        if same:
            snapshot = self._snapshot(entry["snapshot"], n, f"index of {name} in {base_version}")
            delta = {str(i): d for i, d in enumerate(digests) if d != snapshot[i]}
            if len(delta) <= math.isqrt(n):
                return {"rows": n, "snapshot": entry["snapshot"], "delta": delta}
        raw = torch.frombuffer(bytearray(b"".join(bytes.fromhex(d) for d in digests)), dtype=torch.uint8)
        snap = self._put(save({"digests": raw.reshape(n, 32)}), touched, dirs)
        return {"rows": n, "snapshot": snap, "delta": {}}

    def set_current(self, version: str) -> None:
        """Point CURRENT at an existing committed version (used to restore after a replay)."""
        if version in self.pruned():
            raise CacheError(f"version {version} was pruned by `cache gc`; it cannot become current again")
        self.manifest(version)
        with self.lock():
            atomic_write_json(
                self.root / "CURRENT",
                {"version": version, "manifest_sha256": sha256_file(self.root / version / "manifest.json")},
            )

    def next_name(self, label: str) -> str:
        """A fresh, ordered version name like ``0004-label``."""
        existing = [int(v.split("-", 1)[0]) for v in self.versions() if v.split("-", 1)[0].isdigit()]
        return f"{max(existing, default=0) + 1:04d}-{label}"

    # -- retention -------------------------------------------------------------------------------
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
