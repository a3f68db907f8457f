"""The trained model outside the trainer: ``RUN/model.ckpt`` and :func:`load_model`.

``model.safetensors`` (:mod:`fedshard_lightning.run.deployed`) is the run's deployed model. Beside it,
every run holds ``model.ckpt``, the checkpoint that Lightning's ``YourModule.load_from_checkpoint``
reads: the model's ``state_dict`` and its ``hyper_parameters`` (the constructor arguments, with the
shapes the data gave). It holds tensors and plain Python values only, so
``torch.load(path, weights_only=True)`` accepts it. Both files are written at the same moments (fit,
each unlearning request, and a repair from the cache). :func:`load_model` builds the model from the
run's own ``config.yaml`` instead, and fills it with the verified ``model.safetensors``.
"""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from safetensors import safe_open
from torch import Tensor
from torch.nn.parameter import UninitializedParameter

from fedshard_lightning.errors import CacheError, ConfigError
from fedshard_lightning.flcache.io import atomic_write_bytes
from fedshard_lightning.flcache.schema import schema_of
from fedshard_lightning.init_args import init_args
from fedshard_lightning.module import FederatedModule, bind_model, setup_once
from fedshard_lightning.run.deployed import load_model as load_verified
from fedshard_lightning.run.deployed import model_is_stale

__all__ = [
    "CHECKPOINT",
    "hyper_parameters",
    "load_model",
    "resolved_config",
    "save_checkpoint",
    "stale_files",
]

CHECKPOINT = "model.ckpt"

#: Constructor arguments a FederatedModule leaves open (``None``) and takes from the data.
SHAPE_ARGS = ("num_classes", "input_shape")

#: The instantiator Lightning's ``load_from_checkpoint`` trusts: jsonargparse, as LightningCLI saves it.
_INSTANTIATOR = "lightning.pytorch.cli.instantiate_module"


def resolved_shapes(module: Any) -> dict[str, Any]:
    """``num_classes`` and ``input_shape`` as the data resolved them ({} for a plain LightningModule)."""
    if not isinstance(module, FederatedModule) or module.num_classes is None or module.input_shape is None:
        return {}
    return {"num_classes": int(module.num_classes), "input_shape": [int(s) for s in module.input_shape]}


def _nested_objects(value: Any) -> bool:
    if isinstance(value, dict):
        return "class_path" in value or any(_nested_objects(v) for v in value.values())
    return isinstance(value, list) and any(_nested_objects(v) for v in value)


def hyper_parameters(module: Any) -> dict[str, Any]:
    """The constructor arguments that rebuild ``module``: recorded init args with the resolved shapes.

    An argument that is itself an object (``{class_path, init_args}``) is built by the instantiator
    LightningCLI records (jsonargparse), which ``load_from_checkpoint`` allows; plain values need none.
    """
    hparams = {**init_args(module)["init_args"], **resolved_shapes(module)}
    if _nested_objects(hparams):
        hparams["_instantiator"] = _INSTANTIATOR
    return hparams


