"""The fairness metrics as :class:`torchmetrics.Metric` classes: M_e and M_p over DDP ranks.

Thin wrappers of the functional ``_update``/``_compute`` pairs of
:mod:`fedshard_lightning.metrics.fairness` (FedShard paper section 5, equations (6) and (7)), the
way torchmetrics wraps ``mean_squared_error``: the states are the raw per-client values,
concatenated across ranks, and all arithmetic happens in ``compute``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from fedshard_lightning.metrics.fairness import (
    _check_positive,
    _efficiency_fairness_compute,
    _efficiency_fairness_update,
    _performance_fairness_compute,
    _performance_fairness_update,
)

__all__ = ["EfficiencyFairness", "PerformanceFairness"]


class _ClientMetric(Metric):
    """Base of metrics whose states are per-client float64 vectors concatenated across ranks.

    torchmetrics fills the state of a rank that saw no update with an empty tensor of
    ``self.dtype``, and ``Metric.to(device)`` resets that dtype to float32. With float64 states on
    the other ranks the gloo all-gather then aborts the process; pinning ``dtype`` to float64 keeps
    every rank's tensors of one dtype (the DDP test's ``idle_rank`` case).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound: float = 0.0

    @property
    def dtype(self) -> torch.dtype:
        """States are always float64."""
        return torch.float64

    def _add_client_states(self, *names: str) -> None:
        for name in names:
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def _append(self, name: str, value: Tensor) -> None:
        getattr(self, name).append(value.to(device=self.device, dtype=torch.float64))

    def _gathered(self, name: str) -> Tensor:
        state = getattr(self, name)
        if isinstance(state, list):
            if not state:
                raise ValueError(
                    f"{type(self).__name__}.compute() called before any client was passed to update()."
                )
            state = dim_zero_cat(state)
        return state.to(torch.float64)


class EfficiencyFairness(_ClientMetric):
    r"""Efficiency-fairness metric :math:`M_e` of federated unlearning, FedShard equation (7).

    .. math::
        M_e = \frac{1}{K} \sum_{c=1}^{K} \frac{(Z_{avg} - Z_c)^2}{\max(|\alpha_c|, \epsilon_\alpha)}

    As input to ``update`` the metric accepts:

    - ``costs`` (:class:`~torch.Tensor`): unlearning cost ``Z_c`` of each client, shape ``(n,)``
    - ``alphas`` (:class:`~torch.Tensor`): contribution factor of each client, shape ``(n,)``

    Clients may arrive in several batches or on several DDP ranks; ``compute`` sees them all.
    ``forward`` returns the value over its own batch only.

    Args:
        eps_alpha: Floor of ``|alpha_c|`` in the denominator.
        kwargs: Additional keyword arguments of :class:`torchmetrics.Metric`.

    Example:
        >>> import torch
        >>> metric = EfficiencyFairness()
        >>> metric.update(torch.tensor([1.0]), torch.tensor([0.5]))
        >>> metric.update(torch.tensor([3.0]), torch.tensor([-1.0]))
        >>> metric.compute()
        tensor(1.5000, dtype=torch.float64)
    """

    costs: list[Tensor]
    alphas: list[Tensor]

    def __init__(self, eps_alpha: float = 1e-6, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _check_positive(eps_alpha, "eps_alpha")
        self.eps_alpha = float(eps_alpha)
        self._add_client_states("costs", "alphas")

    def update(self, costs: Tensor, alphas: Tensor) -> None:
        """Append a batch of clients."""
        costs, alphas = _efficiency_fairness_update(costs, alphas)
        self._append("costs", costs)
        self._append("alphas", alphas)

    def compute(self) -> Tensor:
        """Compute M_e over all clients seen."""
        return _efficiency_fairness_compute(self._gathered("costs"), self._gathered("alphas"), self.eps_alpha)


class PerformanceFairness(_ClientMetric):
    r"""Performance-fairness metric :math:`M_p` of federated unlearning, FedShard equation (6).

    .. math::
        M_p = \frac{1}{K} \sum_{c=1}^{K} (\tilde x_c + \tilde y_c)
              \left(\frac{1}{\tilde x_c} + \frac{1}{\tilde y_c}\right),
        \quad x_c = \Delta\mathcal{Y}(D_c), \quad y_c = \min_{c_r \in \mathcal{C}_R} |\alpha_c - \alpha_{c_r}|

    with :math:`\tilde v = \epsilon_0 + (v - v_{min}) / (v_{max} - v_{min} + \epsilon_1)` over all clients.

    As input to ``update`` the metric accepts:

    - ``delta_acc`` (:class:`~torch.Tensor`): accuracy before minus after unlearning, ``(n,)``
    - ``alphas`` (:class:`~torch.Tensor`): contribution factor of each client, shape ``(n,)``
    - ``leaving_mask`` (:class:`~torch.Tensor`): ``True`` for leaving clients, bool, ``(n,)``

    The distances and normalisations are taken over all clients in ``compute``, after the states of
    all batches and ranks are concatenated, so a batch may hold only leaving clients. ``forward``
    returns the value over its own batch only, which needs a remaining client in that batch.

    Args:
        eps0: Smallest normalised value.
        eps1: Added to the normalisation range.
        kwargs: Additional keyword arguments of :class:`torchmetrics.Metric`.

    Example:
        >>> import torch
        >>> metric = PerformanceFairness()
        >>> metric.update(torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([False]))
        >>> metric.update(torch.tensor([0.1, 0.4]), torch.tensor([0.25, 1.0]), torch.tensor([True, True]))
        >>> metric.compute()
        tensor(4., dtype=torch.float64)
    """

    delta_acc: list[Tensor]
    alphas: list[Tensor]
    leaving: list[Tensor]

    def __init__(self, eps0: float = 0.01, eps1: float = 1e-12, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _check_positive(eps0, "eps0")
        _check_positive(eps1, "eps1")
        self.eps0 = float(eps0)
        self.eps1 = float(eps1)
        # The mask is stored as 0.0/1.0 float64: one dtype for every state keeps the gather simple.
        self._add_client_states("delta_acc", "alphas", "leaving")

    def update(self, delta_acc: Tensor, alphas: Tensor, leaving_mask: Tensor) -> None:
        """Append a batch of clients."""
        delta_acc, alphas, leaving_mask = _performance_fairness_update(delta_acc, alphas, leaving_mask)
        self._append("delta_acc", delta_acc)
        self._append("alphas", alphas)
        self._append("leaving", leaving_mask)

    def compute(self) -> Tensor:
        """Compute M_p over all clients seen."""
        return _performance_fairness_compute(
            self._gathered("delta_acc"),
            self._gathered("alphas"),
            self._gathered("leaving") > 0.5,
            self.eps0,
            self.eps1,
        )
