"""The cache fingerprint: which model, data, algorithm and seed a run's FLCache belongs to.

A cache is refused by ``fit --ckpt_path``, ``unlearn`` and ``audit`` when the configured run has
another fingerprint. It hashes the constructor arguments of the model, the datamodule and the
algorithm as recorded by :mod:`fedshard_lightning.init_args` (the same ``class_path`` /
``init_args`` that jsonargparse reads from the config; no hand-kept lists, so a new argument is
covered the day it is added), the model's parameter shapes and dtype, the data's own content hash
(labels and partition, :meth:`FederatedDataModule.fingerprint`, which also hashes the data's init
args except where its files live) and the training seed. An argument that does not change the
result but is fingerprinted anyway refuses a good cache loudly; none can accept a stale one.

A model may keep its learning rate in an attribute instead of a constructor argument it records
(a plain ``LightningModule`` without ``save_hyperparameters``). So ``cache/FINGERPRINT`` also
records the client optimizer as ``configure_optimizers`` builds it (:func:`optimizer_body`), and
a resume, ``unlearn``, ``audit`` or ``test`` with another one is refused (:meth:`.RunStore.check`).
It is kept out of the hash, so runs fitted before it was recorded keep their fingerprint. The
training samples' values are recorded the same way (:func:`values_digest`): the hash covers the
labels and the partition, and an edited data file with the same labels is refused by the same check.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fedshard_lightning.init_args import init_args

__all__ = [
    "body_fingerprint",
    "fingerprint",
    "fingerprint_body",
    "optimizer_body",
    "readable_body",
    "values_digest",
]

#: What :func:`readable_body` adds to :func:`fingerprint_body` without hashing it.
_UNHASHED = ("data_settings", "optimizer", "data_values", "gradient_clip", "optimizer_state")

#: Rounds of the scheduler's learning rates recorded (a changed schedule shows in its first rates).
SCHEDULE_ROUNDS = 4


def fingerprint_body(model: Any, datamodule: Any, algorithm: Any, seed: int) -> dict[str, Any]:
    """What the fingerprint hashes (readable: printed when two runs disagree)."""
    return {
        "model": _shapes_as_open(init_args(model), datamodule),
        "params": {n: list(p.shape) for n, p in model.named_parameters()},
        "dtype": str(next(model.parameters()).dtype),
        "data": datamodule.fingerprint(),
        "algorithm": init_args(algorithm),
        "seed": int(seed),
    }


def _shapes_as_open(recorded: dict[str, Any], datamodule: Any) -> dict[str, Any]:
    """The model's args with ``num_classes``/``input_shape`` equal to the data's written as open (``null``).

    ``config.yaml`` records the shapes the data resolved, so a config read back names them where
    the fit's left them open: the same model, the same fingerprint.
    """
    args = recorded.get("init_args")
    if not isinstance(args, dict):
        return recorded
    data = {
        "num_classes": getattr(datamodule, "num_classes", None),
        "input_shape": list(getattr(datamodule, "input_shape", None) or []) or None,
    }
    same = {k: None for k, v in data.items() if v is not None and k in args and args[k] == v}
    return {**recorded, "init_args": {**args, **same}} if same else recorded


def fingerprint(model: Any, datamodule: Any, algorithm: Any, seed: int) -> str:
    """32 hex digits of SHA-256 over :func:`fingerprint_body`."""
    return body_fingerprint(fingerprint_body(model, datamodule, algorithm, seed))


def body_fingerprint(body: dict[str, Any]) -> str:
    """:func:`fingerprint` of a :func:`fingerprint_body` or :func:`readable_body` (its extra keys are not hashed)."""
    hashed = {k: v for k, v in body.items() if k not in _UNHASHED}
    return hashlib.sha256(json.dumps(hashed, sort_keys=True, default=str).encode()).hexdigest()[:32]


def readable_body(model: Any, datamodule: Any, algorithm: Any, seed: int) -> dict[str, Any]:
    """:func:`fingerprint_body` plus the data's settings, so a refused resume can name the setting that changed.

    Recorded in ``cache/FINGERPRINT`` before training; the data's own fingerprint is a hash.
    """
    return {
        **fingerprint_body(model, datamodule, algorithm, seed),
        "data_settings": init_args(datamodule),
        "optimizer": optimizer_body(model),
        "data_values": values_digest(datamodule),
    }


def values_digest(datamodule: Any) -> str | None:
    """SHA-256 (32 hex digits) of the training samples' values, or None when the data has no ``train_x``.

    The hashed fingerprint covers the labels and the partition, not the values: an edited data
    file with the same labels would be retrained in silence, and the audit would then fail.
    """
    x = getattr(datamodule, "train_x", None)
    if not hasattr(x, "detach"):
        return None
    arr = x.detach().cpu().contiguous().numpy()
    h = hashlib.sha256(str(arr.dtype).encode() + str(arr.shape).encode())
    h.update(memoryview(arr.reshape(-1).view("uint8")))
    return h.hexdigest()[:32]


def optimizer_body(model: Any) -> dict[str, Any]:
    """The client optimizer: class, settings per parameter group (by name), the scheduler's first rates."""
    from fedshard_lightning.engine.optim import optimizer_spec, round_lr

    spec = optimizer_spec(model, [n for n, p in model.named_parameters() if p.requires_grad])
    lrs = round_lr(model)
    body = {
        "class": spec.cls.__name__,
        "groups": [[list(names), hp] for names, hp in spec.groups],
        "round_lrs": [lrs(r) for r in range(SCHEDULE_ROUNDS)] if lrs is not None else None,
    }
    return json.loads(json.dumps(body, sort_keys=True, default=str))
