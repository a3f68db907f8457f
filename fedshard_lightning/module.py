"""The model contract of fedshard_lightning: a LightningModule that the engine can train per client.

Any ``lightning.LightningModule`` with ``forward``, ``training_step`` and ``configure_optimizers``
trains federatedly (:func:`bind_model` prepares it; ``docs/architecture.md``, "Seams", says what a
step may do: ``self.log``, ``nn.Dropout``, BatchNorm, one round-based LR scheduler). Local training
calls ``setup("fit")`` and ``configure_model()`` once, then only ``training_step`` and
``configure_optimizers``: the training-loop hooks of Lightning's Trainer (``on_train_epoch_start``,
``on_after_backward``, ``backward``, ...) and manual optimization are refused before training, and
``self.current_epoch`` and ``self.global_step`` stay 0. ``configure_gradient_clipping`` is called on
each client's own gradients (``engine/grad_clip.py``).
:class:`FederatedModule` adds what makes the engine fastest and configs shortest:

* ``forward(x)`` maps a batch of inputs to logits; layers are built in ``configure_model`` once
  the data's ``input_shape`` and ``num_classes`` are known.
* ``training_step(batch, batch_idx)`` returns the scalar loss. The default averages
  :meth:`per_sample_loss`, which the engine rewrites into batched kernels (no ``vmap``).
* ``configure_optimizers()`` returns one element-wise torch optimizer (SGD, Adam, AdamW, ...),
  optionally with one LR scheduler, stepped once per communication round.

Subclass example (a new model is a class plus a config entry)::

    class TinyNet(FederatedModule):
        def __init__(self, hidden: int = 32, **kwargs):
            super().__init__(**kwargs)
            self.hidden = hidden
            self.net = None  # built in configure_model

        def configure_model(self) -> None:  # called once the data's shape is known
            if self.net is None:
                self.net = nn.Sequential(nn.Flatten(), nn.LazyLinear(self.hidden), nn.ReLU(),
                                         nn.Linear(self.hidden, self.num_classes))

        def forward(self, x):
            return self.net(x)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn

from fedshard_lightning.errors import ConfigError, ContractError
from fedshard_lightning.init_args import RecordsInitArgs

__all__ = [
    "FederatedModule",
    "bind_model",
    "check_trainable",
    "client_buffer_names",
    "param_dtype",
    "shared_step_buffers",
    "takes_batch_idx",
]

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _real(value: object) -> bool:
    """A finite int or float (not a bool): what a hyper-parameter of the optimizer may be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Hooks of Lightning's training loop that federated local training never calls: a model that
# overrides one would train without its logic and nobody would notice, so it is refused.
LOOP_HOOKS = (
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "optimizer_step",
    "on_before_zero_grad",
    "optimizer_zero_grad",
    "lr_scheduler_step",
)


class FederatedModule(RecordsInitArgs, L.LightningModule):
    """Base class of every model trained by the federated engine.

    Local training calls ``training_step`` and ``configure_optimizers`` only (see the module
    docstring); ``self.current_epoch`` and ``self.global_step`` are not advanced (they stay 0).

    Args:
        optimizer: Client optimizer of the default ``configure_optimizers``: ``sgd``, ``adam`` or ``adamw``.
        lr: Client learning rate.
        momentum: SGD momentum (ignored by Adam/AdamW).
        weight_decay: L2 penalty (decoupled for AdamW).
        num_classes: Number of output classes; ``None`` takes it from the datamodule.
        input_shape: Shape of one input sample; ``None`` takes it from the datamodule.
    """

    def __init__(
        self,
        optimizer: Literal["sgd", "adam", "adamw"] = "sgd",
        lr: float = 0.05,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        num_classes: int | None = None,
        input_shape: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if optimizer not in ("sgd", "adam", "adamw"):
            raise ConfigError(f"model.optimizer={optimizer!r}: choose sgd, adam or adamw")
        if not (_real(lr) and 0 < lr <= _FLOAT32_MAX):
            raise ConfigError(
                f"model.lr={lr!r}: the learning rate must be a positive number (at most 3.4e38)"
            )
        if not (_real(momentum) and 0 <= momentum < 1):
            raise ConfigError(f"model.momentum={momentum!r}: SGD momentum must be in [0, 1) (0.9 is common)")
        if not (_real(weight_decay) and 0 <= weight_decay <= _FLOAT32_MAX):
            raise ConfigError(f"model.weight_decay={weight_decay!r}: must be a finite number >= 0")
        self.optimizer_name = optimizer
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape) if input_shape is not None else None

    # -- shapes ----------------------------------------------------------------------------------
    def bind_data(self, input_shape: Sequence[int], num_classes: int) -> None:
        """Fill in shapes the config left open, then build the layers (``configure_model``)."""
        if self.input_shape is None:
            self.input_shape = tuple(int(s) for s in input_shape)
        elif any(int(s) < 1 for s in self.input_shape) or math.prod(self.input_shape) != math.prod(
            input_shape
        ):
            raise ConfigError(
                f"model.input_shape={list(self.input_shape)}: the data's samples have shape {list(input_shape)}; "
                "leave model.input_shape out (null) to take it from the data"
            )
        if self.num_classes is None:
            self.num_classes = int(num_classes)
        setup_once(self)
        self.configure_model()
        if not any(True for _ in self.parameters()):
            raise ContractError(f"{type(self).__name__} has no parameters after configure_model()")
        with torch.no_grad():  # materialise lazy layers with a dry run
            self.eval()
            out = self(torch.zeros(1, *self.input_shape, dtype=self.param_dtype))
            self.train()
        check_outputs(self, out, int(num_classes))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take the checkpoint's floating dtype before its tensors are copied in.

        ``load_from_checkpoint`` copies into the module's own dtype; a ``64-true`` run's float64
        weights would otherwise be rounded to float32.
        """
        tensors = (checkpoint.get("state_dict") or {}).values()
        dtype = next((v.dtype for v in tensors if isinstance(v, Tensor) and v.is_floating_point()), None)
        if dtype is not None:
            self.to(dtype)

    @property
    def param_dtype(self) -> torch.dtype:
        """Floating dtype of the parameters (float32 unless the user converted the model)."""
        return param_dtype(self)

    # -- the contract ----------------------------------------------------------------------------
    def per_sample_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Loss of every sample of the batch, shape [b] (cross entropy by default)."""
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="none")

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int = 0) -> Tensor:
        """Mean loss of the batch; pure, logs nothing (it runs under vmap)."""
        return self.per_sample_loss(batch).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The client optimizer, re-created fresh by the engine in every round."""
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(
                self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
            )
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def _eval_step(self, batch: tuple[Tensor, Tensor], prefix: str) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log(f"{prefix}_loss", loss)
        self.log(f"{prefix}_acc", (logits.argmax(-1) == y).float().mean())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Ordinary Lightning validation (outside the federated engine)."""
        return self._eval_step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Ordinary Lightning test (outside the federated engine)."""
        return self._eval_step(batch, "test")


def param_dtype(model: nn.Module) -> torch.dtype:
    """Floating dtype of a model's parameters (any LightningModule, not only FederatedModule)."""
    for p in model.parameters():
        if p.is_floating_point() and not isinstance(p, nn.parameter.UninitializedParameter):
            return p.dtype
    return torch.get_default_dtype()