def save_checkpoint(path: Path, module: L.LightningModule) -> None:
    """Write ``module`` as a Lightning checkpoint, atomically, without pickled objects.

    Tensors are detached copies in their own storage (tied weights stay tied on load: the file
    holds the same values under both names).
    """
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    ckpt = {
        "state_dict": state,
        "hyper_parameters": hyper_parameters(module),
        "pytorch-lightning_version": L.__version__,
        "epoch": 0,
        "global_step": 0,
    }
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def _checkpoint_is_stale(path: Path, params: dict[str, Tensor]) -> bool:
    """Whether ``model.ckpt`` is missing, unreadable without pickle, or holds other tensors than ``params``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    except Exception:  # missing, truncated, or not a weights-only checkpoint: rewrite it
        return True
    return any(
        k not in state
        or state[k].dtype != v.dtype
        or state[k].shape != v.shape
        or not torch.equal(state[k], v.detach().cpu())
        for k, v in params.items()
    )


def stale_files(
    run_dir: Path, params: dict[str, Tensor], device: torch.device, ckpt: bool = True
) -> list[str]:
    """The deployed files (``model.safetensors``, ``model.ckpt``) that differ from ``params`` or are missing.

    ``ckpt`` false: the run exports no ``model.ckpt`` (``FLCacheCheckpoint.save_ckpt``), so one
    that is there is stale whatever it holds (it would stand for an older model).

    A symbolic link counts as stale: the deployed model is a file of the run, and a link would let a
    file outside it (which anyone may change later) stand for the model. The atomic rewrite replaces
    the link itself and leaves its target alone.
    """
    model, checkpoint = run_dir / "model.safetensors", run_dir / CHECKPOINT
    stale = ["model.safetensors"] if model.is_symlink() or model_is_stale(model, params, device) else []
    if not ckpt:
        return stale + ([CHECKPOINT] if checkpoint.exists() or checkpoint.is_symlink() else [])
    return stale + (
        [CHECKPOINT] if checkpoint.is_symlink() or _checkpoint_is_stale(checkpoint, params) else []
    )


def resolved_config(config_yaml: str, module: Any) -> str:
    """The run's config with the shapes the data gave where the model's were left open (absent or null).

    So the config alone rebuilds the model (e.g. ``FederatedCLI(args=[...], run=False)``); the
    fingerprint counts such a value as the open one (:func:`.fingerprint.fingerprint_body`).
    """
    shapes = resolved_shapes(module)
    config = yaml.safe_load(config_yaml)
    args = ((config or {}).get("model") or {}).get("init_args") if isinstance(config, dict) else None
    if not shapes or not isinstance(args, dict):
        return config_yaml
    accepted = init_args(module)["init_args"]  # bound to the signature: the class takes them
    open_args = [k for k in SHAPE_ARGS if k in accepted and args.get(k) is None]
    if not open_args:
        return config_yaml
    args.update({k: shapes[k] for k in open_args})
    header = "".join(
        itertools.takewhile(lambda line: line.startswith("#"), config_yaml.splitlines(keepends=True))
    )
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False, allow_unicode=True)


def _instantiate(section: Any, base: type, what: str) -> Any:
    """The object a config's ``class_path``/``init_args`` section describes, built by jsonargparse as the CLI does."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(base, what, required=True, fail_untyped=False)
    try:
        return parser.instantiate_classes(parser.parse_object({what: section}))[what]
    except Exception as e:  # jsonargparse raises its own error types
        raise ConfigError(
            f"{what}: cannot build it from the run's config.yaml ({' '.join(str(e).split())[:200]})"
        ) from None


def _stored_dtype(path: Path) -> torch.dtype | None:
    """The dtype of the first floating tensor in a safetensors file (a 64-true run holds float64)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                t = f.get_tensor(key)
                if t.is_floating_point():
                    return t.dtype
    except Exception:
        return None  # the verified load names the problem
    return None


def _data_shapes(config: dict[str, Any]) -> dict[str, Any]:
    """The data's shapes, from the datamodule the config describes (set up, nothing downloaded)."""
    from fedshard_lightning.data.base import FederatedDataModule

    data = _instantiate(config.get("data"), FederatedDataModule, "data")
    data.setup("fit")
    return {"num_classes": int(data.num_classes), "input_shape": list(data.input_shape)}


def load_model(run_dir: str | Path, map_location: str | torch.device = "cpu") -> L.LightningModule:
    """The run's model with its deployed weights, built from the run's own ``config.yaml``.

    The model class and its arguments come from the config (and the data's shapes, where the
    config left them open or the model has lazy layers); the weights come from
    ``model.safetensors``, checked against the hash it carries and the model's names, shapes and
    dtypes. Returned in eval mode on ``map_location``.

    Args:
        run_dir: A run directory that ``fit`` created.
        map_location: Device of the returned model.
    """
    run = Path(run_dir)
    config_path = run / "config.yaml"
    if not config_path.is_file():
        raise CacheError(
            f"{run} has no config.yaml (a run made from Python); load {run / CHECKPOINT} with "
            "YourModule.load_from_checkpoint instead"
        )
    config = yaml.safe_load(config_path.read_text()) or {}
    model = _instantiate(config.get("model"), L.LightningModule, "model")
    weights = run / "model.safetensors"
    dtype = _stored_dtype(weights)
    if dtype is not None:
        model.to(dtype)
    if isinstance(model, FederatedModule):
        shapes = resolved_shapes(model) or _data_shapes(config)
        bind_model(model, shapes["input_shape"], shapes["num_classes"])
    else:
        setup_once(model)
        model.configure_model()
        if any(isinstance(p, UninitializedParameter) for p in model.parameters()):
            shapes = _data_shapes(config)
            bind_model(model, shapes["input_shape"], shapes["num_classes"])
    model.load_state_dict(load_verified(weights, schema_of(model.state_dict())))
    return model.eval().to(map_location)
