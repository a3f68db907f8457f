"""What a user's ``training_step`` may do beyond computing a loss: log values and draw random numbers.

A Lightning user writes ``self.log("train_loss", loss)`` and puts ``nn.Dropout`` in the model.
Under ``vmap`` both fail (``self.log`` sees batched tensors, dropout draws from one global
generator whose values depend on how many clients share the call). :class:`StepContext` makes
both functions of the client's own key while the engine runs a step:

* ``self.log``/``self.log_dict`` store the value in the context; the step caller returns it with
  the loss, so every client gets its own logged values (reduced per round by the engine).
* ``nn.Dropout`` layers draw their mask from a counter-based hash of the client's step key
  (``(seed, stage, shard, round, client, step)``, see :func:`step_keys`), the layer call and the
  element index: the same integers in the stacked call and in the per-client loop, so both paths
  give the same bits whatever a client's neighbours are.

``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer``/``DecoderLayer``) runs as plain
matmuls in a step, its dropout on the attention weights keyed the same way (:mod:`.attention`).
A torchmetrics ``Metric`` called in the step gets the step's own state, one per client
(:mod:`.metric_state`); ``self.log(name, metric)`` logs its value on the client's batch.

Random operators other than these (``F.dropout`` called directly, ``torch.randn`` in the step)
cannot be keyed inside ``vmap``; such a model trains on the per-client loop, which seeds torch's
generator with the client's step key before every step, and the reason names the user's line
(:mod:`.vmap_limits`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._C import _functorch

from fedshard_lightning.engine.attention import attention_forward, unsupported_attention
from fedshard_lightning.engine.keys import keyed_uniform_bits
from fedshard_lightning.engine.metric_state import StepMetrics
from fedshard_lightning.errors import ContractError

__all__ = [
    "NotVectorizable",
    "RandomInStep",
    "StepContext",
    "keyed_uniform",
    "step_keys",
    "step_loss",
]

_M32 = 0xFFFFFFFF
_STEP_COUNTER = 1 << 40  # step keys use counters far above the schedule's shuffling draws


def step_keys(
    seed: int, stage: int, groups: np.ndarray, round_: int, clients: np.ndarray, steps: int
) -> np.ndarray:
    """32-bit key of every client's every local step, [m, steps] int64 (a hash of the full key)."""
    bits = keyed_uniform_bits(
        seed,
        stage,
        np.asarray(groups, dtype=np.int64)[:, None],
        round_,
        np.asarray(clients, dtype=np.int64)[:, None],
        _STEP_COUNTER + np.arange(steps, dtype=np.int64)[None, :],
    )
    return (bits & np.uint64(_M32)).astype(np.int64)


def step_loss(out: Any, owner: str) -> Tensor:
    """The loss of what ``training_step`` returned (a tensor, or Lightning's ``{"loss": ...}``)."""
    if isinstance(out, dict):
        out = out.get("loss")
    if not isinstance(out, Tensor) or out.numel() != 1:
        raise ContractError(
            f"{owner}.training_step must return the scalar loss (or {{'loss': loss}}), got {type(out).__name__}"
        )
    return out.reshape(())


class NotVectorizable(Exception):
    """The training step cannot run stacked exactly; its message is the one-line reason.

    The engine then trains on the per-client loop (``vectorize: always`` and ``auto``), and says
    why with :attr:`fallback` appended.
    """

    fallback = "the per-client loop trains it"


class RandomInStep(NotVectorizable):
    """The training step draws random numbers that cannot be keyed per client under ``vmap``."""

    fallback = "the loop seeds each client step by its key"


def _metric_type() -> type | None:
    """The class ``torchmetrics.Metric`` if torchmetrics is imported (a model holding one imported it)."""
    tm = sys.modules.get("torchmetrics")
    return getattr(tm, "Metric", None)


def _mix32(h: Tensor) -> Tensor:
    """A 32-bit integer hash in int64 arithmetic (products stay below 2**63, so no overflow)."""
    h = h & _M32
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x346CA68B) & _M32
    return h ^ (h >> 16)


