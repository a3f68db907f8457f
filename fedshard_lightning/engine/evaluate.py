"""Evaluation of one model or of many stacked models, without touching the user's module state."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["Evaluator", "evaluate", "predict_logits"]


@torch.no_grad()
def predict_logits(module: nn.Module, params: dict[str, Tensor], x: Tensor, batch_size: int = 2048) -> Tensor:
    """Logits of ``module`` with ``params`` on ``x``, in batches.

    Eval mode: BatchNorm uses the running statistics in ``params`` (the aggregated ones).
    """
    buffers = {k: v for k, v in module.named_buffers() if k not in params}
    was_training = module.training
    module.eval()
    try:
        return torch.cat(
            [
                functional_call(module, (params, buffers), (x[i : i + batch_size],))
                for i in range(0, len(x), batch_size)
            ]
        )
    finally:
        module.train(was_training)


@torch.no_grad()
def _metrics(logits: Tensor, y: Tensor) -> tuple[float, float]:
    """Accuracy and mean cross-entropy (float64), read back to the host in one copy."""
    loss = torch.nn.functional.cross_entropy(logits.double(), y)
    acc = (logits.argmax(-1) == y).double().mean()
    acc_f, loss_f = torch.stack([acc, loss]).tolist()
    return acc_f, loss_f


@torch.no_grad()
def evaluate(module: nn.Module, params: dict[str, Tensor], x: Tensor, y: Tensor) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of one model."""
    return _metrics(predict_logits(module, params, x), y)


class Evaluator:
    """:func:`evaluate` for a model evaluated again and again (every round of a fit).

    It keeps a private copy of the module in eval mode and copies the parameters into it, so an
    evaluation is a plain forward: no ``functional_call`` re-binding and no train/eval switching
    of the user's module, which cost more than the forward itself for small models. The copy runs
    the same operators on the same values as :func:`evaluate`, so the metrics are the same bits.
    Tensors that ``params`` does not hold (frozen weights, buffers such as ``num_batches_tracked``)
    are read from the user's module at each call, as :func:`predict_logits` does. A module that
    cannot be deep-copied (it holds a lock, a file or a process handle) is evaluated by
    :func:`evaluate` instead.

    Args:
        module: The user's module (never modified).
        batch_size: Samples per forward.
    """

    def __init__(self, module: nn.Module, batch_size: int = 2048) -> None:
        self.module = module
        self.batch_size = batch_size
        self._copy: nn.Module | None = None
        self._copyable = True
        self._own: dict[str, Tensor] = {}
        self._live: dict[str, Tensor] = {}
        self._targets: tuple[tuple[str, ...], list[Tensor], list[Tensor]] | None = None

    def prepare(self) -> None:
        """Make the module's eval-mode copy now (else on the first call); a no-op once made or refused."""
        if self._copy is not None or not self._copyable:
            return
        try:
            self._copy = copy.deepcopy(self.module).eval()
        except (TypeError, copy.Error, RuntimeError, AttributeError):  # "cannot pickle '_thread.lock'"
            self._copyable = False
            return
        self._own = {**dict(self._copy.named_parameters()), **dict(self._copy.named_buffers())}
        self._live = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}

    @torch.no_grad()
    def __call__(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> tuple[float, float]:
        """Accuracy and mean cross-entropy of the model with ``params``."""
        if self._copy is None:
            self.prepare()
        if not self._copyable:
            return evaluate(self.module, params, x, y)
        keys = tuple(params)
        if self._targets is None or self._targets[0] != keys:  # the same names every round
            rest = [k for k in self._own if k not in params]
            self._targets = (keys, [self._own[k] for k in (*keys, *rest)], [self._live[k] for k in rest])
        torch._foreach_copy_(self._targets[1], [params[k] for k in keys] + self._targets[2])
        step = self.batch_size
        if len(x) <= step:  # one forward: no slicing, no concatenation (a copy of the same logits)
            return _metrics(self._copy(x), y)
        logits = torch.cat([self._copy(x[i : i + step]) for i in range(0, len(x), step)])
        return _metrics(logits, y)