def client_buffer_names(module: nn.Module) -> list[str]:
    """Buffers each client keeps its own copy of: the running statistics of BatchNorm layers.

    Other buffers (constants a model registers) are shared, unstacked, as the model holds them.
    """
    out = []
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.track_running_stats:
            out += [f"{name}.running_mean", f"{name}.running_var"]
    return out


def shared_step_buffers(module: nn.Module, exclude: Sequence[str] = ()) -> dict[str, Tensor]:
    """The buffers a stacked step shares (all but ``exclude``), BatchNorm's batch counters as copies.

    BatchNorm's forward adds one to ``num_batches_tracked`` in place. Only a cumulative average
    reads it (refused by :func:`check_trainable`), but counted on the module's own tensor it would
    follow how many stacked calls and kernel probes this process made (a resumed fit counts only
    its own, a first process also probes), so identical runs would save different bytes. The
    per-client loop trains a copy of the module and leaves the counter alone too.
    """
    counters = {
        f"{name}.num_batches_tracked" if name else "num_batches_tracked"
        for name, sub in module.named_modules()
        if isinstance(sub, nn.modules.batchnorm._BatchNorm)
    }
    return {n: b.clone() if n in counters else b for n, b in module.named_buffers() if n not in set(exclude)}


def check_trainable(model: nn.Module) -> None:
    """Refuse, in one line naming the layer and the fix, what federated training cannot replay.

    BatchNorm's running statistics are stacked per client and averaged like parameters, with
    an exponential average (``momentum``). ``momentum=None`` (a cumulative average) counts the
    batches seen in ``num_batches_tracked``, which is not stacked, so it is refused.
    """
    owner = type(model).__name__
    for name, sub in model.named_modules():
        if (
            isinstance(sub, nn.modules.batchnorm._BatchNorm)
            and sub.track_running_stats
            and sub.momentum is None
        ):
            raise ContractError(
                f"{owner}: layer {name} ({type(sub).__name__}) uses momentum=None (a cumulative average over "
                "batches), which federated training cannot stack per client; set momentum=0.1"
            )
    if not any(p.requires_grad for p in model.parameters()):
        raise ContractError(f"{owner} has no trainable parameters")


def takes_batch_idx(module: nn.Module) -> bool:
    """Whether ``training_step`` takes ``batch_idx``: Lightning 2 also accepts ``training_step(batch)``.

    The rule is Lightning's own (a parameter named ``batch_idx``, ``*args``, or two parameters).
    """
    return is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2)


def setup_once(model: L.LightningModule) -> None:
    """Call ``setup("fit")`` as Lightning's Trainer does before ``configure_model``, once per model.

    A model may build its layers there; a second call (the same object bound again) could build
    them anew with other random weights, so it is skipped.
    """
    if model.__dict__.get("_fedshard_setup_done"):
        return
    model.setup("fit")
    object.__setattr__(model, "_fedshard_setup_done", True)