def keyed_uniform(key: Tensor, call: int, numel: int, dtype: torch.dtype) -> Tensor:
    """``numel`` uniforms in [0, 1) from the key and the call number; works under ``vmap``."""
    idx = torch.arange(numel, device=key.device, dtype=torch.int64)
    h = _mix32(_mix32(key ^ _mix32(torch.tensor(call + 1, device=key.device))) ^ idx)
    return (h >> 8).to(dtype) * (2.0**-24)


def _class_method(owner: nn.Module, name: str) -> Callable[..., Any]:
    """``owner``'s method as its class defines it (what a copied or unpickled override becomes)."""
    return getattr(type(owner), name).__get__(owner, type(owner))


class _Override:
    """A method that :class:`StepContext` installs on one module instance.

    It routes the call through the context; a deep copy or a pickle of the module holds the
    class's own method instead. A closure would keep pointing at the original module and its
    context: the copy's ``nn.Dropout`` would follow the original's ``training`` flag (the
    evaluator's eval-mode copy dropped units) and ``torch.save(model)`` could not pickle it.
    """

    def __init__(self, owner: nn.Module, name: str, fn: Callable[..., Any]) -> None:
        self.owner, self.name, self.fn = owner, name, fn

    @staticmethod
    def original(owner: nn.Module, name: str) -> Callable[..., Any]:
        """``owner.<name>`` as it was before any override (an instance's own wrapper kept)."""
        own = owner.__dict__.get(name)
        while isinstance(own, _Override):
            own = own.__dict__.get("before")
        return own if own is not None else getattr(type(owner), name).__get__(owner, type(owner))

    @classmethod
    def install(cls, owner: nn.Module, name: str, fn: Callable[..., Any]) -> None:
        """Set ``owner.<name>`` to ``fn`` on this instance only."""
        override = cls(owner, name, fn)
        override.before = cls.original(owner, name)
        object.__setattr__(owner, name, override)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return _class_method, (self.owner, self.name)


