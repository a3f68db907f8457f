"""FLCache: the on-disk state that training leaves for unlearning, versioned, atomic and checked.

:class:`FLCache` (:mod:`~fedshard_lightning.flcache.cache`) holds its collaborators: the reader of
versions and manifests (:mod:`~fedshard_lightning.flcache.reader`, no torch), the stacks of models
(:mod:`~fedshard_lightning.flcache.stacks`), the writer of new versions
(:mod:`~fedshard_lightning.flcache.writer`), the checks (:mod:`~fedshard_lightning.flcache.verify`)
and retention (:mod:`~fedshard_lightning.flcache.gc`), over the file primitives of
:mod:`~fedshard_lightning.flcache.io`. ``FLCache`` is imported on first use (PEP 562): listing runs
reads manifests without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedshard_lightning.flcache.io import (
    atomic_save_tensors,
    atomic_write_bytes,
    atomic_write_json,
    load_tensors,
    remove_stale_tmp,
    sha256_file,
)

if TYPE_CHECKING:
    from fedshard_lightning.flcache.cache import FLCache
    from fedshard_lightning.flcache.stacks import StackWrite

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


def __getattr__(name: str) -> Any:
    if name == "FLCache":
        from fedshard_lightning.flcache.cache import FLCache

        return FLCache
    if name == "StackWrite":
        from fedshard_lightning.flcache.stacks import StackWrite

        return StackWrite
    raise AttributeError(f"module 'fedshard_lightning.flcache' has no attribute {name!r}")
