"""Element-wise operators whose CPU rounding depends on position, applied to each client's own chunk.

ATen runs an element-wise operator over a contiguous tensor in vector blocks of ``2 * Vec::size()``
elements and its last few elements in a scalar loop, and for ``sigmoid``, ``silu``, ``elu``,
``selu``, ``celu``, ``gelu``, ``mish`` and ``softplus`` (forward or backward; which ones depends on the dtype and the
values) the two loops round differently. Where the split falls depends only on the element count
(and, beyond ATen's grain of 32768 elements, the thread count), not on memory alignment. Over the
merged ``[clients * batch, ...]`` tensor of a stacked call, which of a client's elements fall in
the scalar tail depends on its row and on how many clients share the call, so a client's float32
bits changed with its neighbours and exact unlearning's audit failed (digits MLP with
``nn.Sigmoid``: 1.5e-7). :class:`PerClient` applies such an operator to each client's chunk as a
tensor of its own, so forward and autograd's backward see the element counts the client has
alone, whoever shares the call.
``tests/engine/test_per_client_ops.py`` compares with a client trained alone from scratch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

__all__ = ["ClientChunks", "PerClient", "per_client_op"]

# Operators of the fx rewrite's per-sample lists that rounded differently in the vector body and
# the scalar tail on an AVX512 CPU (torch 2.13, float32 or float64); relu, relu6, leaky_relu,
# hardtanh, tanh, exp and the arithmetic operators never did and keep one call over all clients.
_MODULES: tuple[type[nn.Module], ...] = (
    nn.Sigmoid,
    nn.SiLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.Softplus,
    nn.Mish,
)
_FUNCTIONS: frozenset[Any] = frozenset(
    {torch.sigmoid, F.sigmoid, F.silu, F.elu, F.selu, F.celu, F.gelu, F.softplus, F.mish}
)
_METHODS: dict[str, Callable[..., Tensor]] = {"sigmoid": torch.sigmoid}


@dataclass
class ClientChunks:
    """How many clients the merged batch of the current call holds (set by the program per call).

    A padded partial batch stays in its client's chunk: the chunk's size is then the same in
    every call, alone or among others.
    """

    clients: int = 1


class PerClient(nn.Module):
    """``fn(h, *args, **kwargs)`` computed on each client's chunk of ``h`` separately (same values).

    Args:
        fn: The operator (the user's activation module, or a function).
        args: Constant positional arguments after the tensor.
        kwargs: Constant keyword arguments.
        chunks: The program's per-call split, shared by its operators.
    """

    def __init__(
        self, fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any], chunks: ClientChunks
    ) -> None:
        super().__init__()
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.chunks = chunks
        self.name = type(fn).__name__ if isinstance(fn, nn.Module) else getattr(fn, "__name__", str(fn))

    def forward(self, h: Tensor) -> Tensor:
        """``fn`` of ``h`` [clients * batch, ...], one call per client chunk (one in all for one client)."""
        if self.chunks.clients == 1 or h.device.type != "cpu":  # CUDA: as before (not measured there)
            return self.fn(h, *self.args, **self.kwargs)
        parts = h.reshape(-1).chunk(self.chunks.clients)
        return torch.cat([self.fn(p, *self.args, **self.kwargs) for p in parts]).view(h.shape)


def per_client_op(node: fx.Node, root: nn.Module, chunks: ClientChunks) -> PerClient | None:
    """The per-client form of ``node`` if its operator rounds by position, else None (kept as is).

    An in-place form, or one whose further arguments are tensors, is kept as is (the engine's
    neighbour probe, :mod:`.neighbours`, still decides whether it stays stacked).
    """
    if node.op == "call_module":
        sub = root.get_submodule(node.target)
        if not isinstance(sub, _MODULES) or getattr(sub, "inplace", False):
            return None
        return PerClient(sub, (), {}, chunks)
    args, kwargs = tuple(node.args[1:]), dict(node.kwargs)
    if any(isinstance(a, fx.Node) for a in (*args, *kwargs.values())):
        return None
    if node.op == "call_function" and node.target in _FUNCTIONS and not _inplace(node.target, args, kwargs):
        return PerClient(node.target, args, kwargs, chunks)
    if node.op == "call_method" and node.target in _METHODS and len(node.args) == 1 and not node.kwargs:
        return PerClient(_METHODS[node.target], (), {}, chunks)
    return None


def _inplace(fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call asks for the in-place form (``F.elu(h, 1.0, True)``, ``inplace=True``)."""
    try:
        bound = inspect.signature(fn).bind(None, *args, **kwargs)
    except (TypeError, ValueError):  # a builtin without a signature has no in-place flag
        return False
    return bool(bound.arguments.get("inplace", False))