class StepContext:
    """The key and the logged values of the step being run (see the module docstring)."""

    def __init__(self) -> None:
        self.key: Tensor | None = None
        self.calls = 0
        self.logged: dict[str, Tensor] | None = None
        self.stacked = False  # the step runs under vmap (all clients in one call)
        self.metrics = StepMetrics(self._vmapped)
        self._owner = 0

    @classmethod
    def of(cls, module: nn.Module) -> StepContext:
        """The module's context, installed once: every engine over one module shares it.

        A deep copy of the module (the loop's worker) carries the copied context but closures over
        the original, so a copy gets a fresh context (the owner id tells them apart).
        """
        ctx = module.__dict__.get("_fedshard_step_ctx")
        if not isinstance(ctx, cls) or ctx._owner != id(module):
            ctx = cls()
            ctx.install(module)
            ctx._owner = id(module)
            object.__setattr__(module, "_fedshard_step_ctx", ctx)
        return ctx

    def begin(self, key: Tensor | None, stacked: bool = False) -> None:
        """Start a training step with this client key (0-d, batched under vmap) and no logs yet."""
        self.key, self.calls, self.logged, self.stacked = key, 0, {}, stacked

    def end(self) -> dict[str, Tensor]:
        """End the step; the values it logged."""
        logged = self.logged or {}
        self.metrics.restore()
        self.key, self.logged, self.stacked = None, None, False
        return logged

    def in_step(self) -> bool:
        """A training step is running (the engine's, stacked or on the loop)."""
        return self.logged is not None

    def _vmapped(self) -> tuple[int, int] | None:
        """``(vmap level, clients)`` of a stacked step (read from its batched key), None on the loop."""
        if not self.stacked or self.key is None:
            return None
        level = _functorch.maybe_current_level()
        if level is None or not _functorch.is_batchedtensor(self.key):
            return None
        rows, bdim = _functorch._unwrap_batched(self.key, level)
        return (level, rows.shape[bdim]) if bdim is not None else None

    def dropout(self, x: Tensor, p: float) -> Tensor:
        """Dropout of ``x`` with the mask drawn from the step key and the call number."""
        call, self.calls = self.calls, self.calls + 1
        if p >= 1:
            return x * 0
        keep = keyed_uniform(self.key, call, x.numel(), x.dtype) >= p
        return x * keep.reshape(x.shape).to(x.dtype) / (1 - p)

    def install(self, module: nn.Module) -> None:
        """Route ``module``'s ``log``/``log_dict`` and its ``nn.Dropout`` layers through this context.

        Outside a step (``begin`` not called) everything behaves as Lightning and torch do.
        """
        _Override.install(module, "log", self._log_of(module))
        _Override.install(module, "log_dict", self._log_dict_of(module))
        metric = _metric_type()
        owner = type(module).__name__
        for name, sub in module.named_modules():
            if type(sub) is nn.Dropout:
                _Override.install(sub, "forward", self._dropout_of(sub))
            elif isinstance(sub, nn.MultiheadAttention):
                _Override.install(sub, "forward", self._attention_of(sub, f"{owner}.{name}"))
            elif metric is not None and isinstance(sub, metric):
                for what in ("forward", "update", "compute"):  # update/compute: torchmetrics' wrappers
                    _Override.install(sub, what, self._metric_of(sub, what, _Override.original(sub, what)))

    def _log_of(self, module: nn.Module) -> Callable[..., None]:
        original = type(module).log

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if self.logged is None:
                original(module, name, value, *args, **kwargs)
                return
            self.logged[name] = self._scalar(name, value, module)

        return log

    def _log_dict_of(self, module: nn.Module) -> Callable[..., None]:
        original = type(module).log_dict

        def log_dict(dictionary: Any, *args: Any, **kwargs: Any) -> None:
            if self.logged is None:
                original(module, dictionary, *args, **kwargs)
                return
            for name, value in dict(dictionary).items():
                self.logged[name] = self._scalar(name, value, module)

        return log_dict

    def _metric_of(self, metric: nn.Module, what: str, own: Callable[..., Any]) -> Callable[..., Any]:
        """``metric.<what>`` on the step's own state in a step (:mod:`.metric_state`), else ``own``."""
        step = getattr(self.metrics, what)

        def routed(*args: Any, **kwargs: Any) -> Any:
            if not self.in_step():
                return own(*args, **kwargs)
            return step(metric, *args, **kwargs)

        return routed

    def _attention_of(self, layer: nn.MultiheadAttention, where: str) -> Callable[..., Any]:
        """``layer``'s forward: matmuls with keyed dropout in a step (:mod:`.attention`)."""

        def refuse() -> None:
            if self.stacked and layer.training and layer.dropout > 0:
                raise RandomInStep(
                    f"{where} is nn.MultiheadAttention({unsupported_attention(layer)}, dropout={layer.dropout}), "
                    "whose attention dropout vmap cannot key per client"
                )

        return attention_forward(layer, self.in_step, self.dropout, refuse)

    def _scalar(self, name: str, value: Any, module: nn.Module) -> Tensor:
        dtype = next(module.parameters()).dtype
        metric = _metric_type()
        if metric is not None and isinstance(value, metric):
            # Lightning's on_step value: the batch's own (forward), else the step's compute()
            cached = getattr(value, "_forward_cache", None)
            value = cached if isinstance(cached, Tensor) else value.compute()
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ContractError(
                    f"{type(module).__name__}.training_step logs {name!r} with shape {tuple(value.shape)}; "
                    "log one number per step (e.g. value.mean())"
                )
            return value.detach().reshape(()).to(dtype)
        return torch.tensor(float(value), dtype=dtype)

    def _dropout_of(self, layer: nn.Dropout) -> Callable[[Tensor], Tensor]:
        def forward(x: Tensor) -> Tensor:
            if self.key is None or not layer.training or layer.p == 0:
                return F.dropout(x, layer.p, layer.training, layer.inplace)
            return self.dropout(x, layer.p)

        return forward
