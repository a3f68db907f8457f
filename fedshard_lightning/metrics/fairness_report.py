"""One request's fairness, as every analysis reports it: accuracy drops and M_p.

The unlearning replay (each client leaving alone), the cascade and the poisoning experiments all
ask the same question of a request: how much accuracy did the leaving and the remaining clients
lose, and how fair was that loss (M_p, FedShard paper section 5.1, eq. 6, with the shared client
alphas)? :func:`fairness_report` answers it once. Drops are fractions in ``[0, 1]``, ``before -
after``; a client without samples in the measured split has a NaN drop, which the statistics skip
and M_p counts as no drop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.metrics.fairness import performance_fairness

__all__ = ["cost_stats", "drop_stats", "fairness_report", "json_safe"]


def drop_stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, max and min of the finite values (``None`` when there are none)."""
    vals = [float(v) for v in values if not math.isnan(float(v))]
    if not vals:
        return {"mean": None, "max": None, "min": None}
    return {"mean": sum(vals) / len(vals), "max": max(vals), "min": min(vals)}


def fairness_report(
    acc_before: Tensor,
    acc_after: Tensor,
    alphas: Tensor | None,
    leaving: Sequence[int],
    eps0: float = 0.01,
    eps1: float = 1e-12,
    present: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Accuracy drops and M_p of one request.

    Args:
        acc_before: Per-client accuracy ``[K]`` before the request.
        acc_after: Per-client accuracy ``[K]`` after it.
        alphas: Client alphas ``[K]`` for M_p (``None``: M_p is not computed).
        leaving: The request's clients.
        eps0: M_p normalisation offset.
        eps1: M_p normalisation range guard.
        present: Clients still in the federation before the request (default all ``K``); the
            remaining ones are these minus ``leaving``.

    Returns:
        ``delta`` (the ``[K]`` drops), ``M_p`` (``None`` without alphas or remaining clients),
        ``leaving`` and ``remaining`` (:func:`drop_stats` of their drops) and ``remaining_drops``
        (client -> drop).
    """
    delta = (acc_before - acc_after).double().cpu()
    k = len(delta)
    gone = {int(c) for c in leaving}
    remaining = [c for c in (range(k) if present is None else present) if c not in gone]
    mp = None
    if alphas is not None and remaining:
        mask = torch.zeros(k, dtype=torch.bool)
        mask[sorted(gone)] = True
        mp = float(performance_fairness(torch.nan_to_num(delta, nan=0.0), alphas, mask, eps0, eps1))
    return {
        "delta": delta,
        "M_p": mp,
        "leaving": drop_stats([float(delta[c]) for c in sorted(gone)]),
        "remaining": drop_stats([float(delta[c]) for c in remaining]),
        "remaining_drops": {c: float(delta[c]) for c in remaining},
    }


def cost_stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, population variance and standard deviation, min and max (``None`` when empty)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"mean": None, "var": None, "std": None, "min": None, "max": None}
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    return {"mean": mean, "var": var, "std": math.sqrt(var), "min": min(vals), "max": max(vals)}


def json_safe(value: Any) -> Any:
    """JSON-safe: NaN/inf -> None, tensors and numpy scalars -> Python numbers, keys -> str."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (Tensor, np.generic)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
