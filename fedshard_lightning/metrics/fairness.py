r"""Fairness metrics of federated unlearning: FedShard paper, section 5 ("Fairness Metrics").

Paper: *FedShard: Federated Unlearning with Efficiency Fairness and Performance Fairness*
(Ding et al.), section 5.1, equation (6) (``eq:mp``) for the performance-fairness
metric :math:`M_p`, and section 5.2, equation (7) (``eq:me``) for the efficiency-fairness metric
:math:`M_e`. ``Dis(c1, c2) = |alpha_c1 - alpha_c2|`` uses the contribution factor of equation (1).
Lower is fairer for both.

Each metric is a functional ``_update``/``_compute`` pair (here) wrapped by a thin
:class:`torchmetrics.Metric` (:mod:`fedshard_lightning.metrics.fairness_metrics`), the way torchmetrics organises ``mean_squared_error``. Both metrics
are functions of the whole client population (a mean, a min over remaining clients, a min-max
normalisation), so the states are the raw per-client values with ``dist_reduce_fx="cat"`` and all
the arithmetic happens in ``compute``; both are invariant to the order of the clients, which is why
the order in which DDP ranks are gathered does not matter.

Departures from the paper, as decided by SPEC section 8:

- :math:`M_e` divides by :math:`\max(|\alpha_c|, \epsilon_\alpha)` instead of :math:`|\alpha_c|`,
  which is zero for a client whose update is parallel to the reference update.
- :math:`M_p` normalises with :math:`\epsilon_0 + (v - v_{min}) / (v_{max} - v_{min} + \epsilon_1)`,
  the two-epsilon form of Appendix F ("Axiom of Homogeneity"), instead of the main text's
  :math:`\epsilon + (v - v_{min}) / (v_{max} - v_{min})`, which divides by zero when all values tie.

All computation is in float64, whatever the input dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "client_distances",
    "efficiency_fairness",
    "performance_fairness",
]


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------


def _check_positive(value: float, name: str) -> None:
    """Reject a non-positive or non-finite epsilon early: it would surface later as inf or NaN."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"Expected argument `{name}` to be a positive finite float, but got {value!r}.")


def _check_client_vector(tensor: Any, name: str) -> Tensor:
    """Check that ``tensor`` is a finite real 1-D tensor over clients and return it as float64."""
    if not isinstance(tensor, Tensor):
        raise ValueError(f"Expected argument `{name}` to be a torch.Tensor, but got {type(tensor).__name__}.")
    if tensor.ndim != 1:
        raise ValueError(
            f"Expected argument `{name}` to be a 1-D tensor over clients, "
            f"but got shape {tuple(tensor.shape)}."
        )
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise ValueError(
            f"Expected argument `{name}` to be a real-valued tensor, but got dtype {tensor.dtype}."
        )
    tensor = tensor.detach().to(torch.float64)
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"Expected argument `{name}` to contain only finite values, but it has NaN or inf.")
    return tensor


def _check_same_length(first: Tensor, first_name: str, second: Tensor, second_name: str) -> None:
    """Per-client vectors must line up client by client."""
    if first.shape[0] != second.shape[0]:
        raise ValueError(
            f"Expected arguments `{first_name}` and `{second_name}` to have the same length (one entry per "
            f"client), but got {first.shape[0]} and {second.shape[0]}."
        )


def _check_leaving_mask(leaving_mask: Any) -> Tensor:
    """The leaving mask must be a 1-D bool tensor; integers would be ambiguous (indices or flags?)."""
    if not isinstance(leaving_mask, Tensor):
        raise ValueError(
            f"Expected argument `leaving_mask` to be a torch.Tensor, but got {type(leaving_mask).__name__}."
        )
    if leaving_mask.dtype != torch.bool:
        raise ValueError(
            f"Expected argument `leaving_mask` to have dtype torch.bool, but got {leaving_mask.dtype}."
        )
    if leaving_mask.ndim != 1:
        raise ValueError(
            "Expected argument `leaving_mask` to be a 1-D tensor over clients, but got shape "
            f"{tuple(leaving_mask.shape)}."
        )
    return leaving_mask.detach()


