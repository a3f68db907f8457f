"""What ``vmap`` cannot train exactly: the reasons a model falls back to the per-client loop.

Some layers and operators have no exact stacked form: ``vmap`` raises for operators without a
batching rule (``nn.GRU``, ``nn.LSTM``), data-dependent shapes (boolean masks) and branches on a
tensor's value, and it silently trains ``nn.Embedding(padding_idx=...)`` wrongly. The stacked path
turns each into :class:`~.step_context.NotVectorizable` with a one-line reason, which the engine
prints as it falls back to the loop (``vectorize: always`` and ``auto``). The reason names the
user's own line that called the operator (the deepest frame of the error outside torch,
Lightning, torchmetrics and this package), not the library code that raised.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from pathlib import Path
from types import TracebackType

import lightning
import torch
from torch import nn

from fedshard_lightning.engine.step_context import NotVectorizable, RandomInStep

__all__ = ["not_vectorizable", "user_line", "vmap_blocker"]


def _library_roots() -> tuple[str, ...]:
    roots = [Path(m.__file__).parent for m in (torch, lightning)]
    roots.append(Path(__file__).resolve().parents[1])  # this package
    tm = sys.modules.get("torchmetrics")
    if tm is not None and tm.__file__:
        roots.append(Path(tm.__file__).parent)
    return tuple(str(r) + os.sep for r in roots)


def _is_library(filename: str) -> bool:
    """torch, Lightning, torchmetrics, this package, or the standard library (not its site-packages)."""
    path = os.path.abspath(filename)
    stdlib = str(Path(os.__file__).parent) + os.sep
    if path.startswith(stdlib) and "site-packages" not in path and "dist-packages" not in path:
        return True
    return path.startswith(_library_roots()) or filename.startswith("<")


def user_line(tb: TracebackType | None) -> str | None:
    """``Class.method at file.py:LINE: code`` of the deepest frame in the user's own code, else None."""
    found = None
    while tb is not None:
        if not _is_library(tb.tb_frame.f_code.co_filename):
            found = tb
        tb = tb.tb_next
    if found is None:
        return None
    code = found.tb_frame.f_code
    line = traceback.extract_tb(found, limit=1)[0]
    text = (line.line or "").strip()
    where = f"{getattr(code, 'co_qualname', code.co_name)} at {Path(code.co_filename).name}:{found.tb_lineno}"
    return f"{where}: {text}" if text else where


def not_vectorizable(err: RuntimeError, owner: str) -> NotVectorizable | None:
    """The one-line reason of a ``vmap`` error that says the step cannot be batched, else None."""
    text = str(err)
    line = user_line(err.__traceback__)
    step = f"{owner}.training_step" if line is None else f"{owner}.training_step ({line})"
    if "randomness" in text:
        what = "(e.g. F.dropout, torch.randn)" if line is None else f"({line})"
        return RandomInStep(
            f"{owner}.training_step draws random numbers outside nn.Dropout {what}, "
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
