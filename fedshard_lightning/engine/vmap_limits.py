"""What ``vmap`` cannot train exactly: the reasons a model falls back to the per-client loop.

Some layers and operators have no exact stacked form: ``vmap`` raises for operators without a
batching rule (``nn.GRU``, ``nn.LSTM``), data-dependent shapes (boolean masks) and branches on a
tensor's value, and it silently trains ``nn.Embedding(padding_idx=...)`` wrongly. The stacked path
turns each into :class:`~.step_context.NotVectorizable` with a one-line reason, which the engine
prints as it falls back to the loop (``vectorize: always`` and ``auto``).
"""

from __future__ import annotations

import re

from torch import nn

from fedshard_lightning.engine.step_context import NotVectorizable, RandomInStep

__all__ = ["not_vectorizable", "vmap_blocker"]


def not_vectorizable(err: RuntimeError, owner: str) -> NotVectorizable | None:
    """The one-line reason of a ``vmap`` error that says the step cannot be batched, else None."""
    text = str(err)
    step = f"{owner}.training_step"
    if "randomness" in text:
        return RandomInStep(
            "training_step draws random numbers outside nn.Dropout (e.g. F.dropout, torch.randn), "
            "which vmap cannot key per client"
        )
    if "Batching rule not implemented" in text:
        op = re.search(r"for (\S+?)\.? ", text)
        return NotVectorizable(
            f"{step} calls {op.group(1) if op else 'an operator'}, which vmap cannot batch "
            "(no batching rule; e.g. nn.GRU, nn.LSTM)"
        )
    if "dynamic shape" in text:
        return NotVectorizable(
            f"{step} indexes with a boolean mask (a data-dependent shape), which vmap cannot batch"
        )
    if "data-dependent control flow" in text or ".item()" in text:
        return NotVectorizable(f"{step} branches on a tensor's value (if, .item()), which vmap cannot batch")
    return None


def vmap_blocker(module: nn.Module) -> str | None:
    """A layer that ``vmap`` trains inexactly, as a one-line reason (None: none).

    ``vmap`` of ``nn.Embedding``'s backward applies ``padding_idx`` to the first client's table
    only, so the other clients' padding rows would be updated.
    """
    for name, sub in module.named_modules():
        if (
            isinstance(sub, (nn.Embedding, nn.EmbeddingBag))
            and sub.padding_idx is not None
            and sub.weight.requires_grad
        ):
            return (
                f"{type(module).__name__}.{name} is {type(sub).__name__}(padding_idx={sub.padding_idx}), whose "
                "padding row vmap keeps fixed for the first client only"
            )
    return None