def _check_not_empty(tensor: Tensor, name: str) -> None:
    """Both metrics are means over clients: zero clients has no value."""
    if tensor.shape[0] == 0:
        raise ValueError(f"Expected argument `{name}` to hold at least one client, but it is empty.")


# --------------------------------------------------------------------------------------------------
# Efficiency fairness M_e, paper equation (7)
# --------------------------------------------------------------------------------------------------


def _efficiency_fairness_update(costs: Tensor, alphas: Tensor) -> tuple[Tensor, Tensor]:
    """Check one batch of clients and return its costs and alphas as float64.

    Args:
        costs: Unlearning cost ``Z_c`` of each client (seconds or client-steps), shape ``(n,)``.
        alphas: Contribution factor ``alpha_c`` of each client in radians, shape ``(n,)``.

    Returns:
        The two vectors as float64, ready to be appended to the metric state.
    """
    costs = _check_client_vector(costs, "costs")
    alphas = _check_client_vector(alphas, "alphas")
    _check_same_length(costs, "costs", alphas, "alphas")
    return costs, alphas


def _efficiency_fairness_compute(costs: Tensor, alphas: Tensor, eps_alpha: float = 1e-6) -> Tensor:
    """Compute M_e from the costs and alphas of all clients.

    The mean is taken after shifting by the first cost, so that equal costs give exactly zero
    (a plain ``mean`` of equal floats can round away from the value itself) and large costs with
    a small spread lose no precision to cancellation.

    Args:
        costs: Unlearning cost of every client, float64, shape ``(K,)`` with ``K >= 1``.
        alphas: Contribution factor of every client, float64, shape ``(K,)``.
        eps_alpha: Floor of ``|alpha_c|`` in the denominator.

    Returns:
        0-d float64 tensor.

    Example:
        >>> costs, alphas = _efficiency_fairness_update(torch.tensor([1.0, 3.0]), torch.tensor([0.5, -1.0]))
        >>> _efficiency_fairness_compute(costs, alphas)
        tensor(1.5000, dtype=torch.float64)
    """
    _check_not_empty(costs, "costs")
    shifted = costs - costs[0]
    deviation = shifted - shifted.mean()
    weight = alphas.abs().clamp_min(eps_alpha)
    return (deviation.square() / weight).mean()


def efficiency_fairness(costs: Tensor, alphas: Tensor, eps_alpha: float = 1e-6) -> Tensor:
    r"""Efficiency-fairness metric :math:`M_e`, FedShard equation (7): lower is fairer.

    .. math::
        M_e = \frac{1}{K} \sum_{c=1}^{K} \frac{(Z_{avg} - Z_c)^2}{\max(|\alpha_c|, \epsilon_\alpha)},
        \qquad Z_{avg} = \frac{1}{K} \sum_{c=1}^{K} Z_c

    A contribution-weighted variance: clients of similar contribution should cost similar amounts
    to unlearn.

    Args:
        costs: Unlearning cost ``Z_c`` of each client alone, shape ``(K,)``, ``K >= 1``.
        alphas: Contribution factor ``alpha_c`` of each client in radians, shape ``(K,)``.
        eps_alpha: Floor of ``|alpha_c|`` so that a zero contribution does not divide by zero.

    Returns:
        0-d float64 tensor.

    Raises:
        ValueError: If an argument is not a finite 1-D tensor, the lengths differ, there is no
            client, or ``eps_alpha`` is not positive.

    Example:
        >>> import torch
        >>> efficiency_fairness(torch.tensor([1.0, 3.0]), torch.tensor([0.5, -1.0]))
        tensor(1.5000, dtype=torch.float64)
    """
    _check_positive(eps_alpha, "eps_alpha")
    costs, alphas = _efficiency_fairness_update(costs, alphas)
    return _efficiency_fairness_compute(costs, alphas, eps_alpha)


