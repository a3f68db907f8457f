"""Stacked clients without vmap: the model's per-sample loss rewritten once into batched kernels.

``vmap`` is general but pays Python dispatch on every operator of every step, which dominates
small federated models (the digits MLP spends most of a stacked step outside its kernels). Most
models are chains of standard layers, so :class:`StackedProgram` traces ``per_sample_loss`` with
``torch.fx`` once and emits a program over all clients' samples merged into one batch dimension
``[clients * batch, ...]``:

* a layer with parameters gets a stacked kernel (``nn.Linear`` becomes ``baddbmm`` over the
  clients' weights, ``nn.Conv2d`` a grouped or per-client convolution);
* a per-sample operation (activations, pooling, flatten, the cross-entropy with
  ``reduction="none"``) runs unchanged on the merged batch, because it never mixes samples.

Anything else (batch statistics, buffers, parameters used outside a supported layer, an operator
not known to be per-sample) keeps the ``vmap`` path. Before it trains, the program is checked
against ``vmap`` of the user's loss on the run's own data with distinct parameters per client
(:mod:`.check`), so a rewrite that mixed clients or samples is refused rather than trusted.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from fedshard_lightning.engine.kernels.base import ConvMode, Probe, StackedKernel
from fedshard_lightning.engine.kernels.check import (
    Reference,
    Unsupported,
    _LossOf,
    reference,
    require_close,
)
from fedshard_lightning.engine.kernels.per_client_ops import ClientChunks, per_client_op
from fedshard_lightning.engine.kernels.trace import trace

__all__ = [
    "FX",
    "ConvMode",
    "FxKernel",
    "StackedProgram",
    "Unsupported",
    "stacked_conv2d",
    "stacked_linear",
]

# Modules without parameters that act on each sample separately.
_PER_SAMPLE_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
    nn.Mish,
    nn.Hardtanh,
    nn.Identity,
    nn.Flatten,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.LogSoftmax,
    nn.Softmax,
)

# Functions and tensor methods that act on each sample separately (given their arguments pass
# ``_per_sample_args``).
_PER_SAMPLE_FUNCTIONS: frozenset[Any] = frozenset(
    {
        F.relu,
        torch.relu,
        F.relu6,
        F.leaky_relu,
        F.elu,
        F.selu,
        F.celu,
        F.gelu,
        F.silu,
        F.mish,
        F.softplus,
        torch.tanh,
        F.tanh,
        torch.sigmoid,
        F.sigmoid,
        F.max_pool1d,
        F.max_pool2d,
        F.avg_pool1d,
        F.avg_pool2d,
        F.adaptive_avg_pool2d,
        F.adaptive_max_pool2d,
        torch.flatten,
        F.log_softmax,
        F.softmax,
        F.cross_entropy,
        F.nll_loss,
        operator.add,
        operator.sub,
        operator.mul,
        operator.truediv,
        operator.neg,
    }
)
_PER_SAMPLE_METHODS: frozenset[str] = frozenset(
    {
        "relu",
        "tanh",
        "sigmoid",
        "flatten",
        "view",
        "reshape",
        "size",
        "contiguous",
        "float",
        "log_softmax",
        "softmax",
    }
)
_LOSSES = (F.cross_entropy, F.nll_loss)


def stacked_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``nn.Linear`` of every client on its own samples: x [C*B, ..., in], weight [C, out, in]."""
    c, out_f, in_f = weight.shape
    x3 = x.reshape(c, -1, in_f)
    if bias is None:
        y = torch.bmm(x3, weight.transpose(1, 2))
    else:
        y = torch.baddbmm(bias.unsqueeze(1), x3, weight.transpose(1, 2))
    return y.reshape(*x.shape[:-1], out_f)


def stacked_conv2d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: Any,
    padding: Any,
    dilation: Any,
    mode: ConvMode = "grouped",
) -> Tensor:
    """``nn.Conv2d`` of every client on its own samples: x [C*B, Cin, H, W], weight [C, Cout, Cin, k, k].

    ``grouped`` runs one convolution with the clients as groups (what ``vmap`` does);
    ``per_client`` runs one ordinary convolution per client, which the CPU backends do faster.
    """
    c, c_out = weight.shape[:2]
    xs = x.reshape(c, -1, *x.shape[1:])
    if mode == "per_client":
        outs = [
            F.conv2d(xs[i], weight[i], None if bias is None else bias[i], stride, padding, dilation)
            for i in range(c)
        ]
        return torch.cat(outs)
    b = xs.shape[1]
    xg = xs.transpose(0, 1).reshape(b, -1, *x.shape[2:])
    yg = F.conv2d(
        xg,
        weight.reshape(c * c_out, *weight.shape[2:]),
        None if bias is None else bias.reshape(-1),
        stride,
        padding,
        dilation,
        groups=c,
    )
    return yg.reshape(b, c, c_out, *yg.shape[2:]).transpose(0, 1).reshape(c * b, c_out, *yg.shape[2:])