def check_loop_hooks(model: L.LightningModule) -> None:
    """Refuse manual optimization and training-loop hooks, which local training would ignore."""
    owner = type(model).__name__
    if not model.automatic_optimization:
        raise ContractError(
            f"{owner} sets automatic_optimization=False (manual optimization), which federated local "
            "training does not support: it steps the optimizer of configure_optimizers itself; "
            "return the loss from training_step and leave automatic_optimization True"
        )
    bases = (L.LightningModule, FederatedModule)
    own = [h for h in LOOP_HOOKS if all(getattr(type(model), h) is not getattr(b, h) for b in bases)]
    if own:
        raise ContractError(
            f"{owner} overrides {', '.join(own)}, which federated local training never calls (it "
            "calls training_step and configure_optimizers only); move this logic into training_step"
        )


def check_outputs(model: nn.Module, out: object, num_classes: int) -> None:
    """Refuse a model with fewer outputs than the data has classes (a raw index error later)."""
    if isinstance(out, Tensor) and out.ndim >= 2 and out.shape[-1] < num_classes:
        raise ContractError(
            f"{type(model).__name__}.forward returns {out.shape[-1]} outputs per sample but the "
            f"datamodule has {num_classes} classes; make the last layer {num_classes} wide"
        )


def check_step_buffers(model: L.LightningModule, input_shape: Sequence[int], num_classes: int) -> None:
    """Refuse buffers that ``training_step`` changes, other than BatchNorm's running statistics.

    Only those are kept per client (:func:`client_buffer_names`); any other buffer is shared by all
    clients, so a step that updates it would leak one client's data into the next (loop) or fail
    to broadcast (stacked). One dry step on a zero batch finds them by their version counters; it
    leaves every buffer, the random streams and the train/eval mode as they were.
    """
    from fedshard_lightning.engine.step_context import StepContext  # the engine imports this module

    bn = {
        f"{name}.{b}" if name else b
        for name, sub in model.named_modules()
        if isinstance(sub, nn.modules.batchnorm._BatchNorm)
        for b, _ in sub.named_buffers(recurse=False)
    }
    buffers = dict(model.named_buffers())
    versions = {n: (b, b._version) for n, b in buffers.items() if n not in bn}
    if not versions:  # nothing a step could leak: no dry step at all
        return
    saved = {n: buffers[n].detach().clone() for n in bn}  # the dry step moves BN statistics
    device = next(model.parameters()).device
    x = torch.zeros(2, *input_shape, dtype=param_dtype(model), device=device)
    batch = (x, torch.arange(2, device=device) % max(int(num_classes), 1))
    ctx, was_training = StepContext.of(model), model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.train()
        ctx.begin(torch.zeros((), dtype=torch.int64, device=device))
        try:
            model.training_step(*((batch, 0) if takes_batch_idx(model) else (batch,)))
        except Exception:  # the zero batch is only a probe: real training reports its own errors
            pass
        finally:
            ctx.end()
            model.train(was_training)
    with torch.no_grad():
        for n, v in saved.items():
            buffers[n].copy_(v)
    now = dict(model.named_buffers())
    changed = [n for n, (b, v) in versions.items() if now.get(n) is not b or b._version != v]
    if changed:
        raise ContractError(
            f"{type(model).__name__}.training_step changes buffer {', '.join(changed)}, which all "
            "clients share (only BatchNorm running statistics are kept per client); keep it "
            "constant during training, e.g. compute it from the data before fit"
        )


def bind_model(model: L.LightningModule, input_shape: Sequence[int], num_classes: int) -> None:
    """Make a model ready for the engine: shapes from the data, lazy layers built, contract checked.

    Hooks the local training would ignore and manual optimization are refused first. Then, as
    Lightning's Trainer does, ``setup("fit")`` and ``configure_model()`` build the layers (the
    former once per model). A :class:`FederatedModule` takes its open shapes from the data
    (``bind_data``); a plain LightningModule gets one dry run on a zero batch, which
    materialises lazy layers and checks that ``forward`` accepts the datamodule's samples, and
    that it has an output per class. Last, one dry training step checks that it changes no shared
    buffer. Local training calls ``training_step`` and ``configure_optimizers`` only;
    ``self.current_epoch`` and ``self.global_step`` are not advanced.
    """
    check_loop_hooks(model)
    if isinstance(model, FederatedModule):
        model.bind_data(input_shape, num_classes)
        check_trainable(model)
    else:
        setup_once(model)
        model.configure_model()
        owner = type(model).__name__
        was_training = model.training
        try:
            with torch.no_grad():
                model.eval()
                out = model(torch.zeros(2, *input_shape, dtype=param_dtype(model)))
        except Exception as err:  # the user's forward may raise anything
            msg = " ".join(str(err).split())[:200]
            raise ContractError(
                f"{owner}.forward fails on a batch of shape {(2, *input_shape)} from the datamodule "
                f"({type(err).__name__}: {msg}); make forward accept it"
            ) from None
        finally:
            model.train(was_training)
        check_trainable(model)  # first: its refusals name the layer to change
        check_outputs(model, out, num_classes)
    check_step_buffers(model, input_shape, num_classes)