# --------------------------------------------------------------------------------------------------
# Performance fairness M_p, paper equation (6)
# --------------------------------------------------------------------------------------------------


def _client_distances(alphas: Tensor, leaving_mask: Tensor) -> Tensor:
    """Compute ``y_c = min over remaining c_r of |alpha_c - alpha_r|`` on checked inputs."""
    remaining = alphas[~leaving_mask]
    return (alphas[:, None] - remaining[None, :]).abs().amin(dim=1)


def client_distances(alphas: Tensor, leaving_mask: Tensor) -> Tensor:
    r"""Uniqueness of each client's data: distance to its nearest remaining client.

    .. math:: y_c = \min_{c_r \in \mathcal{C}_R} |\alpha_c - \alpha_{c_r}|

    A remaining client is its own nearest remaining client, so its ``y_c`` is exactly zero.

    Args:
        alphas: Contribution factor of each client in radians, shape ``(K,)``.
        leaving_mask: ``True`` for the leaving clients, bool, shape ``(K,)``; at least one
            ``False``.

    Returns:
        float64 tensor of shape ``(K,)``.

    Raises:
        ValueError: If the arguments are malformed or no client remains.

    Example:
        >>> import torch
        >>> client_distances(torch.tensor([0.0, 0.25, 1.0]), torch.tensor([False, True, True]))
        tensor([0.0000, 0.2500, 1.0000], dtype=torch.float64)
    """
    alphas = _check_client_vector(alphas, "alphas")
    leaving_mask = _check_leaving_mask(leaving_mask)
    _check_same_length(alphas, "alphas", leaving_mask, "leaving_mask")
    _check_has_remaining(leaving_mask)
    return _client_distances(alphas, leaving_mask)


def _check_has_remaining(leaving_mask: Tensor) -> None:
    """``y_c`` is a minimum over remaining clients: it needs at least one."""
    if bool(leaving_mask.all()):
        raise ValueError(
            "Expected argument `leaving_mask` to leave at least one remaining client (a False entry), "
            "but every client is marked as leaving."
        )


def _normalise(values: Tensor, eps0: float, eps1: float) -> Tensor:
    """Min-max normalise into ``[eps0, eps0 + 1)`` so that ``f`` never divides by zero."""
    low, high = values.min(), values.max()
    return eps0 + (values - low) / (high - low + eps1)


