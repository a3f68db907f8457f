"""Gradient clipping on each client's own gradients: Lightning's ``gradient_clip_val`` and ``gradient_clip_algorithm``.

A norm taken over the stacked gradients of many clients would couple them (one client's large
gradient would shrink its neighbours' steps), so every client is clipped by its own norm, as a
Lightning Trainer would clip it training alone. The stacked path clips the rows of the stacked
gradients (:func:`clip_rows`) with the operators of ``torch.nn.utils.clip_grad_norm_`` applied to each
row, so a row's result does not depend on the other rows; the per-client loop clips the worker's
gradients (:func:`clip_module`). A model that overrides ``configure_gradient_clipping`` runs its
own code there, on one client's gradients; the stacked path does not run it (:class:`GradClip.hook`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

__all__ = ["ALGORITHMS", "GradClip", "clip_module", "clip_rows", "grad_clip"]

ALGORITHMS = ("norm", "value")


@dataclass(frozen=True)
class GradClip:
    """How each client's gradients are clipped before its optimizer step.

    Attributes:
        val: Largest norm (``norm``) or absolute value (``value``); None or 0 clips nothing.
        algorithm: ``norm`` (by the 2-norm over all the client's gradients) or ``value``.
        hook: The model overrides ``configure_gradient_clipping``: it is called at every step with
            ``val`` and ``algorithm``, and its ``self.clip_gradients`` clips that client's gradients.
    """

    val: float | None = None
    algorithm: Literal["norm", "value"] = "norm"
    hook: bool = False

    @property
    def clips(self) -> bool:
        """Whether ``val`` asks for clipping."""
        return self.val is not None and self.val > 0

    def record(self) -> dict[str, Any]:
        """The setting as plain values (recorded with the run; another one would give other models)."""
        return {"val": self.val, "algorithm": self.algorithm, "hook": self.hook}


def grad_clip(module: nn.Module, val: float | None, algorithm: str | None) -> GradClip | None:
    """The clipping of ``module``'s clients, or None when nothing clips (the default: no cost, same bits)."""
    hook = is_overridden("configure_gradient_clipping", module)
    clip = GradClip(None if val is None else float(val), algorithm or "norm", hook)  # type: ignore[arg-type]
    return clip if clip.clips or clip.hook else None


@torch.no_grad()
def clip_rows(grads: Sequence[Tensor | None], clip: GradClip) -> None:
    """Clip stacked gradients ``[m, ...]`` in place, each of the m rows (clients) by its own norm or values.

    Norms: ``torch._foreach_norm`` of every row of every gradient (each row is reduced as the loop
    reduces that client's gradient), the rows' norms combined per client by ``vector_norm``, and
    the coefficient ``max_norm / (norm + 1e-6)`` clamped at 1, as ``clip_grad_norm_`` computes it.
    """
    if not clip.clips:
        return
    gs = [g for g in grads if g is not None]
    if not gs:
        return
    if clip.algorithm == "value":
        for g in gs:
            g.clamp_(-clip.val, clip.val)
        return
    m = gs[0].shape[0]
    norms = torch._foreach_norm([row for g in gs for row in g.unbind(0)], 2.0)
    per_client = torch.stack(norms).view(len(gs), m).t().contiguous()  # [m, tensors]
    total = torch.linalg.vector_norm(per_client, 2.0, dim=1)
    coef = torch.clamp(float(clip.val) / (total + 1e-6), max=1.0)
    for g in gs:
        g.mul_(coef.view(m, *[1] * (g.ndim - 1)))


def _clip_parameters(params: list[Tensor], val: float | None, algorithm: str | None) -> None:
    """Clip the gradients of ``params`` as Lightning's Trainer does (nothing for a value of None or <= 0)."""
    if val is None or val <= 0:
        return
    if (algorithm or "norm") == "value":
        torch.nn.utils.clip_grad_value_(params, val)
    else:
        torch.nn.utils.clip_grad_norm_(params, val)


def clip_module(module: nn.Module, optimizer: torch.optim.Optimizer, clip: GradClip) -> None:
    """Clip one client's gradients, held by ``module`` (the loop's worker), before ``optimizer`` steps."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not clip.hook:
        _clip_parameters(params, clip.val, clip.algorithm)
        return
    if "clip_gradients" not in module.__dict__:  # the hook's self.clip_gradients clips this client alone

        def clip_gradients(
            opt: torch.optim.Optimizer,
            gradient_clip_val: float | None = None,
            gradient_clip_algorithm: str | None = None,
        ) -> None:
            _clip_parameters(
                [p for group in opt.param_groups for p in group["params"]],
                clip.val if gradient_clip_val is None else gradient_clip_val,
                clip.algorithm if gradient_clip_algorithm is None else gradient_clip_algorithm,
            )

        module.__dict__["clip_gradients"] = clip_gradients
    module.configure_gradient_clipping(
        optimizer, gradient_clip_val=clip.val, gradient_clip_algorithm=clip.algorithm
    )
