"""Evaluation of one model or of many stacked models, without touching the user's module state."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["evaluate", "predict_logits"]


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
def evaluate(module: nn.Module, params: dict[str, Tensor], x: Tensor, y: Tensor) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of one model."""
    logits = predict_logits(module, params, x)
    loss = torch.nn.functional.cross_entropy(logits.double(), y).item()
    return (logits.argmax(-1) == y).double().mean().item(), loss