def _performance_fairness_update(
    delta_acc: Tensor, alphas: Tensor, leaving_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Check one batch of clients and return its three vectors.

    Args:
        delta_acc: Accuracy on each client's data before minus after unlearning, shape ``(n,)``.
        alphas: Contribution factor of each client in radians, shape ``(n,)``.
        leaving_mask: ``True`` for leaving clients, bool, shape ``(n,)``.

    Returns:
        ``delta_acc`` and ``alphas`` as float64, and ``leaving_mask`` as bool.
    """
    delta_acc = _check_client_vector(delta_acc, "delta_acc")
    alphas = _check_client_vector(alphas, "alphas")
    leaving_mask = _check_leaving_mask(leaving_mask)
    _check_same_length(delta_acc, "delta_acc", alphas, "alphas")
    _check_same_length(delta_acc, "delta_acc", leaving_mask, "leaving_mask")
    return delta_acc, alphas, leaving_mask


def _performance_fairness_compute(
    delta_acc: Tensor, alphas: Tensor, leaving_mask: Tensor, eps0: float = 0.01, eps1: float = 1e-12
) -> Tensor:
    """Compute M_p from the vectors of all clients.

    The distances and both normalisations need the whole population, which is why they are here
    and not in the update.

    Args:
        delta_acc: Accuracy drop of every client, float64, shape ``(K,)`` with ``K >= 1``.
        alphas: Contribution factor of every client, float64, shape ``(K,)``.
        leaving_mask: ``True`` for leaving clients, bool, shape ``(K,)``, at least one ``False``.
        eps0: Offset of the normalisation, the smallest normalised value.
        eps1: Added to the range of the normalisation, so that all-equal values give ``eps0``.

    Returns:
        0-d float64 tensor, at least 4 (the minimum of ``f``, reached where ``x~ == y~``).

    Example:
        >>> delta, alphas = torch.tensor([0.0, 0.1, 0.4]), torch.tensor([0.0, 0.25, 1.0])
        >>> state = _performance_fairness_update(delta, alphas, torch.tensor([False, True, True]))
        >>> _performance_fairness_compute(*state)
        tensor(4., dtype=torch.float64)
    """
    _check_not_empty(delta_acc, "delta_acc")
    _check_has_remaining(leaving_mask)
    x = _normalise(delta_acc, eps0, eps1)
    y = _normalise(_client_distances(alphas, leaving_mask), eps0, eps1)
    return ((x + y) * (1.0 / x + 1.0 / y)).mean()


def performance_fairness(
    delta_acc: Tensor, alphas: Tensor, leaving_mask: Tensor, eps0: float = 0.01, eps1: float = 1e-12
) -> Tensor:
    r"""Performance-fairness metric :math:`M_p`, FedShard equation (6): lower is fairer.

    .. math::
        y_c = \min_{c_r \in \mathcal{C}_R} |\alpha_c - \alpha_{c_r}|, \qquad
        x_c = \Delta\mathcal{Y}(D_c), \qquad
        \tilde v = \epsilon_0 + \frac{v - v_{min}}{v_{max} - v_{min} + \epsilon_1}

        M_p = \frac{1}{K} \sum_{c=1}^{K} (\tilde x_c + \tilde y_c)
              \left(\frac{1}{\tilde x_c} + \frac{1}{\tilde y_c}\right)

    Each term is ``2 + x~/y~ + y~/x~ >= 4``, equal to 4 where ``x~ == y~``. By the rearrangement
    inequality, for a fixed set of accuracy drops M_p is smallest when the drops are ranked like
    the distances ``y`` (paper Appendix F, lemma `mpequiv2`): unique leaving clients should lose the
    most, remaining clients (``y = 0``) the least.

    Args:
        delta_acc: Accuracy on each client's local data before minus after unlearning, ``(K,)``.
        alphas: Contribution factor of each client in radians, shape ``(K,)``.
        leaving_mask: ``True`` for leaving clients, bool, shape ``(K,)``; at least one ``False``.
        eps0: Smallest normalised value, keeps ``1/x~`` finite.
        eps1: Added to the normalisation range, keeps all-equal values finite.

    Returns:
        0-d float64 tensor.

    Raises:
        ValueError: If an argument is malformed, the lengths differ, there is no client, no client
            remains, or an epsilon is not positive.

    Example:
        Drops ranked like the distances are fair (the minimum, 4); the remaining client losing the
        most is not:

        >>> import torch
        >>> alphas, leaving = torch.tensor([0.0, 0.25, 1.0]), torch.tensor([False, True, True])
        >>> performance_fairness(torch.tensor([0.0, 0.1, 0.4]), alphas, leaving)
        tensor(4., dtype=torch.float64)
        >>> performance_fairness(torch.tensor([0.4, 0.1, 0.0]), alphas, leaving)
        tensor(70.0066, dtype=torch.float64)
    """
    _check_positive(eps0, "eps0")
    _check_positive(eps1, "eps1")
    delta_acc, alphas, leaving_mask = _performance_fairness_update(delta_acc, alphas, leaving_mask)
    return _performance_fairness_compute(delta_acc, alphas, leaving_mask, eps0, eps1)
