"""Names, shapes and dtypes of tensor files: recorded at commit, checked on every load.

A checksum proves the bytes are the ones committed; it cannot prove they are the right tensors
(a manifest edited together with its checksums, or a model file swapped for another model's).
So every manifest records each file's schema (``schemas``), and every load is checked against
it, and the model-shaped state (theta0, each stack row, ``model.safetensors``) against the
configured model, before any tensor is used: a mismatch is one line naming the file and the fix,
never a shape error deep inside training.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.errors import CacheError

__all__ = ["check_loaded", "check_schema", "schema_of", "tensors_sha256"]


def schema_of(tensors: dict[str, Tensor], rows: bool = False) -> dict[str, list[Any]]:
    """``{name: [dtype, shape]}``; with ``rows`` the shape of one row (a stack's leading dim dropped)."""
    return {
        k: [str(v.dtype).removeprefix("torch."), list(v.shape[1:] if rows else v.shape)]
        for k, v in sorted(tensors.items())
    }


def check_schema(tensors: dict[str, Tensor], expected: Any, what: str, fix: str, rows: bool = False) -> None:
    """Raise a one-line CacheError naming the first tensor that differs from ``expected``.

    Args:
        tensors: The loaded tensors.
        expected: A :func:`schema_of` dict (from a manifest or the configured model).
        what: The file, for the message.
        fix: What the user should do, for the message.
        rows: Compare row shapes (``tensors`` are stacks ``[N, ...]``).
    """
    if not isinstance(expected, dict):
        raise CacheError(f"{what}: its recorded tensor schema is malformed; the cache is damaged")
    got = schema_of(tensors, rows)
    if got == expected:
        return
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        detail = f"missing tensors {missing[:3]}" if missing else f"unexpected tensors {extra[:3]}"
    else:
        k = next(k for k in sorted(got) if got[k] != expected[k])
        detail = f"tensor {k!r} is {got[k][0]} {tuple(got[k][1])}, expected {expected[k][0]} {tuple(expected[k][1])}"
    raise CacheError(f"{what} does not hold the expected tensors ({detail}); {fix}")


def tensors_sha256(tensors: dict[str, Tensor]) -> str:
    """SHA-256 over the sorted names, dtypes, shapes and raw bytes (how ``model.safetensors`` proves itself)."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        v = tensors[k].detach().contiguous().cpu()
        h.update(f"{k}\0{v.dtype}\0{tuple(v.shape)}\0".encode())
        if v.numel():  # raw bytes of any dtype (numpy has no bfloat16)
            h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_loaded(
    tensors: dict[str, Tensor], manifest: dict[str, Any], kind: str, name: str, what: str
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
