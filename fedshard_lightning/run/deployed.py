"""The deployed model, ``RUN/model.safetensors``: written with the hash of its tensors, verified by every reader.

The cache is the truth; this file is a convenience copy of its current model. It carries the
SHA-256 of its own tensors in the safetensors metadata, so a file changed after it was written
(one flipped byte) is refused, or, inside a run directory, repaired from the verified cache: it
can never be evaluated, unlearned from or audited while it disagrees with the cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.io import atomic_save_tensors
from fedshard_lightning.flcache.schema import check_schema, tensors_sha256

__all__ = ["load_model", "model_is_stale", "save_model"]

HASH_KEY = "fedshard_tensors_sha256"


def save_model(path: Path, state: dict[str, Tensor]) -> None:
    """Write the model atomically, with the hash of its tensors in the metadata.

    Tied weights (one parameter under two names, e.g. a decoder sharing its encoder's matrix) are
    written under both names, each a copy: safetensors refuses tensors that share memory, and
    ``load_state_dict`` of the file then fills the one parameter twice with the same values.
    """
    seen: set[tuple[int, int]] = set()
    unshared = {}
    for k, v in state.items():
        where = (v.untyped_storage().data_ptr(), v.storage_offset()) if v.numel() else (id(v), 0)
        unshared[k] = v.detach().clone() if where in seen else v
        seen.add(where)
    atomic_save_tensors(path, unshared, metadata={HASH_KEY: tensors_sha256(unshared)})


def _read(path: Path, device: str | torch.device) -> tuple[dict[str, Tensor], dict[str, str]]:
    if not path.is_file():
        raise CacheError(
            f"missing model file {path}; `test --ckpt_path RUN_DIR` re-creates it from the cache"
        )
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            return {k: f.get_tensor(k) for k in sorted(f.keys())}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise CacheError(
            f"{path} is not a valid safetensors file ({e}); `test --ckpt_path RUN_DIR` re-creates it from the cache"
        ) from None


def load_model(path: Path, expected: dict[str, Any], device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """The model in ``path``, refused when its tensors changed since it was written or do not fit the model.

    Args:
        path: A ``model.safetensors`` file.
        expected: :func:`~fedshard_lightning.flcache.schema.schema_of` the configured model's state dict.
        device: Where the tensors go.
    """
    state, meta = _read(path, device)
    if HASH_KEY in meta and tensors_sha256(state) != meta[HASH_KEY]:
        raise CacheError(
            f"{path} was modified after it was written (its tensors do not match the checksum it carries); "
            "`test --ckpt_path RUN_DIR` re-creates it from the run's cache"
        )
    check_schema(state, expected, str(path), "use the run's config.yaml (or the model file of this config)")
    return state


def model_is_stale(path: Path, params: dict[str, Tensor], device: torch.device) -> bool:
    """Whether ``model.safetensors`` is missing, damaged, or differs from the cache's current model."""
    try:
        on_disk, meta = _read(path, device)
    except CacheError:
        return True
    if meta.get(HASH_KEY) != tensors_sha256(on_disk):
        return True  # changed since written, or written without a hash (before this check existed)
    return any(
        k not in on_disk
        or on_disk[k].dtype != v.dtype
        or on_disk[k].shape != v.shape
        or not torch.equal(on_disk[k], v)
        for k, v in params.items()
    )
