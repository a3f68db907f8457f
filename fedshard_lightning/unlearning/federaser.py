r"""FedEraser: unlearning by calibrated replay of retained client updates ("FE" in section 6).

Liu, Ma, Yang, Wang and Liu, "FedEraser: Enabling Efficient Client-Level Data Removal from
Federated Learning Models", IWQoS 2021, section IV (calibration training and update
calibration). During FedAvg training the server retains the clients' updates every ``delta_t``
rounds. To unlearn, it replays only those retained rounds, starting from the initial model: in
each, the remaining clients train from the current calibrated global model for ``calibration_ratio``
of their local epochs, and each client's new update keeps its *direction* but takes the old
update's *magnitude*,

.. math:: \tilde U_c = \lVert U_c \rVert \, \hat U_c / \lVert \hat U_c \rVert,

after which the calibrated updates are averaged (weighted by sample counts) into the global
model. One calibration round replaces ``delta_t`` training rounds, so the cost is about
``calibration_ratio / delta_t`` of retraining.

Choices and departures:

* Norms are per layer tensor (every weight and every bias separately), as in the authors' code
  (``unlearning_step_once`` normalises each ``state_dict`` entry). ``calibrate="mean"`` (default,
  the authors' code): the round's *average* new update takes the direction, the average retained
  update the magnitude. ``calibrate="client"`` (the paper's per-client formula above, our first
  implementation): every client's update is calibrated, then averaged. Averages are weighted by
  sample counts, as our FedAvg aggregates (the code averages clients equally).
* ``reuse_first_round=True`` (default, as the authors' code): retained round 0 started from
  theta^0, the same model the replay starts from, so the remaining clients' retained updates are
  exactly what they would compute again (keyed randomness); the replay averages them without
  training (no client-steps). ``False`` retrains round 0 with calibration (our first implementation).
* Calibration epochs are ``ceil(calibration_ratio * local_epochs)`` (the code's ``np.ceil``), or
  ``ceil(calibration_ratio * local_steps)`` when ``local_steps`` is set; at least 1. With
  ``local_epochs=1`` the ratio therefore saves nothing (a warning says so): use
  ``local_epochs >= 2`` or ``local_steps``.
* The retained rounds are ``0, delta_t, 2 delta_t, ...`` (0-based); a client's update is its
  model after the round minus the round's starting global model. Rounds whose participants all
  left are skipped. With ``client_fraction < 1`` a retained round is replayed with its original
  participants that remain.
* Which rounds, and the old update's reference, follow the paper, not the authors' public code
  (``Fed_Unlearn_base.py``, ``unlearning``): that code retains the client models of rounds
  ``delta_t - 1, 2 delta_t - 1, ...`` and subtracts from them the global model *after* their
  round (the equal-weight average they were aggregated into: for one removed client of N its
  "old update" is (remaining clients' mean - removed client's model) / N, not the update the
  paper calibrates), and its first step averages round ``delta_t - 1``'s models, which
  started from a model the leaving client had trained. The two agree only for ``delta_t = 1``
  in the first step; ours keep rounds ``0, delta_t, ...`` and subtract each round's start model.

Training is plain FedAvg, one plan (engine call) per round, the engine stage being the round
number: :class:`HistoryFedAvg` provides it for FedEraser and FedRecover alike, and keeps the
retained rounds in FLCache files, written as training goes and read back one round at a time, so
memory holds a single round of client updates. A request is a plan per calibrated round, on the
calibration engine, whose ``init`` computes the calibrated model of the round before it (the
server's work: reused round 0, rescaling, averaging), and a closing plan without training that
holds the last calibrated model.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, TrainResult, stack_params
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.unlearning.context import AlgorithmContext
from fedshard_lightning.unlearning.history import HistoryFedAvg
from fedshard_lightning.unlearning.planner import PlanState, StagePlan

__all__ = ["FedEraser", "calibrate_updates"]


def calibrate_updates(old: dict[str, Tensor], new: dict[str, Tensor], eps: float = 0.0) -> dict[str, Tensor]:
    """FedEraser's update calibration, per client and per layer tensor.

    Args:
        old: Retained updates, ``name -> [clients, ...]``.
        new: Calibration-training updates of the same clients, same shapes.
        eps: Added to the new updates' norms (0: a zero new update stays zero).

    Returns:
        ``|old_c| * new_c / |new_c|`` for every client c and tensor (Frobenius norms).
    """
    out = {}
    for k, u_new in new.items():
        n = u_new.shape[0]
        old_norm = old[k].reshape(n, -1).norm(dim=1)
        new_norm = u_new.reshape(n, -1).norm(dim=1) + eps
        scale = torch.where(new_norm > 0, old_norm / new_norm.clamp_min(torch.finfo(u_new.dtype).tiny), 0)
        out[k] = u_new * scale.view(n, *[1] * (u_new.ndim - 1)).to(u_new.dtype)
    return out


def weighted_mean(updates: dict[str, Tensor], weights: Tensor) -> dict[str, Tensor]:
    """Average of stacked updates ``[clients, ...]`` with the given (sample-count) weights."""
    w = weights / weights.sum()
    return {k: (v * w.to(v).view(-1, *[1] * (v.ndim - 1))).sum(0) for k, v in updates.items()}


class FedEraser(HistoryFedAvg):
    """FedAvg that retains updates every ``delta_t`` rounds; unlearning replays them calibrated.

    Args:
        rounds: Communication rounds.
        delta_t: Retention interval (rounds ``0, delta_t, 2 delta_t, ...`` are kept).
        calibration_ratio: Share of the local epochs (or steps) of calibration training, in (0, 1].
        calibrate: ``mean`` (calibrate the round's average update, the authors' code) or ``client``
            (calibrate each client's update, the paper's formula).
        reuse_first_round: Average the retained round-0 updates without retraining them (the
            authors' code); False retrains round 0.
        **kwargs: Local training settings, see :class:`~fedshard_lightning.unlearning.base.Algorithm`.
    """

    name = "federaser"
    exact = False

    def __init__(
        self,
        rounds: int = 20,
        delta_t: int = 2,
        calibration_ratio: float = 0.5,
        calibrate: Literal["mean", "client"] = "mean",
        reuse_first_round: bool = True,
        **kwargs: Any,
    ) -> None:
        if calibrate not in ("mean", "client"):
            raise ConfigError(
                f"algorithm.calibrate={calibrate!r}: choose mean (authors' code) or client (paper)"
            )
        self.calibrate = calibrate
        self.reuse_first_round = bool(reuse_first_round)
        if isinstance(delta_t, bool) or not isinstance(delta_t, int) or delta_t < 1:
            raise ConfigError(f"algorithm.delta_t={delta_t!r}: must be a positive integer")
        if not (isinstance(calibration_ratio, (int, float)) and 0 < calibration_ratio <= 1):
            raise ConfigError(f"algorithm.calibration_ratio={calibration_ratio!r}: must be in (0, 1]")
        super().__init__(rounds=rounds, keep_every=delta_t, **kwargs)
        self.delta_t = delta_t
        self.calibration_ratio = float(calibration_ratio)
        s = self.schedule
        if s.local_steps is not None:
            cal = LocalSchedule(
                s.batch_size, s.local_epochs, max(1, math.ceil(s.local_steps * self.calibration_ratio - 1e-9))
            )
            same = cal.local_steps == s.local_steps
        else:
            cal = LocalSchedule(
                s.batch_size, max(1, math.ceil(s.local_epochs * self.calibration_ratio - 1e-9))
            )
            same = cal.local_epochs == s.local_epochs
        if same and self.calibration_ratio < 1:
            warnings.warn(
                f"FedEraser: calibration_ratio={self.calibration_ratio} of local_epochs={s.local_epochs} "
                f"(local_steps={s.local_steps}) rounds up to the full local training; set local_epochs >= 2 "
                "or local_steps to make calibration cheaper",
                stacklevel=2,
            )
        self.calibration_schedule = cal
        self.calibration_engine: FederatedEngine | None = None

    def setup(self, ctx: AlgorithmContext) -> None:
        """Build the training engine and the calibration engine (shorter local training, all clients)."""
        super().setup(ctx)
        self.calibration_engine = ctx.make_engine(self.calibration_schedule, 1.0)

    def _replayed(self, state: PlanState, clients: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
        """Retained rounds with their original participants that remain (rounds none remains in are skipped)."""
        rest = set(self.active(state, clients))
        history = self.history_of(state)
        rounds = [(r, tuple(c for c in history.participants[r] if c in rest)) for r in history.rounds]
        return [(r, cl) for r, cl in rounds if cl]

    def _reused(self, r: int) -> bool:
        return self.reuse_first_round and r == 0

    def plan_unlearn(self, state: PlanState, clients: Sequence[int]) -> list[StagePlan]:
        """One calibration round per retained (and not reused) round, from theta^0; then the closing plan."""
        replayed = self._replayed(state, clients)
        reused = [(r, cl) for r, cl in replayed if self._reused(r)]
        calibrated = [(r, cl) for r, cl in replayed if not self._reused(r)]

        def init(j: int) -> Callable[[Sequence[TrainResult]], dict[str, Tensor]]:
            return lambda results: stack_params([self._model_before(state, reused, calibrated, j, results)])

        plans = [
            StagePlan(r, (Group(0, cl, 1),), init(j), engine=self.calibration_engine, keep_client_params=True)
            for j, (r, cl) in enumerate(calibrated)
        ]
        return [*plans, self.closing_plan(init(len(calibrated)))]

    def _model_before(
        self,
        state: PlanState,
        reused: list[tuple[int, tuple[int, ...]]],
        calibrated: list[tuple[int, tuple[int, ...]]],
        j: int,
        results: Sequence[TrainResult],
    ) -> dict[str, Tensor]:
        """The model that plan ``j`` starts from (the closing plan's: the unlearned model).

        The server's step after the plan before it: theta^0 plus the reused round-0 average for the
        first, else the previous calibration round's start plus its calibrated update.
        """
        if j == 0:
            w = dict(state.theta0)
            for r, cl in reused:  # round 0 from theta^0: the retained updates are the replay's own
                old, n = self._old_updates(state, r, list(cl))
                step = weighted_mean(old, n)
                w = {k: v + step[k] for k, v in w.items()}
            return w
        r = calibrated[j - 1][0]
        ids, w, new = self.client_updates(results[j - 1])
        old, n = self._old_updates(state, r, ids)
        if self.calibrate == "mean":
            mean_old, mean_new = weighted_mean(old, n), weighted_mean(new, n)
            step = {
                k: v[0]
                for k, v in calibrate_updates(
                    {k: v.unsqueeze(0) for k, v in mean_old.items()},
                    {k: v.unsqueeze(0) for k, v in mean_new.items()},
                ).items()
            }
        else:
            step = weighted_mean(calibrate_updates(old, new), n)
        return {k: v + step[k] for k, v in w.items()}

    def _old_updates(self, state: PlanState, r: int, ids: list[int]) -> tuple[dict[str, Tensor], Tensor]:
        """Round ``r``'s retained updates of ``ids`` (rows in that order) and their sample counts."""
        dev = self.ctx.device
        history = self.history_of(state)
        _, old = history.load(r, dev)
        pos = {c: i for i, c in enumerate(history.participants[r])}
        rows = torch.as_tensor([pos[c] for c in ids], device=dev)
        sizes = self.ctx.client_sizes
        n = torch.as_tensor([float(sizes[c]) for c in ids], dtype=torch.float64).to(dev)
        return {k: v.index_select(0, rows) for k, v in old.items()}, n

    def unlearn_details(
        self, state: PlanState, new: PlanState, clients: Sequence[int], plans: Sequence[StagePlan]
    ) -> dict[str, Any]:
        """The calibrated and the reused rounds, and the calibration's local training."""
        replayed = self._replayed(state, clients)
        return {
            "calibrated_rounds": [r for r, _ in replayed if not self._reused(r)],
            "reused_rounds": [r for r, _ in replayed if self._reused(r)],
            "calibration_local_epochs": self.calibration_schedule.local_epochs,
            "calibration_local_steps": self.calibration_schedule.local_steps,
        }
