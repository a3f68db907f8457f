"""The reference a stacked kernel must reproduce before the engine trusts it: the user's own loss.

A stacked kernel (the fx rewrite of :mod:`.fx`, the hand-written chain of :mod:`.chain`) is
used only after it reproduced, on the run's own samples and at distinct parameters per client,
the per-sample losses and gradients that ``vmap`` of the user's ``per_sample_loss`` gives.
:func:`reference` computes those once; each kernel's ``check`` compares with it. The chain is
checked against the user's loss directly, not through the fx program it was read from, so the
kernel that trains is the one that was compared, and one comparison is enough.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedshard_lightning.module import shared_step_buffers

__all__ = ["Reference", "Unsupported", "probe_params", "reference", "require_close"]


class Unsupported(Exception):
    """The model cannot be rewritten; the message says why (the engine then keeps vmap)."""


class _LossOf(nn.Module):
    """``per_sample_loss`` as a forward, so fx can trace it and ``functional_call`` can rebind it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.m = module

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.m.per_sample_loss((x, y))


@dataclass(frozen=True)
class Reference:
    """The user's per-sample losses [C, B] at ``params`` [C, ...], and the gradients of their sum."""

    params: dict[str, Tensor]
    losses: Tensor
    grads: dict[str, Tensor]


def reference(module: nn.Module, x: Tensor, y: Tensor, names: Sequence[str]) -> Reference:
    """``vmap`` of the user's ``per_sample_loss`` over C clients with distinct parameters.

    Args:
        module: The model (its parameters are the base of the per-client perturbation).
        x: Samples [C, B, ...] (C >= 2 clients).
        y: Labels [C, B].
        names: Trainable parameter names.
    """
    params = {k: v.requires_grad_() for k, v in probe_params(module, names, x.shape[0]).items()}
    caller = _LossOf(module)
    buffers = shared_step_buffers(module)

    def loss(pc: dict[str, Tensor], xc: Tensor, yc: Tensor) -> Tensor:
        return functional_call(caller, ({"m." + k: v for k, v in pc.items()}, buffers), (xc, yc))

    with torch.enable_grad():
        losses = vmap(loss)(params, x, y)
        grads = torch.autograd.grad(losses.sum(), list(params.values()))
    return Reference({k: v.detach() for k, v in params.items()}, losses.detach(), dict(zip(params, grads)))


def require_close(pairs: Sequence[tuple[str, Tensor, Tensor]], rtol: float, what: str) -> None:
    """Raise :class:`Unsupported` (``what on <label>``) unless every ``got`` is close to its ``want``.

    Tolerance: ``rtol`` times the largest magnitude of ``want``, so tiny entries do not dominate.
    """
    for label, got, want in pairs:
        got, want = got.detach(), want.detach()
        tol = rtol * float(want.abs().max().clamp_min(1e-12))
        if got.shape != want.shape or not bool(((got - want).abs() <= tol).all()):
            raise Unsupported(f"{what} on {label}")


def probe_params(module: nn.Module, names: Sequence[str], c: int) -> dict[str, Tensor]:
    """Distinct parameters for ``c`` clients around the model's own (seeded), for the checks."""
    named = dict(module.named_parameters())
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = {}
    for n in names:
        p = named[n].detach()
        noise = torch.randn((c, *p.shape), generator=gen, dtype=torch.float64).to(p)
        scale = p.abs().mean().clamp_min(1e-3)
        params[n] = p.unsqueeze(0) + 0.5 * scale * noise
    return params
