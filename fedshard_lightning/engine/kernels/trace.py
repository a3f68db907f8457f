"""``torch.fx`` tracing of a loss that records per-sample functions without ``__torch_function__``.

fx records a call such as ``F.cross_entropy(proxy, y)`` through ``Proxy.__torch_function__``,
which asks ``torch.overrides.is_tensor_method_or_property``; the first such question in a process
builds torch's table of every overridable function, which takes longer than the rest of the
trace. Every default ``per_sample_loss`` ends in a cross entropy, so every first fit of a process
would pay it. :func:`trace` patches the functions the
stacked rewrite knows, for the length of the trace only (as fx patches ``nn.Module.__call__``),
so that a call with a proxy argument becomes the same ``call_function`` node directly. Functions
outside the list, and names imported before the trace (``from torch.nn.functional import relu``),
still go through ``__torch_function__``: the same graph, at the old cost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["trace"]


def _owners(functions: Iterable[Any]) -> list[tuple[Any, str, Callable[..., Any]]]:
    """``(namespace, name, function)`` of every function that ``F`` or ``torch`` exposes by name."""
    out = []
    for fn in functions:
        name = getattr(fn, "__name__", None)
        for space in (F, torch):
            if name is not None and getattr(space, name, None) is fn:
                out.append((space, name, fn))
    return out


def _has_proxy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    found = False

    def look(a: Any) -> Any:
        nonlocal found
        found = found or isinstance(a, fx.Proxy)
        return a

    fx.node.map_aggregate((args, kwargs), look)
    return found


class _Tracer(fx.Tracer):
    def __init__(self, functions: Iterable[Any]) -> None:
        super().__init__()
        self._patch = _owners(functions)

    def _direct(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if _has_proxy(args, kwargs):
                return self.create_proxy("call_function", fn, args, kwargs)
            return fn(*args, **kwargs)

        return call

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        for space, name, fn in self._patch:
            setattr(space, name, self._direct(fn))
        try:
            return super().trace(root, concrete_args)
        finally:
            for space, name, fn in self._patch:
                setattr(space, name, fn)


def trace(root: nn.Module, functions: Iterable[Any]) -> fx.Graph:
    """The graph of ``fx.symbolic_trace(root)``, recording ``functions`` (of ``F`` or ``torch``) directly.

    Only the graph: the caller rewrites it into its own ``GraphModule`` (each costs a code
    generation, about 0.6 ms).
    """
    return _Tracer(functions).trace(root)
