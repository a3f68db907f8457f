"""Evaluation of one model or of many stacked models, without touching the user's module state."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

__all__ = ["evaluate", "evaluate_stacked", "predict_logits"]


@torch.no_grad()
def predict_logits(module: nn.Module, params: dict[str, Tensor], x: Tensor, batch_size: int = 2048) -> Tensor:
    """Logits of ``module`` with ``params`` on ``x``, in batches."""
    buffers = dict(module.named_buffers())
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
def evaluate(module: nn.Module, params: dict[str, Tensor], x: Tensor, y: Tensor) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of one model."""
    logits = predict_logits(module, params, x)
    loss = torch.nn.functional.cross_entropy(logits.double(), y).item()
    return (logits.argmax(-1) == y).double().mean().item(), loss


@torch.no_grad()
def evaluate_stacked(
    module: nn.Module, params: dict[str, Tensor], x: Tensor, y: Tensor, batch_size: int = 1024
) -> tuple[Tensor, Tensor]:
    """Accuracy [G] and mean loss [G] of G stacked models on the same data."""
    buffers = dict(module.named_buffers())
    fn = vmap(lambda p, xb: functional_call(module, (p, buffers), (xb,)), in_dims=(0, None))
    correct = 0
    loss = 0
    module.eval()
    try:
        for i in range(0, len(x), batch_size):
            logits = fn(params, x[i : i + batch_size])
            yb = y[i : i + batch_size]
            correct = correct + (logits.argmax(-1) == yb).double().sum(-1)
            flat = torch.nn.functional.cross_entropy(
                logits.double().flatten(0, 1), yb.repeat(logits.shape[0]), reduction="none"
            )
            loss = loss + flat.view(logits.shape[0], -1).sum(-1)
    finally:
        module.train()
    return correct / len(x), loss / len(x)
