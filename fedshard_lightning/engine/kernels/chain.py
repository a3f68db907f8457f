"""Hand-written backward for stacked layer chains, with the plain-SGD update fused into it.

For a model whose stacked program (:mod:`fedshard_lightning.engine.kernels.fx`) is a simple chain
(input -> layer -> ... -> cross-entropy), the gradients of all clients are computed by explicit
backward formulas instead of autograd, and plain SGD applies each weight's update inside the
matrix product that computes its gradient (``W <- W - lr * g^T h`` as one ``baddbmm``), so no
gradient tensor is ever written. A small model's stacked step is bound by the number of kernels
and the memory they touch, not by arithmetic, so skipping autograd's graph and the gradient
tensors is most of what makes small MLPs fast (the "fx+chain" kernel of docs/benchmarks.md's
engine-vs-loop table). The result equals autograd on the user's loss up to floating-point
rounding, which the engine checks before using it (:mod:`.check`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from fedshard_lightning.engine.kernels.base import Probe, StackedKernel
from fedshard_lightning.engine.kernels.chain_dense import DenseChain
from fedshard_lightning.engine.kernels.check import Reference, Unsupported, require_close
from fedshard_lightning.engine.kernels.fx import FX, StackedProgram, stacked_conv2d, stacked_linear
from fedshard_lightning.engine.kernels.per_client_ops import PerClient

__all__ = ["CHAIN", "ChainKernel", "StackedChain"]

_aten = torch.ops.aten


@dataclass
class _Op:
    """One link of the chain: its kind, parameter names and static arguments."""

    kind: str
    params: tuple[str, ...] = ()
    args: tuple[Any, ...] = ()
    fn: Callable[..., Tensor] | None = None


def _same_padding(conv_padding: Any, kernel: tuple[int, ...], dilation: tuple[int, ...]) -> tuple[int, ...]:
    if conv_padding == "valid":
        return (0,) * len(kernel)
    if conv_padding == "same":
        if any(d * (k - 1) % 2 for k, d in zip(kernel, dilation)):
            raise Unsupported("asymmetric 'same' padding has no hand-written backward")
        return tuple(d * (k - 1) // 2 for k, d in zip(kernel, dilation))
    return tuple(conv_padding)


class StackedChain:
    """Forward and backward of a stacked layer chain by explicit formulas.

    Args:
        ops: The links, input to logits; the loss is the cross entropy of the last output.
        conv_mode: How stacked convolutions run (see :func:`stacked_conv2d`).
    """

    def __init__(self, ops: list[_Op], conv_mode: str) -> None:
        self.ops = ops
        self.conv_mode = conv_mode
        self.dense = DenseChain.of(ops)  # the same step with less Python, for Linear chains

    @classmethod
    def from_program(cls, prog: StackedProgram, conv_mode: str = "grouped") -> StackedChain:
        """Read the chain off the program's graph; raise :class:`Unsupported` if it is not one."""
        gm = prog.gm
        nodes = list(gm.graph.nodes)
        ph = [n for n in nodes if n.op == "placeholder"]
        x_node, y_node = ph[0], ph[1]
        param_of = {n: name for n, name in zip(ph[2:], prog.order)}
        ops: list[_Op] = []
        prev = x_node
        body = [n for n in nodes if n.op not in ("placeholder", "output")]
        if not body:
            raise Unsupported("empty program")
        for i, node in enumerate(body):
            last = i == len(body) - 1
            if not node.args or node.args[0] is not prev or len(prev.users) != 1:
                raise Unsupported("the program is not a simple chain")
            extra = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, fx.Node)]
            if node.target is F.cross_entropy:
                kw = node.kwargs
                plain = (
                    kw.get("weight") is None
                    and kw.get("label_smoothing", 0.0) == 0.0
                    and kw.get("ignore_index", -100) == -100
                )
                if not (last and plain and len(node.args) == 2 and node.args[1] is y_node):
                    raise Unsupported("only a plain cross entropy ends a chain")
                ops.append(_Op("xent"))
            elif last:
                raise Unsupported("the chain does not end in a cross entropy")
            elif node.target in (stacked_linear, stacked_conv2d):
                names = tuple(param_of[a] if isinstance(a, fx.Node) else None for a in node.args[1:3])
                if names[1] is None:
                    raise Unsupported("layers without bias have no hand-written backward yet")
                if node.target is stacked_linear:
                    ops.append(_Op("linear", names))
                else:
                    stride, padding, dilation = node.args[3:6]
                    ops.append(_Op("conv", names, (tuple(stride), padding, tuple(dilation))))
            elif extra:
                raise Unsupported("a link of the chain takes a second tensor")
            else:
                ops.append(cls._simple(gm, node))
            prev = node
        return cls(ops, conv_mode)

    @staticmethod
    def _simple(gm: fx.GraphModule, node: fx.Node) -> _Op:
        target = node.target
        if node.op == "call_module":
            sub = gm.get_submodule(node.target)
            if isinstance(sub, PerClient):  # a position-dependent activation (.per_client_ops)
                raise Unsupported(f"{sub.name} has no hand-written backward")
            target = type(sub)
            if target is nn.ReLU:
                return _Op("relu")
            if target is nn.Tanh:
                return _Op("tanh")
            if target is nn.Identity:
                return _Op("identity")
            if target is nn.Flatten:
                return _Op("reshape", fn=sub)
            if target is nn.MaxPool2d and not sub.return_indices:
                return _Op(
                    "maxpool", args=(sub.kernel_size, sub.stride, sub.padding, sub.dilation, sub.ceil_mode)
                )
        elif node.op == "call_function":
            if target in (F.relu, torch.relu) and not node.kwargs.get("inplace", False):
                return _Op("relu")
            if target in (torch.tanh, F.tanh):
                return _Op("tanh")
            if target is torch.flatten:
                return _Op(
                    "reshape", fn=lambda h, a=node.args[1:], k=dict(node.kwargs): torch.flatten(h, *a, **k)
                )
        elif node.op == "call_method":
            if target == "relu":
                return _Op("relu")
            if target in ("flatten", "view", "reshape") and all(
                not isinstance(a, fx.Node) for a in node.args[1:]
            ):
                return _Op("reshape", fn=lambda h, a=node.args[1:], m=target: getattr(h, m)(*a))
        raise Unsupported(f"{getattr(target, '__name__', target)} has no hand-written backward")

    # -- running -----------------------------------------------------------------------------------
    def step(
        self,
        params: dict[str, Tensor],
        x: Tensor,
        y: Tensor,
        weight: Tensor,
        lr: dict[str, float] | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Losses [C] of sum_b weight[c, b] * loss[c, b]; gradients, or (``lr`` set) SGD in place.

        Args:
            params: Stacked parameters [C, ...] by name (updated in place when ``lr`` is set).
            x: Samples [C, B, ...].
            y: Labels [C, B].
            weight: Per-sample weights [C, B] (1/B, or a mask over the real samples / their count).
            lr: Plain SGD learning rate by parameter, applied in place; None returns the gradients.
        """
        # Compiled (trainer.compile), the link-by-link step: compilation removes the Python the
        # dense step saves, and its caches keyed by tensor identity would make dynamo recompile.
        if self.dense is not None and not torch.compiler.is_compiling():
            return self.dense.step(params, x, y, weight, lr)
        return self.generic_step(params, x, y, weight, lr)

    def generic_step(
        self,
        params: dict[str, Tensor],
        x: Tensor,
        y: Tensor,
        weight: Tensor,
        lr: dict[str, float] | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """:meth:`step` for any chain, link by link (the reference of :class:`.chain_dense.DenseChain`)."""
        c, b = y.shape
        h = x.reshape(c * b, *x.shape[2:])
        saved: list[Any] = []
        with torch.no_grad():
            for op in self.ops[:-1]:
                h, keep = self._forward(op, params, h)
                saved.append(keep)
            logits = h
            logp = torch.log_softmax(logits, 1)
            yf = y.reshape(-1, 1)
            per = -logp.gather(1, yf).view(c, b)
            losses = (per * weight).sum(1)
            g = logp.exp_()
            g.scatter_add_(1, yf, torch.full_like(yf, -1, dtype=g.dtype))
            g.mul_(weight.reshape(-1, 1))
            grads: dict[str, Tensor] = {}
            first = min(i for i, op in enumerate(self.ops) if op.params)
            for i in range(
                len(self.ops) - 2, first - 1, -1
            ):  # nothing below the first layer needs a gradient
                g = self._backward(self.ops[i], params, saved[i], g, i > first, lr, grads)
        return losses, grads

    def _forward(self, op: _Op, params: dict[str, Tensor], h: Tensor) -> tuple[Tensor, Any]:
        if op.kind == "linear":
            w, bias = params[op.params[0]], params[op.params[1]]
            return stacked_linear(h, w, bias), h
        if op.kind == "conv":
            w, bias = params[op.params[0]], params[op.params[1]]
            stride, padding, dilation = op.args
            return stacked_conv2d(h, w, bias, stride, padding, dilation, self.conv_mode), h
        if op.kind == "relu":
            out = h.relu()
            return out, out
        if op.kind == "tanh":
            out = h.tanh()
            return out, out
        if op.kind == "identity":
            return h, None
        if op.kind == "reshape":
            return op.fn(h), h.shape
        if op.kind == "maxpool":
            k, s, p, d, ceil = op.args
            out, idx = F.max_pool2d(h, k, s, p, d, ceil_mode=ceil, return_indices=True)
            return out, (h, idx)
        raise AssertionError(op.kind)

    def _backward(
        self,
        op: _Op,
        params: dict[str, Tensor],
        keep: Any,
        g: Tensor,
        need_input: bool,
        lr: dict[str, float] | None,
        grads: dict[str, Tensor],
    ) -> Tensor | None:
        if op.kind == "linear":
            w_name, b_name = op.params
            w, bias = params[w_name], params[b_name]
            c, out_f, in_f = w.shape
            h3 = keep.reshape(c, -1, in_f)
            g3 = g.reshape(c, -1, out_f)
            g_in = torch.bmm(g3, w).reshape(keep.shape) if need_input else None
            gb = g3.sum(1)
            if lr is None:
                grads[w_name] = torch.bmm(g3.transpose(1, 2), h3)
                grads[b_name] = gb
            else:
                torch.baddbmm(w, g3.transpose(1, 2), h3, alpha=-lr[w_name], out=w)
                bias.add_(gb, alpha=-lr[b_name])
            return g_in
        if op.kind == "conv":
            return self._conv_backward(op, params, keep, g, need_input, lr, grads)
        if op.kind == "relu":
            return _aten.threshold_backward(g, keep, 0)
        if op.kind == "tanh":
            return _aten.tanh_backward(g, keep)
        if op.kind == "identity":
            return g
        if op.kind == "reshape":
            return g.reshape(keep)
        if op.kind == "maxpool":
            h, idx = keep
            k, s, p, d, ceil = op.args
            pair = torch.nn.modules.utils._pair
            return _aten.max_pool2d_with_indices_backward(
                g, h, pair(k), pair(s if s is not None else k), pair(p), pair(d), ceil, idx
            )
        raise AssertionError(op.kind)

    def _conv_backward(
        self,
        op: _Op,
        params: dict[str, Tensor],
        h: Tensor,
        g: Tensor,
        need_input: bool,
        lr: dict[str, float] | None,
        grads: dict[str, Tensor],
    ) -> Tensor | None:
        w_name, b_name = op.params
        w, bias = params[w_name], params[b_name]
        stride, padding, dilation = op.args
        c, c_out = w.shape[:2]
        pad = _same_padding(padding, tuple(w.shape[3:]), dilation)
        mask = [need_input, True, False]
        if self.conv_mode == "per_client":
            hs, gs = h.reshape(c, -1, *h.shape[1:]), g.reshape(c, -1, *g.shape[1:])
            g_in, g_w = [], []
            for i in range(c):
                gi, gw, _ = _aten.convolution_backward(
                    gs[i], hs[i], w[i], None, stride, pad, dilation, False, [0, 0], 1, mask
                )
                g_in.append(gi)
                g_w.append(gw)
            g_input = torch.cat(g_in) if need_input else None
            gw_all = torch.stack(g_w)
        else:
            b = h.shape[0] // c
            hg = h.reshape(c, b, *h.shape[1:]).transpose(0, 1).reshape(b, -1, *h.shape[2:])
            gg = g.reshape(c, b, *g.shape[1:]).transpose(0, 1).reshape(b, -1, *g.shape[2:])
            gi, gw, _ = _aten.convolution_backward(
                gg,
                hg,
                w.reshape(c * c_out, *w.shape[2:]),
                None,
                stride,
                pad,
                dilation,
                False,
                [0, 0],
                c,
                mask,
            )
            g_input = gi.reshape(b, c, *h.shape[1:]).transpose(0, 1).reshape(h.shape) if need_input else None
            gw_all = gw.reshape(w.shape)
        gb = g.reshape(c, -1, c_out, *g.shape[2:]).sum((1, *range(3, g.ndim + 1)))
        if lr is None:
            grads[w_name], grads[b_name] = gw_all, gb
        else:
            w.add_(gw_all, alpha=-lr[w_name])
            bias.add_(gb, alpha=-lr[b_name])
        return g_input

    def check(self, ref: Reference, x: Tensor, y: Tensor, rtol: float = 1e-4) -> None:
        """Compare losses and gradients with the user's loss (``ref``); raise :class:`Unsupported` if they differ."""
        weight = torch.ones(y.shape, dtype=x.dtype, device=x.device)  # sums, as ``ref``'s gradients
        got, grads = self.step(dict(ref.params), x, y, weight, None)
        require_close(
            [("loss", got, ref.losses.sum(1)), *[(k, grads[k], ref.grads[k]) for k in ref.params]],
            rtol,
            "the hand-written backward disagrees with the model's loss",
        )


class ChainKernel(StackedKernel):
    """The hand-written chain as a kernel, read off the fx program and checked on its own."""

    name = "fx+chain"
    reason = "hand-written forward and backward for MLP/CNN chains: the fastest, batch-invariant"
    batch_invariant = True

    def chain(self, probe: Probe) -> StackedChain:
        """The chain read off the probe's fx program and checked against the user's loss, built once.

        Raises :class:`Unsupported` where the program is not a chain or the chain disagrees.
        """
        if "chain" not in probe.built:
            try:
                program, ref = FX.program(probe)
                chain = StackedChain.from_program(program, probe.conv_mode)
                chain.check(ref, *probe.sample)
                probe.built["chain"] = chain
            except Unsupported as err:
                probe.built["chain"] = err
        got = probe.built["chain"]
        if isinstance(got, Unsupported):
            raise got
        return got

    def unsupported(self, probe: Probe) -> str | None:
        """None if the model's loss is a chain whose steps reproduce the user's loss."""
        if probe.not_maskable is not None:
            return f"no chain: {probe.not_maskable}"
        try:
            self.chain(probe)
        except Unsupported as err:
            return f"no chain: {err}"
        return None

    def parts(self, probe: Probe) -> tuple[StackedProgram, StackedChain]:
        """The fx program the chain was read from, and the chain."""
        return FX.program(probe)[0], self.chain(probe)


CHAIN = ChainKernel()
