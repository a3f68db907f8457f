r"""FedRecover: recovery from stored history with L-BFGS-estimated client updates ("FR" in section 6).

Cao, Jia, Zhang and Gong, "FedRecover: Recovering from Poisoning Attacks in Federated Learning
using Historical Information", IEEE S&P 2023, Algorithm 1. During training the server stores every
round's global model w_t and every client's update g_i^t. To remove clients, it recomputes the
rounds from the initial model with the remaining clients, asking them for exact updates only in

* the first ``warmup_rounds`` rounds (warm-up),
* every ``correction_period``-th round after that (periodic correction), and
* the last ``final_tuning_rounds`` rounds (final tuning);

in every other round it *estimates* each remaining client's update from history, by the
first-order expansion around the original trajectory,

.. math:: \hat g_i^t = g_i^t + \tilde H_i^t (\hat w_t - w_t),

where the Hessian-vector product is the compact L-BFGS approximation (Byrd, Nocedal and Schnabel
1994, the form of the paper's L-BFGS procedure) built from the client's last ``buffer_size`` pairs
(Δw = ŵ_t - w_t, Δg = exact recovered update - stored update) collected in exact rounds:
:func:`lbfgs_hvp`.

Choices and departures:

* Updates are FedAvg model updates (client model after local training minus the round's start),
  aggregated with sample-count weights, instead of gradients with a global learning rate. The
  compact L-BFGS product is homogeneous in the Δg's, so using updates (≈ -η g) estimates the
  update's Jacobian directly; no sign or step size is needed.
* Exact rounds are ``t < warmup_rounds``, ``t >= rounds - final_tuning_rounds`` and
  ``(t - warmup_rounds + 1) % correction_period == 0`` (0-based), so with ``correction_period=1``
  every round is exact and the recovery *is* retraining from scratch. Exact rounds sample their
  participants like retraining does (keyed); estimated rounds use the round's original
  participants that remain (with ``client_fraction=1`` both are all remaining clients).
* The paper's abnormality check (an estimated update with a coordinate above a threshold is
  replaced by an exact one) would make the cost depend on the data, while the cost must be
  predictable before running (:meth:`FedRecover.predict_cost`). Two cost-free safeguards replace
  it: a pair enters a client's buffer only if it satisfies the curvature condition
  (``Δw^T Δg < 0`` for updates, i.e. positive curvature of the loss; :func:`curvature_ok`), and
  an estimated correction is shortened to at most ``|ŵ_t - w_t|`` (the Jacobian of a stable
  local-training map is not expanding). Without them, recovery on digits with 64 clients diverged
  within a few estimated rounds; with them it lands nearer to retraining than the original model.
  A client without a usable pair keeps its stored update.
* The method is applied to client removal (unlearning), the paper's use case being the removal of
  malicious clients; the stored history is the original training's, so requests accumulate by
  recovering from it without every removed client.

Storage: every round's start model and all participants' updates, one FLCache file per round,
written as training goes and read back one round at a time (rounds x clients x parameters on disk,
one round plus ``buffer_size`` pairs per client in memory during recovery).

As a planner (:class:`~fedshard_lightning.unlearning.history.HistoryFedAvg`): a request is one
plan per exact round, on all remaining clients with their updates kept, and a closing plan without
training. Each plan's ``init`` is the server's work since the exact round before it: the pairs of
that round (computed once per request) and the estimated rounds in between; the closing plan
holds the recovered model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.engine import Group, TrainResult, stack_params, unstack_params
from fedshard_lightning.limits import check_count
from fedshard_lightning.unlearning.history import HistoryFedAvg
from fedshard_lightning.unlearning.planner import PlanState, StagePlan

__all__ = ["FedRecover", "curvature_ok", "lbfgs_hvp"]


def lbfgs_hvp(delta_ws: Sequence[Tensor], delta_gs: Sequence[Tensor], v: Tensor) -> Tensor:
    r"""Compact-form L-BFGS approximation of the Hessian-vector product ``H v``.

    With ``S = [Δw_1 .. Δw_s]``, ``Y = [Δg_1 .. Δg_s]`` (oldest first), ``A = S^T Y``, ``L`` its
    strictly lower triangle, ``D`` its diagonal and ``σ = Δg_s^T Δw_s / Δw_s^T Δw_s``:

    .. math:: B v = σ v - [σ S \; Y]
              \begin{bmatrix} σ S^T S & L \\ L^T & -D \end{bmatrix}^{-1}
              \begin{bmatrix} σ S^T v \\ Y^T v \end{bmatrix}

    Args:
        delta_ws: Model differences, 1-D tensors of length n.
        delta_gs: Matching gradient (or update) differences.
        v: The vector to multiply, length n.

    Returns:
        The estimate of ``H v`` (dtype of ``v``), computed in float64.
    """
    if len(delta_ws) != len(delta_gs) or not delta_ws:
        raise ValueError("lbfgs_hvp needs the same positive number of Δw and Δg vectors")
    s = torch.stack([d.reshape(-1) for d in delta_ws], 1).double()
    y = torch.stack([d.reshape(-1) for d in delta_gs], 1).double()
    x = v.reshape(-1).double()
    sy = s.T @ y
    ss = s.T @ s
    lower = torch.tril(sy, -1)
    sigma = (y[:, -1] @ s[:, -1]) / (s[:, -1] @ s[:, -1])
    mat = torch.cat(
        [torch.cat([sigma * ss, lower], 1), torch.cat([lower.T, -torch.diag(torch.diagonal(sy))], 1)]
    )
    rhs = torch.cat([sigma * (s.T @ x), y.T @ x])
    try:
        p = torch.linalg.solve(mat, rhs)
    except RuntimeError:  # singular (e.g. collinear pairs): least squares
        p = torch.linalg.lstsq(mat, rhs.unsqueeze(1)).solution.squeeze(1)
    out = sigma * x - torch.cat([sigma * s, y], 1) @ p
    return out.to(v.dtype).reshape(v.shape)


def curvature_ok(delta_w: Tensor, delta_u: Tensor, min_cosine: float) -> bool:
    """The curvature condition of a (Δw, Δu) pair: ``cos(Δw, -Δu) > min_cosine``.

    Model updates move against the gradient, so a pair consistent with a positive-definite
    Hessian has ``Δw^T Δu < 0``; pairs without it make the L-BFGS matrix indefinite.
    """
    denom = delta_w.norm() * delta_u.norm()
    return bool(denom > 0) and float(-(delta_w @ delta_u) / denom) > min_cosine


class FedRecover(HistoryFedAvg):
    """FedAvg storing all updates; unlearning recovers with exact and L-BFGS-estimated rounds.

    Args:
        rounds: Communication rounds.
        warmup_rounds: Exact rounds at the start of recovery.
        correction_period: After the warm-up, every ``correction_period``-th round is exact.
        final_tuning_rounds: Exact rounds at the end of recovery.
        buffer_size: (Δw, Δg) pairs per client kept for L-BFGS.
        min_cosine: A pair enters a client's buffer only if ``cos(Δw, -Δg) > min_cosine``
            (0: the L-BFGS curvature condition).
        clip_estimates: Shorten every Hessian-vector estimate to at most ``|ŵ_t - w_t|``.
        **kwargs: Local training settings, see :class:`~fedshard_lightning.unlearning.base.Algorithm`.
    """

    name = "fedrecover"
    exact = False

    def __init__(
        self,
        rounds: int = 20,
        warmup_rounds: int = 2,
        correction_period: int = 5,
        final_tuning_rounds: int = 2,
        buffer_size: int = 2,
        min_cosine: float = 0.0,
        clip_estimates: bool = True,
        **kwargs: Any,
    ) -> None:
        for key, val, low in (
            ("warmup_rounds", warmup_rounds, 0),
            ("correction_period", correction_period, 1),
            ("final_tuning_rounds", final_tuning_rounds, 0),
            ("buffer_size", buffer_size, 1),
        ):
            check_count(f"algorithm.{key}", val, low)
        super().__init__(rounds=rounds, keep_every=1, **kwargs)
        self.warmup_rounds = warmup_rounds
        self.correction_period = correction_period
        self.final_tuning_rounds = final_tuning_rounds
        self.buffer_size = buffer_size
        self.min_cosine = float(min_cosine)
        self.clip_estimates = bool(clip_estimates)

    def is_exact(self, t: int) -> bool:
        """Whether recovery round ``t`` asks the clients for exact updates."""
        return (
            t < self.warmup_rounds
            or t >= self.rounds - self.final_tuning_rounds
            or (t - self.warmup_rounds + 1) % self.correction_period == 0
        )

    def _flat(self, params: dict[str, Tensor], stacked: bool = False) -> Tensor:
        names = self.engine.names
        if stacked:
            n = params[names[0]].shape[0]
            return torch.cat([params[k].reshape(n, -1) for k in names], 1)
        return torch.cat([params[k].reshape(-1) for k in names])

    def _unflat(self, vec: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
        out, i = {}, 0
        for k in self.engine.names:
            n = like[k].numel()
            out[k] = vec[i : i + n].reshape(like[k].shape)
            i += n
        return out

    def _correction(self, buffer: deque[tuple[Tensor, Tensor]] | None, v: Tensor) -> Tensor | float:
        """The L-BFGS estimate of ``J v`` for one client, at most as long as ``v`` (0 without pairs)."""
        if not buffer:
            return 0.0
        hv = lbfgs_hvp([p[0] for p in buffer], [p[1] for p in buffer], v)
        if self.clip_estimates:
            norm, cap = hv.norm(), v.norm()
            if norm > cap:
                hv = hv * (cap / norm)
        return hv

    def plan_unlearn(self, state: PlanState, clients: Sequence[int]) -> list[StagePlan]:
        """The exact rounds on the remaining clients, from theta^0; then the closing plan."""
        rest = tuple(self.active(state, clients))
        exact = [t for t in range(self.rounds) if self.is_exact(t)]
        recovery = _Recovery(self, state, rest, exact)

        def init(k: int) -> Callable[[Sequence[TrainResult]], dict[str, Tensor]]:
            return lambda results: stack_params([recovery.model_before(k, results)])

        plans = [
            StagePlan(t, (Group(0, rest, 1),), init(k), keep_client_params=True) for k, t in enumerate(exact)
        ]
        return [*plans, self.closing_plan(init(len(exact)))]

    def unlearn_details(
        self, state: PlanState, new: PlanState, clients: Sequence[int], plans: Sequence[StagePlan]
    ) -> dict[str, Any]:
        """Which rounds asked the clients and which the server estimated."""
        return {
            "exact_rounds": [t for t in range(self.rounds) if self.is_exact(t)],
            "estimated_rounds": [t for t in range(self.rounds) if not self.is_exact(t)],
        }


class _Recovery:
    """The server's side of one FedRecover request: the model each plan starts from.

    Plan k (the k-th exact round, or the closing plan) starts from the model after the exact round
    before it (that plan's result), advanced through the estimated rounds in between with the
    clients' L-BFGS buffers. A buffer holds the (Δw, Δg) pairs of the exact rounds so far; each
    round's pairs are computed once per request, from its result, and kept here.

    Args:
        alg: The method.
        state: The state the request starts from (its history is the original training's).
        rest: The remaining clients.
        exact: The exact rounds, in order.
    """

    def __init__(self, alg: FedRecover, state: PlanState, rest: tuple[int, ...], exact: list[int]) -> None:
        self.alg, self.state, self.rest, self.exact = alg, state, set(rest), exact
        self.history = alg.history_of(state)
        self._pairs: dict[int, tuple[TrainResult, dict[int, tuple[Tensor, Tensor]]]] = {}

    def model_before(self, k: int, results: Sequence[TrainResult]) -> dict[str, Tensor]:
        """The model that plan ``k`` starts from, given the results of the plans before it."""
        alg = self.alg
        w_hat = dict(self.state.theta0) if k == 0 else unstack_params(results[k - 1].params, 0)
        buffers: dict[int, deque[tuple[Tensor, Tensor]]] = {}
        for i in range(k):
            for c, pair in self._pairs_of(i, results[i]).items():
                buffers.setdefault(c, deque(maxlen=alg.buffer_size)).append(pair)
        first = self.exact[k - 1] + 1 if k else 0
        last = self.exact[k] if k < len(self.exact) else alg.rounds
        for t in range(first, last):
            w_hat = self._estimated(t, w_hat, buffers)
        return w_hat

    def _pairs_of(self, i: int, res: TrainResult) -> dict[int, tuple[Tensor, Tensor]]:
        """The pairs that exact round ``exact[i]`` adds to the clients' buffers (curvature condition met)."""
        kept = self._pairs.get(i)
        if kept is not None and kept[0] is res:
            return kept[1]
        alg, pairs = self.alg, {}
        if res.history:
            w_bar, old = self.history.load(self.exact[i], alg.ctx.device)
            pos = {c: j for j, c in enumerate(self.history.participants[self.exact[i]])}
            ids, start, new = alg.client_updates(res)
            dw = alg._flat(start) - alg._flat(w_bar)
            if bool(dw.abs().max() > 0):
                new_flat, old_flat = alg._flat(new, stacked=True), alg._flat(old, stacked=True)
                for j, c in enumerate(ids):
                    if c in pos:
                        dg = new_flat[j] - old_flat[pos[c]]
                        if curvature_ok(dw, dg, alg.min_cosine):
                            pairs[c] = (dw, dg)
        self._pairs[i] = (res, pairs)
        return pairs

    def _estimated(
        self, t: int, w_hat: dict[str, Tensor], buffers: dict[int, deque[tuple[Tensor, Tensor]]]
    ) -> dict[str, Tensor]:
        """Round ``t`` estimated: each remaining participant's stored update, corrected by L-BFGS."""
        alg, device = self.alg, self.alg.ctx.device
        parts = self.history.participants[t]
        ids = [c for c in parts if c in self.rest]
        if not ids:
            return w_hat
        w_bar, old = self.history.load(t, device)
        pos = {c: i for i, c in enumerate(parts)}
        v = alg._flat(w_hat) - alg._flat(w_bar)
        old_flat = alg._flat(old, stacked=True)
        est = torch.stack([old_flat[pos[c]] + alg._correction(buffers.get(c), v) for c in ids])
        n = torch.as_tensor([float(alg.ctx.client_sizes[c]) for c in ids], dtype=torch.float64, device=device)
        weights = (n / n.sum()).to(est.dtype)
        new_w = alg._unflat(alg._flat(w_hat) + weights @ est, w_hat)
        rows = torch.as_tensor([pos[c] for c in ids], device=device)
        for k in alg.engine.buffer_names:  # BN statistics: no gradient to correct, stored updates
            upd = old[k].index_select(0, rows).reshape(len(ids), -1)
            new_w[k] = w_hat[k] + (weights.to(upd.dtype) @ upd).reshape(w_hat[k].shape)
        return new_w
