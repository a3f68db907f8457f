"""A torchmetrics ``Metric`` called in ``training_step``: its state per client, one step at a time.

A ``Metric`` keeps one state (``tp``, ``fp``, ... added with ``add_state``) for whoever calls it.
Under ``vmap`` every client of the stacked call would write to that one state (torchmetrics then
fails, or mixes the clients), and on the loop the clients would accumulate into each other's
state, so a client's logged value would depend on which clients ran before it.

While the engine runs a step, :class:`StepMetrics` gives each client of the step its own state: on
the metric's first ``forward``/``update``/``compute`` in the step, the metric's state is set
aside and each client starts from a fresh copy of its defaults; at the step's end the metric's
own state is put back. A metric's value in a step is
therefore the value on that client's batch: Lightning's ``on_step`` value, which is what
``self.log(name, metric)`` logs. The engine averages logged values over a round's steps, as for
any logged tensor. Outside a step (evaluation, the user's own calls) the metric is torchmetrics'
own, its accumulated state untouched by training.

Under ``vmap`` the metric does not run batched (torchmetrics' code indexes with boolean masks and
calls ``bincount``, which ``vmap`` cannot batch): its inputs are taken out of the batch and the
metric's own ``update``/``compute`` run once per client on that client's rows and state, exactly as
on the loop; the values go back into the batch. They carry no gradient there: a metric is for
logging, and a loss built from a differentiable metric's value differs from the loop's, which
``vectorize: auto`` and ``always`` detect by comparing the two paths' losses.

The functional ``update``/``compute`` of the metric's class are called directly, with
torchmetrics' bookkeeping (update count, cached value) kept as its own wrappers keep it, but no
distributed sync: each client's value is its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch._C import _functorch
from torch.utils import _pytree as pytree

__all__ = ["StepMetrics"]

_BOOKKEEPING = ("_update_count", "_computed", "_forward_cache")


def _fresh(metric: nn.Module) -> dict[str, Any]:
    """A state of ``metric`` as ``reset()`` leaves it."""
    state: dict[str, Any] = {
        n: d.detach().clone() if isinstance(d, Tensor) else [] for n, d in metric._defaults.items()
    }
    return {**state, "_update_count": 0, "_computed": None, "_forward_cache": None}


def _state(metric: nn.Module) -> dict[str, Any]:
    return {n: getattr(metric, n) for n in [*metric._defaults, *_BOOKKEEPING]}


def _load(metric: nn.Module, state: dict[str, Any]) -> None:
    for name, value in state.items():
        setattr(metric, name, value)


@dataclass
class _Entry:
    metric: nn.Module
    own: dict[str, Any]  # the metric's state before the step
    clients: list[dict[str, Any]] = field(default_factory=list)  # each client's state in the step
    cache: Any = None  # the last forward value, batched like the clients


class StepMetrics:
    """The metrics a step has touched: each client's state in the step, and each metric's own."""

    def __init__(self, clients: Callable[[], tuple[int, int] | None]) -> None:
        """``clients()``: ``(vmap level, clients)`` in a stacked step, None on the loop."""
        self._clients = clients
        self._entries: dict[int, _Entry] = {}

    def restore(self) -> None:
        """Put back every touched metric's own state (the step's end)."""
        for e in self._entries.values():
            _load(e.metric, e.own)
        self._entries.clear()

    def update(self, metric: nn.Module, *args: Any, **kwargs: Any) -> None:
        """The class's ``update`` on each client's state."""
        self._run(metric, _update, args, kwargs)

    def compute(self, metric: nn.Module) -> Any:
        """The class's ``compute`` on each client's state (a one-element tensor as a 0-d one)."""
        return self._run(metric, _compute, (), {})

    def forward(self, metric: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """``update`` then ``compute``: the batch's value, kept as torchmetrics keeps it."""
        value = self._run(metric, _forward, args, kwargs)
        self._entries[id(metric)].cache = value
        metric._forward_cache = value
        return value

    def _run(self, metric: nn.Module, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        where = self._clients()
        level, c = where if where is not None else (None, 1)
        e = self._entries.get(id(metric))
        if e is None:
            e = self._entries[id(metric)] = _Entry(metric, _state(metric))
            e.clients = [_fresh(metric) for _ in range(c)]
        if level is None:
            _load(metric, e.clients[0])
            out = fn(metric, *args, **kwargs)
            e.clients[0] = _state(metric)
            return out
        rows = pytree.tree_map(lambda t: _unbatched(t, level), (args, kwargs))
        outs = []
        for i in range(c):
            a, k = pytree.tree_map(lambda t, i=i: t.rows[i] if isinstance(t, _Rows) else t, rows)
            _load(metric, e.clients[i])
            outs.append(fn(metric, *a, **k))
            e.clients[i] = _state(metric)
        metric._forward_cache = e.cache  # what self.log(name, metric) reads in this step
        return _batched(outs, level)


def _update(metric: nn.Module, *args: Any, **kwargs: Any) -> None:
    type(metric).update(metric, *args, **kwargs)
    metric._update_count += 1
    metric._computed = None


def _compute(metric: nn.Module) -> Any:
    value = type(metric).compute(metric)
    return value.reshape(()) if isinstance(value, Tensor) and value.numel() == 1 else value


def _forward(metric: nn.Module, *args: Any, **kwargs: Any) -> Any:
    _update(metric, *args, **kwargs)
    value = _compute(metric)
    metric._forward_cache = value
    return value


class _Rows:
    """A batched input taken out of the batch: one detached tensor per client."""

    def __init__(self, rows: tuple[Tensor, ...]) -> None:
        self.rows = rows


def _unbatched(t: Any, level: int) -> Any:
    if not isinstance(t, Tensor) or not _functorch.is_batchedtensor(t):
        return t
    value, bdim = _functorch._unwrap_batched(t, level)
    if bdim is None:
        return t
    return _Rows(value.detach().movedim(bdim, 0).unbind(0))


def _batched(outs: list[Any], level: int) -> Any:
    """The clients' outputs as one output batched at ``level`` (tensors stacked)."""
    leaves, spec = pytree.tree_flatten(outs[0])
    per = [pytree.tree_flatten(o)[0] for o in outs]
    stacked = [
        _functorch._add_batch_dim(torch.stack([p[j] for p in per]), 0, level) if isinstance(x, Tensor) else x
        for j, x in enumerate(leaves)
    ]
    return pytree.tree_unflatten(stacked, spec)
