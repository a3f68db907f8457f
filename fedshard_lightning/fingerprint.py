"""The cache fingerprint: which model, data, algorithm and seed a run's FLCache belongs to.

A cache is refused by ``fit --ckpt_path``, ``unlearn`` and ``audit`` when the configured run has
another fingerprint. It hashes the constructor arguments of the model, the datamodule and the
algorithm as recorded by :mod:`fedshard_lightning.init_args` (the same ``class_path`` /
``init_args`` that jsonargparse reads from the config; no hand-kept lists, so a new argument is
covered the day it is added), the model's parameter shapes and dtype, the data's own content hash
(labels and partition, :meth:`FederatedDataModule.fingerprint`, which also hashes the data's init
args except where its files live) and the training seed. An argument that does not change the
result but is fingerprinted anyway refuses a good cache loudly; none can accept a stale one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fedshard_lightning.init_args import init_args

__all__ = ["fingerprint", "fingerprint_body", "readable_body"]


def fingerprint_body(model: Any, datamodule: Any, algorithm: Any, seed: int) -> dict[str, Any]:
    """What the fingerprint hashes (readable: printed when two runs disagree)."""
    return {
        "model": init_args(model),
        "params": {n: list(p.shape) for n, p in model.named_parameters()},
        "dtype": str(next(model.parameters()).dtype),
        "data": datamodule.fingerprint(),
        "algorithm": init_args(algorithm),
        "seed": int(seed),
    }


def fingerprint(model: Any, datamodule: Any, algorithm: Any, seed: int) -> str:
    """32 hex digits of SHA-256 over :func:`fingerprint_body`."""
    body = fingerprint_body(model, datamodule, algorithm, seed)
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:32]


def readable_body(model: Any, datamodule: Any, algorithm: Any, seed: int) -> dict[str, Any]:
    """:func:`fingerprint_body` plus the data's settings, so a refused resume can name the setting that changed.

    Recorded in ``cache/FINGERPRINT`` before training; the data's own fingerprint is a hash.
    """
    return {**fingerprint_body(model, datamodule, algorithm, seed), "data_settings": init_args(datamodule)}