def _per_sample_args(node: fx.Node) -> bool:
    """Reject argument values that would make a per-sample operator act across the batch."""
    target, kw = node.target, node.kwargs
    if target in _LOSSES:
        return kw.get("reduction", "mean") == "none" and len(node.args) <= 2
    if target in (torch.flatten, "flatten"):
        start = kw.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
        return isinstance(start, int) and start >= 1
    if target in (F.log_softmax, F.softmax, "log_softmax", "softmax"):
        dim = kw.get("dim", node.args[1] if len(node.args) > 1 else None)
        return isinstance(dim, int) and dim != 0
    return True


class StackedProgram:
    """``per_sample_loss`` of many clients at once, from stacked parameters, without vmap.

    Build with :meth:`build`, which returns the program or raises :class:`Unsupported`.

    Args:
        graph_module: The rewritten graph: ``(x, y, *params) -> losses [C*B]``.
        order: Parameter names in the order of the graph's parameter inputs.
        chunks: The client split its position-dependent operators use (:mod:`.per_client_ops`).
    """

    def __init__(
        self, graph_module: fx.GraphModule, order: list[str], chunks: ClientChunks | None = None
    ) -> None:
        self.gm = graph_module
        self.order = order
        self.chunks = chunks if chunks is not None else ClientChunks()

    def __call__(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        """Per-sample losses [C, B] of stacked params [C, ...] on x [C, B, ...] and y [C, B]."""
        c, b = y.shape[:2]
        self.chunks.clients = c
        out = self.gm(x.reshape(c * b, *x.shape[2:]), y.reshape(c * b), *[params[n] for n in self.order])
        if out.shape != (c * b,):
            raise Unsupported(
                f"per_sample_loss returned shape {tuple(out.shape)}, expected one loss per sample"
            )
        return out.view(c, b)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def build(
        cls, module: nn.Module, names: Sequence[str], conv_mode: ConvMode = "grouped"
    ) -> StackedProgram:
        """Trace and rewrite ``module.per_sample_loss``; raise :class:`Unsupported` if not possible."""
        if any(True for _ in module.buffers()):
            raise Unsupported("the model has buffers (e.g. batch norm statistics)")
        try:
            root = _LossOf(module)
            traced = trace(root, _PER_SAMPLE_FUNCTIONS)
        except Exception as err:  # fx raises many types on untraceable Python
            raise Unsupported(
                f"per_sample_loss is not traceable by torch.fx ({type(err).__name__}: {err})"
            ) from err
        trainable = set(names)
        chunks = ClientChunks()
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        order: list[str] = []
        old = list(traced.nodes)
        for node in old:
            if node.op == "placeholder":
                env[node] = graph.placeholder(node.name)
        layers = {}
        for node in old:
            if node.op != "call_module":
                continue
            sub = root.get_submodule(node.target)
            if isinstance(sub, (nn.Linear, nn.Conv2d)):
                prefix = node.target.removeprefix("m.")
                own = [f"{prefix}.{n}" for n, _ in sub.named_parameters()]
                if not all(n in trainable for n in own):
                    raise Unsupported(f"layer {prefix} has frozen parameters")
                layers[node] = (sub, prefix)
                order.extend(own)
        placeholders = {n: graph.placeholder("p_" + n.replace(".", "_")) for n in order}
        used = set()
        for node in old:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                graph.output(env[node.args[0]])
                continue
            if node.op == "get_attr":
                raise Unsupported(
                    f"forward reads {node.target} directly; only parameters of nn.Linear/nn.Conv2d are stacked"
                )
            if node in layers:
                sub, prefix = layers[node]
                w = placeholders[f"{prefix}.weight"]
                b = placeholders.get(f"{prefix}.bias")
                used.update(n for n in order if n.startswith(prefix + "."))
                (arg,) = node.args
                if isinstance(sub, nn.Linear):
                    env[node] = graph.call_function(stacked_linear, (env[arg], w, b))
                else:
                    if sub.groups != 1 or sub.padding_mode != "zeros":
                        raise Unsupported(f"conv {prefix}: only groups=1 and zero padding are stacked")
                    env[node] = graph.call_function(
                        stacked_conv2d, (env[arg], w, b, sub.stride, sub.padding, sub.dilation, conv_mode)
                    )
                continue
            if node.op == "call_module":
                sub = root.get_submodule(node.target)
                if type(sub) not in _PER_SAMPLE_MODULES or any(True for _ in sub.parameters()):
                    raise Unsupported(
                        f"module {node.target.removeprefix('m.')} ({type(sub).__name__}) has no stacked form"
                    )
                if isinstance(sub, nn.Flatten) and sub.start_dim == 0:
                    raise Unsupported("nn.Flatten(start_dim=0) mixes samples")
                if isinstance(sub, (nn.Softmax, nn.LogSoftmax)) and sub.dim in (0, None):
                    raise Unsupported("softmax over the batch dimension mixes samples")
            elif node.op == "call_function":
                if node.target not in _PER_SAMPLE_FUNCTIONS or not _per_sample_args(node):
                    raise Unsupported(
                        f"operation {getattr(node.target, '__name__', node.target)} has no stacked form"
                    )
            elif node.op == "call_method" and (
                node.target not in _PER_SAMPLE_METHODS or not _per_sample_args(node)
            ):
                raise Unsupported(f"tensor method {node.target} has no stacked form")
            per_client = per_client_op(node, root, chunks)
            if per_client is not None:  # rounds by position: each client's chunk on its own
                name = f"per_client_{len(env)}"
                root.add_module(name, per_client)
                env[node] = graph.call_module(name, (env[node.args[0]],))
                continue
            env[node] = graph.node_copy(node, lambda n: env[n])
        if set(order) != used or set(order) != trainable:
            raise Unsupported("some trainable parameters are not inside a stackable layer")
        gm = fx.GraphModule(root, graph)
        return cls(gm, order, chunks)

    def check(self, ref: Reference, x: Tensor, y: Tensor, rtol: float = 1e-4) -> None:
        """Compare losses and gradients with the user's loss (``ref``); raise :class:`Unsupported` if they differ.

        Args:
            ref: :func:`~.check.reference` on the same samples.
            x: Samples [C, B, ...] (C >= 2 clients).
            y: Labels [C, B].
            rtol: Relative tolerance (of the largest magnitude of each tensor).
        """
        params = {k: v.detach().requires_grad_() for k, v in ref.params.items()}
        with torch.enable_grad():
            got = self(params, x, y)
            g_got = torch.autograd.grad(got.sum(), list(params.values()))
        require_close(
            [("loss", got, ref.losses), *[(k, g, ref.grads[k]) for k, g in zip(params, g_got)]],
            rtol,
            "the stacked rewrite of per_sample_loss disagrees with vmap",
        )


class FxKernel(StackedKernel):
    """The fx program as a kernel: the rewritten ``per_sample_loss``, autograd for the backward."""

    name = "fx"
    reason = "a traced program for maskable models the chain does not cover; autograd backward"
    batch_invariant = True

    def program(self, probe: Probe) -> tuple[StackedProgram, Reference]:
        """The program and the user's reference losses on the probe's samples, built once.

        Raises :class:`Unsupported` where either cannot be made.
        """
        if "fx" not in probe.built:
            try:
                program = StackedProgram.build(probe.module, probe.names, probe.conv_mode)
                probe.built["fx"] = (program, reference(probe.module, *probe.sample, probe.names))
            except Unsupported as err:
                probe.built["fx"] = err
        got = probe.built["fx"]
        if isinstance(got, Unsupported):
            raise got
        return got

    def unsupported(self, probe: Probe) -> str | None:
        """None if the program builds and reproduces the user's losses and gradients."""
        if probe.not_maskable is not None:
            return probe.not_maskable
        try:
            program, ref = self.program(probe)
            program.check(ref, *probe.sample)
        except Unsupported as err:
            return str(err)
        return None

    def parts(self, probe: Probe) -> tuple[StackedProgram, None]:
        """The checked program; no chain."""
        return self.program(probe)[0], None


FX = FxKernel()
