"""The hand-written chain's step for dense chains (Linear and activations), with less Python per step.

A small model's stacked step is dispatch-bound: on the digits MLP one step of one or two clients
(the lower stages of an unlearning request) is about a hundred microseconds, most of it Python
and operator dispatch around a few dozen tiny kernels. For chains of Linear, ReLU, Tanh and
Identity layers (after any flattening of the input), :class:`DenseChain` runs the same operators
as :meth:`.chain.StackedChain.step` on the same values, so the results are the same bits
(``tests/engine/test_chain_dense.py``), but

* keeps the activations as ``[clients, batch, features]``, so no reshape is issued per layer;
* makes the weights' transposes and the biases' broadcast views once per set of parameter
  tensors (they are views: the in-place SGD updates show through them), not once per step;
* reuses the constant ``-1`` of the cross-entropy gradient instead of allocating it per step.

The saving is per step, not per client, so it matters most for the one- and two-client steps of
an unlearning request's lower stages; ``benchmarks/overhead_profile.py --what rounds`` measures
a round's fixed and per-client parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["DenseChain"]

_aten = torch.ops.aten
_ACTIVATIONS = ("relu", "tanh", "identity")


class DenseChain:
    """Forward and backward of ``flatten* -> (linear | activation)* -> cross entropy``.

    Args:
        flatten: The leading reshape links (applied to the merged ``[clients * batch, ...]`` input).
        links: ``("linear", (weight, bias))`` or ``(activation, ())`` in order, input to logits.
    """

    def __init__(
        self, flatten: Sequence[Callable[[Tensor], Tensor]], links: Sequence[tuple[str, tuple[str, ...]]]
    ) -> None:
        self.flatten = list(flatten)
        self.links = list(links)
        self.first = min(i for i, (kind, _) in enumerate(self.links) if kind == "linear")
        self._views: tuple[tuple[Tensor, ...], list[tuple[Tensor, Tensor] | None]] | None = None
        self._minus_one: Tensor | None = None
        self._flat_inputs: set[int] = set()  # widths of flat samples the leading reshapes leave as they are

    @classmethod
    def of(cls, ops: Sequence[object]) -> DenseChain | None:
        """The dense form of a chain's links (``_Op`` objects), or None if it has other links."""
        kinds = [getattr(op, "kind", None) for op in ops]
        lead = 0
        while lead < len(kinds) and kinds[lead] == "reshape":
            lead += 1
        body = ops[lead:-1]
        if kinds[-1] != "xent" or not body or any(k not in ("linear", *_ACTIVATIONS) for k in kinds[lead:-1]):
            return None
        if "linear" not in kinds[lead:-1]:
            return None
        return cls([op.fn for op in ops[:lead]], [(op.kind, tuple(op.params)) for op in body])  # type: ignore[attr-defined]

    def _layer_views(self, params: dict[str, Tensor]) -> list[tuple[Tensor, Tensor] | None]:
        """``(W^T, bias[:, None])`` per linear link, made again only when the tensors change."""
        tensors = tuple(params[n] for kind, names in self.links if kind == "linear" for n in names)
        if self._views is not None and all(a is b for a, b in zip(self._views[0], tensors)):
            return self._views[1]
        views: list[tuple[Tensor, Tensor] | None] = [
            (params[names[0]].transpose(1, 2), params[names[1]].unsqueeze(1)) if kind == "linear" else None
            for kind, names in self.links
        ]
        self._views = (tensors, views)
        return views

    def _minus_ones(self, n: int, like: Tensor) -> Tensor:
        t = self._minus_one
        if t is None or t.shape[0] < n or t.dtype != like.dtype or t.device != like.device:
            t = self._minus_one = torch.full((n, 1), -1, dtype=like.dtype, device=like.device)
        return t[:n]

    def step(
        self, params: dict[str, Tensor], x: Tensor, y: Tensor, weight: Tensor, lr: dict[str, float] | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """:meth:`.chain.StackedChain.step` (same arguments, same results, same bits)."""
        c, b = y.shape
        if x.ndim == 3 and x.shape[2] in self._flat_inputs and x.is_contiguous():
            h = x  # the leading reshapes leave a flat sample as it is (seen once for this width)
        else:
            h = x.reshape(c * b, *x.shape[2:])
            for fn in self.flatten:
                h = fn(h)
            if x.ndim == 3 and h.shape[1:] == x.shape[2:]:
                self._flat_inputs.add(x.shape[2])
            h = h.reshape(c, b, -1)
        if torch.is_grad_enabled():  # the caller's no_grad (the engine's lean rounds) spares the context
            with torch.no_grad():
                return self._run(params, h, y, weight, lr)
        return self._run(params, h, y, weight, lr)

    def _run(
        self, params: dict[str, Tensor], h: Tensor, y: Tensor, weight: Tensor, lr: dict[str, float] | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The step on flattened inputs ``h`` [c, b, features], gradients off."""
        c, b = y.shape
        views = self._layer_views(params)
        saved: list[Tensor] = []
        for (kind, _), view in zip(self.links, views):
            saved.append(h)  # a linear link keeps its input, an activation its output
            if view is not None:
                h = torch.baddbmm(view[1], h, view[0])
            elif kind == "relu":
                h = saved[-1] = h.relu()
            elif kind == "tanh":
                h = saved[-1] = h.tanh()
        logp = torch.log_softmax(h.view(c * b, -1), 1)
        yf = y.reshape(-1, 1)
        per = -logp.gather(1, yf).view(c, b)
        losses = (per * weight).sum(1)
        g = logp.exp_()
        g.scatter_add_(1, yf, self._minus_ones(c * b, g))
        g.mul_(weight.reshape(-1, 1))
        g = g.view(c, b, -1)
        grads: dict[str, Tensor] = {}
        for i in range(len(self.links) - 1, self.first - 1, -1):
            kind, names = self.links[i]
            if kind == "linear":
                w, bias = params[names[0]], params[names[1]]
                h_in = saved[i]
                g_in = torch.bmm(g, w) if i > self.first else None
                gb = g.sum(1)
                if lr is None:
                    grads[names[0]] = torch.bmm(g.transpose(1, 2), h_in)
                    grads[names[1]] = gb
                else:
                    torch.baddbmm(w, g.transpose(1, 2), h_in, alpha=-lr[names[0]], out=w)
                    bias.add_(gb, alpha=-lr[names[1]])
                g = g_in
            elif kind == "relu":
                g = _aten.threshold_backward(g, saved[i], 0)
            elif kind == "tanh":
                g = _aten.tanh_backward(g, saved[i])
        return losses, grads
