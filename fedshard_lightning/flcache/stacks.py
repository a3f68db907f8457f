"""FLCache stacks: one blob per row of a stacked model tensor, indexed by a snapshot plus a delta.

A stack's row digests are a snapshot blob (``[N, 32]`` digests, shared across versions) plus the
rows that differ from it (``delta``); a new snapshot is written once the delta outgrows
``sqrt(N)`` rows. :class:`StackStore` is the collaborator of
:class:`~fedshard_lightning.flcache.cache.FLCache` that reads and writes them, over its reader.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from torch import Tensor

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.schema import check_loaded, check_schema

if TYPE_CHECKING:
    from fedshard_lightning.flcache.reader import CacheReader

__all__ = ["StackStore", "StackWrite"]


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


class StackStore:
    """Stacks of :class:`~fedshard_lightning.flcache.cache.FLCache`, over the reader of its blobs and manifests."""

    def __init__(self, reader: CacheReader) -> None:
        self.reader = reader

    def digests(
        self, name: str, version: str | None = None, manifest: dict[str, Any] | None = None
    ) -> list[str]:
        """Blob digest of every row of stack ``name`` in a version (snapshot plus delta)."""
        version = version or self.reader.current()
        stacks = (manifest if manifest is not None else self.reader.manifest(version)).get("stacks", {})
        if name not in stacks:
            raise CacheError(f"the cache version {version} has no stack {name!r}")
        entry = stacks[name]
        digests = self._snapshot(entry["snapshot"], entry["rows"], f"index of {name} in {version}")
        for k, v in entry["delta"].items():
            digests[int(k)] = v
        return digests

    def _snapshot(self, digest: str, rows: int, what: str) -> list[str]:
        data = self.reader.read_blob(digest, what, None)
        try:
            t = load(data)["digests"]
        except (SafetensorError, ValueError, KeyError) as e:
            raise CacheError(f"{what}: {self.reader.blob_path(digest)} is not a stack index ({e})") from None
        if t.dtype != torch.uint8 or tuple(t.shape) != (rows, 32):
            raise CacheError(f"{what}: the index holds {tuple(t.shape)} digests, expected ({rows}, 32)")
        raw = t.numpy().tobytes()
        return [raw[i * 32 : i * 32 + 32].hex() for i in range(rows)]

    def load(
        self,
        name: str,
        version: str | None = None,
        device: str | torch.device = "cpu",
        manifest: dict[str, Any] | None = None,
        row_schema: dict[str, Any] | None = None,
    ) -> dict[str, Tensor]:
        """Stacked tensors ``[N, ...]`` of stack ``name`` in a version, every row blob verified.

        ``row_schema``, when given, is the model every row must match.
        """
        version = version or self.reader.current()
        manifest = manifest if manifest is not None else self.reader.manifest(version)
        digests = self.digests(name, version, manifest)
        what = f"stack {name} of cache version {version}"
        seen: dict[str, bytes] = {}
        datas = []
        for i, d in enumerate(digests):
            if d not in seen:
                seen[d] = self.reader.read_blob(d, f"row {i} of {what}", version)
            datas.append(seen[d])
        out = _stack_rows(datas, what)
        check_loaded(out, manifest, "stacks", name, what)
        if row_schema is not None:
            fix = "the cache was modified after it was written, or the configured model is not the run's"
            check_schema(out, row_schema, what, fix + "; use the run's config.yaml", rows=True)
        return {k: out[k].to(device) for k in sorted(out)}

    def write(
        self,
        name: str,
        st: StackWrite,
        base: dict[str, Any] | None,
        base_version: str | None,
        put: Callable[[bytes], str],
    ) -> dict[str, Any]:
        """Row blobs of the changed rows, and the stack's index entry (snapshot plus delta).

        ``put`` stores bytes as a blob of the running commit and returns its digest.
        """
        if not st.tensors:
            raise CacheError(f"stack {name!r} holds no tensors")
        n = next(iter(st.tensors.values())).shape[0]
        if n < 1 or any(v.ndim == 0 or v.shape[0] != n for v in st.tensors.values()):
            raise CacheError(f"stack {name!r}: every entry needs the same leading number of rows")
        entry = (base or {}).get("stacks", {}).get(name)
        same = entry is not None and entry["rows"] == n
        snapshot: list[str] | None = None
        if st.rows is not None and same:
            digests = self.digests(name, base_version, base)
            rows = sorted({int(i) for i in st.rows})
            if rows and not 0 <= rows[0] <= rows[-1] < n:
                raise CacheError(f"stack {name!r}: rows out of range 0..{n - 1}")
        else:
            digests, rows = [""] * n, list(range(n))
        if rows:
            codec = _RowCodec(st.tensors)
            for i in rows:
                digests[i] = put(codec.row(i))
        if same:
            snapshot = self._snapshot(entry["snapshot"], n, f"index of {name} in {base_version}")
            delta = {str(i): d for i, d in enumerate(digests) if d != snapshot[i]}
            if len(delta) <= math.isqrt(n):
                return {"rows": n, "snapshot": entry["snapshot"], "delta": delta}
        raw = torch.frombuffer(bytearray(b"".join(bytes.fromhex(d) for d in digests)), dtype=torch.uint8)
        snap = put(save({"digests": raw.reshape(n, 32)}))
        return {"rows": n, "snapshot": snap, "delta": {}}
