r"""Fairness of every run: M_e from the exact predicted unlearning costs, M_p when its replay fits a budget.

FedShard paper section 5 (eq. 6 and 7), made precise by SPEC sections 4 and 8. At the end of
``fit``, and again after every ``unlearn`` for the clients that remain, :class:`FairnessLogger`:

* probes the client alphas: one round of every present client from the current model
  (:func:`~fedshard_lightning.metrics.client_alpha.client_alphas`);
* predicts ``Z_c``, the cost of unlearning client ``c`` alone, under every cost model in
  :data:`COST_MODELS` (exact and free: a walk over the plans, nothing is trained), and logs
  ``M_e`` of each (``fairness/M_e_steps``, ...) with the costs' mean, std, min and max;
* replays every present client's single-client request with the pure ``what_if`` to measure
  ``M_p`` (the mean over requests of ``M_p({c})``, as :class:`~fedshard_lightning.callbacks.UnlearningReplay`
  reports it), but only when the replay's predicted client-steps fit ``replay_budget`` times the
  fit's and, at the fit's measured client-steps per second, ``replay_budget_s`` seconds. The
  prediction is printed first; past a budget one line says so and ``fairness/M_p_skipped`` is 1.
  So the digits quickstart gets M_p in a few seconds, and a CIFAR-100 fit of ten minutes on a GPU
  does not spend two hours more on it unless asked.

Scalars go to every logger (CSV, W&B, TensorBoard) prefixed ``fairness/``; W&B also gets a table
of the per-client costs (``fairness/clients``), a histogram of each cost model's ``Z_c``
(``fairness/Z_<model>``) and the summary. Nothing of the run changes: the model, the cache and
the request log are those the loop wrote.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.task_progress import TaskProgress
from fedshard_lightning.callbacks.view import RunView
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.loggers.run_loggers import log_wandb_report
from fedshard_lightning.metrics.client_alpha import client_alphas, per_client_accuracy
from fedshard_lightning.metrics.fairness import efficiency_fairness, performance_fairness
from fedshard_lightning.metrics.fairness_report import cost_stats

__all__ = ["COST_MODELS", "FairnessLogger", "FairnessResult", "predicted_costs"]

CostModel = Callable[[Any, Sequence[int]], float]

COST_MODELS: dict[str, CostModel] = {
    "steps": lambda algorithm, clients: float(algorithm.predict_cost(clients)),
}
"""Cost model name -> predicted cost of one request (``algorithm, clients``), exact before running.

``steps``: client-steps, the sum over every retrained round of the participants' local steps
(SPEC section 8). A cost model added here (the latency of SPEC section 8, once the algorithms
predict it) is logged as ``fairness/M_e_<name>`` and gets its own table column and histogram.
"""


def predicted_costs(algorithm: Any, clients: Sequence[int]) -> dict[str, list[float]]:
    """``Z_c`` of every client in ``clients`` leaving alone, under every cost model."""
    return {name: [model(algorithm, [c]) for c in clients] for name, model in COST_MODELS.items()}


@dataclass
class FairnessResult:
    """What one evaluation found, for the clients present at that point.

    Attributes:
        clients: The present clients, in order.
        alphas: Their probed alphas.
        costs: Cost model -> their predicted ``Z_c``.
        m_e: Cost model -> M_e of those costs.
        replay_client_steps: Predicted client-steps of replaying every single-client request.
        budget_client_steps: Client-steps the replay was allowed.
        m_p: Mean of the requests' M_p, or None when the replay was skipped.
        m_p_request: Client -> M_p of the request that unlearns it alone (empty when skipped).
    """

    clients: list[int]
    alphas: list[float]
    costs: dict[str, list[float]]
    m_e: dict[str, float]
    replay_client_steps: float
    budget_client_steps: float
    m_p: float | None
    m_p_request: dict[int, float]

    @property
    def m_p_skipped(self) -> bool:
        """True when the replay's predicted cost exceeded the budget."""
        return self.m_p is None

    def scalars(self) -> dict[str, float]:
        """The ``fairness/...`` scalars every logger receives."""
        out: dict[str, float] = {"fairness/num_clients": float(len(self.clients))}
        for name, values in self.costs.items():
            out[f"fairness/M_e_{name}"] = self.m_e[name]
            stats = cost_stats(values)
            for stat in ("mean", "std", "min", "max"):
                out[f"fairness/Z_{name}_{stat}"] = float(stats[stat])
        out["fairness/alpha_abs_mean"] = sum(abs(a) for a in self.alphas) / len(self.alphas)
        out["fairness/replay_client_steps"] = self.replay_client_steps
        out["fairness/M_p_skipped"] = float(self.m_p_skipped)
        if self.m_p is not None:
            out["fairness/M_p"] = self.m_p
        return out

    def table(self, sizes: Sequence[int]) -> tuple[list[str], list[list[Any]]]:
        """Per-client columns and rows: client, samples, alpha, one ``Z_<model>`` per cost model, ``M_p_request``."""
        columns = ["client", "n_samples", "alpha", *(f"Z_{n}" for n in self.costs), "M_p_request"]
        rows = [
            [
                c,
                int(sizes[c]),
                self.alphas[i],
                *(values[i] for values in self.costs.values()),
                self.m_p_request.get(c),
            ]
            for i, c in enumerate(self.clients)
        ]
        return columns, rows


def _env_budget() -> float:
    """``FEDSHARD_REPLAY_BUDGET_S`` as seconds, 120 when unset; a bad value is one line naming it."""
    raw = os.environ.get("FEDSHARD_REPLAY_BUDGET_S", "").strip()
    if not raw:
        return 120.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"FEDSHARD_REPLAY_BUDGET_S={raw!r}: give a number of seconds >= 0")
    return value


class FairnessLogger(FederatedCallback):
    """Logs M_e (every run) and M_p (when its replay fits the budget) after ``fit`` and after every ``unlearn``.

    On by default (``trainer.enable_fairness``); list one in ``trainer.callbacks`` to configure it.

    Args:
        replay_budget: Most client-steps the M_p replay may spend, as a multiple of the fit's
            client-steps (FedShard on configs/digits.yaml needs 12.3); 0 never replays.
        replay_budget_s: Most seconds the replay may take, predicted at the fit's measured
            client-steps per second; ``None``: no limit in seconds. By default
            ``FEDSHARD_REPLAY_BUDGET_S`` from the environment (so a whole test suite or a batch of
            runs can set it once, in every process), else 120.
        eps_alpha: Floor of ``|alpha_c|`` in M_e.
        eps0: Offset of the M_p normalisation.
        eps1: Added to the range of the M_p normalisation.
    """

    def __init__(
        self,
        replay_budget: float = 16.0,
        replay_budget_s: float | str | None = "env",
        eps_alpha: float = 1e-6,
        eps0: float = 0.01,
        eps1: float = 1e-12,
    ) -> None:
        if not (
            isinstance(replay_budget, (int, float)) and math.isfinite(replay_budget) and replay_budget >= 0
        ):
            raise ConfigError(f"FairnessLogger.replay_budget={replay_budget!r}: give a finite number >= 0")
        for name, value in (("eps_alpha", eps_alpha), ("eps0", eps0), ("eps1", eps1)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"FairnessLogger.{name}={value!r}: must be a positive number")
        if replay_budget_s == "env":  # FEDSHARD_REPLAY_BUDGET_S, else two minutes
            replay_budget_s = _env_budget()
        if replay_budget_s is not None and not (
            isinstance(replay_budget_s, (int, float))
            and math.isfinite(replay_budget_s)
            and replay_budget_s >= 0
        ):
            raise ConfigError(
                f"FairnessLogger.replay_budget_s={replay_budget_s!r}: give a finite number >= 0, or null"
            )
        self.replay_budget = float(replay_budget)
        self.replay_budget_s = None if replay_budget_s is None else float(replay_budget_s)
        self._rate: float | None = None  # the fit's client-steps per second
        self.eps_alpha, self.eps0, self.eps1 = float(eps_alpha), float(eps0), float(eps1)
        self.result: FairnessResult | None = None

    # -- hooks -----------------------------------------------------------------------------------
    def on_fit_end(self, run: RunView, metrics: dict[str, float]) -> None:
        """Evaluate the fitted run; logged at the step of the ``final/`` row."""
        steps, seconds = metrics.get("client_steps"), metrics.get("seconds")
        if steps and seconds:
            self._rate = float(steps) / float(seconds)
        self.result = self.evaluate(run)
        self._log(run, run.log_step_start + len(run.history))

    def on_unlearn_end(self, run: RunView, report: dict[str, Any]) -> None:
        """Evaluate the clients that remain; logged at the request's step."""
        if self._rate is None:  # the fit ran in another process: its speed is in RUN/metrics.json
            try:
                fit = json.loads((Path(run.run_dir) / "metrics.json").read_text())
                self._rate = float(fit["client_steps"]) / float(fit["seconds"])
            except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
                self._rate = None
        self.result = self.evaluate(run)
        self._log(run, run.log_step_start)

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, run: RunView) -> FairnessResult:
        """Alphas, predicted costs, M_e and (within budget) M_p of the present clients.

        Every process computes it (the replay's retraining is distributed like any other); only
        the first one prints and logs.
        """
        alg = run.algorithm
        clients = list(alg.active_clients)
        reference = {n: v.detach().clone() for n, v in alg.current_params().items()}
        alphas = (
            client_alphas(alg, reference, clients).cpu() if len(clients) > 1 else torch.zeros(len(clients))
        )
        costs = predicted_costs(alg, clients)
        m_e = {
            name: float(
                efficiency_fairness(torch.tensor(values, dtype=torch.float64), alphas, self.eps_alpha)
            )
            for name, values in costs.items()
        }
        replay = sum(costs["steps"])
        budget = self.replay_budget * float(alg.total_client_steps)
        m_p, per_request = None, {}
        if len(clients) < 2:
            self._say(run, "fairness: M_p skipped: it needs two clients or more")
        elif replay > budget:
            self._say(
                run,
                f"fairness: M_p skipped: replaying {len(clients)} single-client requests would take "
                f"{replay:,.0f} client-steps ({_times(replay, alg)} the fit's), over "
                f"FairnessLogger.replay_budget={self.replay_budget:g}",
            )
        elif self.replay_budget_s is not None and self._rate and replay / self._rate > self.replay_budget_s:
            self._say(
                run,
                f"fairness: M_p skipped: replaying {len(clients)} single-client requests would take "
                f"about {replay / self._rate:,.0f} s at the fit's {self._rate:,.1f} client-steps/s, over "
                f"FairnessLogger.replay_budget_s={self.replay_budget_s:g} (raise it to measure M_p)",
            )
        else:
            self._say(
                run,
                f"fairness: M_p replays {len(clients)} single-client requests: {replay:,.0f} client-steps "
                f"predicted ({_times(replay, alg)} the fit's; FairnessLogger.replay_budget={self.replay_budget:g})",
            )
            per_request = self._replay(run, clients, alphas, replay)
            m_p = sum(per_request.values()) / len(per_request)
        return FairnessResult(clients, alphas.tolist(), costs, m_e, replay, budget, m_p, per_request)

    def _replay(self, run: RunView, clients: list[int], alphas: Tensor, total: float) -> dict[int, float]:
        """M_p of every single-client request among ``clients``, from the current state (nothing is committed)."""
        alg, module, dm = run.algorithm, run.module, run.datamodule
        state = alg.state_dict()
        before = per_client_accuracy(module, alg.current_params(), dm)[clients]
        shown = run.is_global_zero and run.show_progress
        progress = TaskProgress("fairness", total) if shown else None
        out: dict[int, float] = {}
        for i, c in enumerate(clients):
            _, result = alg.what_if(state, [c])
            after = per_client_accuracy(module, result.params, dm)[clients]
            leaving = torch.zeros(len(clients), dtype=torch.bool)
            leaving[i] = True
            drop = torch.nan_to_num((before - after).double(), nan=0.0)
            out[c] = float(performance_fairness(drop, alphas, leaving, self.eps0, self.eps1))
            if progress is not None:
                progress.update(result.client_steps, f"request {i + 1}/{len(clients)} (client {c})")
        if progress is not None:
            progress.close()
        return out

    # -- output ----------------------------------------------------------------------------------
    @staticmethod
    def _say(run: RunView, line: str) -> None:
        run.print(line)

    def _log(self, run: RunView, step: int) -> None:
        result = self.result
        if result is None or not run.is_global_zero:
            return
        scalars = result.scalars()
        summary: dict[str, Any] = {k.removeprefix("fairness/"): v for k, v in scalars.items()}
        if result.m_p_skipped:
            summary["M_p"] = "skipped"
        # The table and histograms join the scalars' W&B row: one W&B row per CSV row, as every logged row.
        log_wandb_report(
            run.loggers,
            "fairness",
            {"clients": result.table(run.client_sizes)},
            {},
            summary,
            histograms={f"Z_{name}": values for name, values in result.costs.items()},
            commit=False,
        )
        run.log(scalars, step=step)


def _times(client_steps: float, alg: Any) -> str:
    """``12.3x``: client-steps as a multiple of the fit's."""
    fit = float(alg.total_client_steps)
    return f"{client_steps / fit:.1f}x" if fit > 0 else "n/a"
