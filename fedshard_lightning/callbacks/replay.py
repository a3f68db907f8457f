r"""Unlearning replay after ``fit``: per-client unlearning costs, M_e, M_p, MIA F1, plots, W&B report.

FedShard paper section 5 (fairness metrics) and section 6 / Appendix G (evaluation), made precise
by SPEC sections 4, 8 and 10. At the end of ``fit`` :class:`UnlearningReplay` asks, for every
client ``c``, "what would it cost to unlearn ``c`` alone?":

* ``mode="predicted"``: ``Z_c`` = ``algorithm.predict_cost([c])`` client-steps, for every client,
  without training (cheap: a walk over the frozen tree / the round schedule).
* ``mode="measured"``: every client of the sample is unlearned alone with the pure
  ``algorithm.what_if(state, [c])`` (seconds and client-steps recorded), from the fitted state;
  nothing of the run (algorithm state, model file, cache, request log) changes.

What "after" means for M_p (our reading of the paper, documented in ``docs/fairness.md``):
the paper defines ``M_p`` for *one* unlearning request that splits the clients into leaving
``C_L`` and remaining ``C_R``, as a mean over *all* clients ``c`` of
``f(DeltaY(D_c), min_{c_r in C_R} Dis(c, c_r))``. Applied to "each client leaves alone", every
single-client request ``{l}`` is such an event: ``DeltaY(D_c)`` is the accuracy on ``c``'s data of
the fitted model minus that of **the model after unlearning ``l`` alone**, for every client ``c``
(the leaving one and all remaining ones), with leaving mask ``{l}``. That gives one
``M_p({l})`` per measured request; ``summary["M_p"]`` is their mean (``M_p_median`` their median,
the statistic the paper reports over repetitions). In ``clients.csv``, ``acc_after`` and
``delta_acc`` of client ``c`` are those of the model after unlearning ``c`` itself (how much it
was forgotten), and ``M_p_request`` is ``M_p({c})``.

Client alphas (SPEC section 4): one probe round of every client from the fitted model,
:func:`~fedshard_lightning.metrics.client_alpha.client_alphas`.

``M_e`` (SPEC section 8) is computed with the costs in seconds when measured (``M_e_seconds``),
in client-steps always (``M_e_steps``, deterministic) and in latency steps for every client where
the method predicts it (``M_e_latency``: each retrained round costs its slowest participant's
steps, :meth:`~fedshard_lightning.unlearning.Algorithm.predict_latency`); ``summary["M_e"]`` is the
seconds version in measured mode and the client-step version in predicted mode.

Membership inference (SPEC section 10, :mod:`fedshard_lightning.metrics.mia`): see
:class:`~fedshard_lightning.metrics.membership.MembershipAudit`. Per-request drops and M_p come
from :func:`~fedshard_lightning.metrics.fairness_report.fairness_report`, the same function the
cascade and poisoning experiments use; the plots from :mod:`fedshard_lightning.callbacks.plots`.
``mia_f1_before`` / ``mia_auc_before`` score the fitted model on the evaluated clients' data;
``mia_f1_after`` / ``mia_auc_after`` pool, over the measured requests, the model after
unlearning ``c`` on ``c``'s data (AUC 0.5: the attack has no power, whatever its threshold).

Files written into ``RUN/fairness/``: ``clients.csv``, ``summary.json``,
``cost_distribution.png``, ``round_accuracy.png``.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.plots import plot_cost_distribution, plot_round_accuracy
from fedshard_lightning.callbacks.task_progress import TaskProgress
from fedshard_lightning.callbacks.view import RunView
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.loggers.run_loggers import log_wandb_report
from fedshard_lightning.metrics.client_alpha import checked_alphas, client_alphas, per_client_accuracy
from fedshard_lightning.metrics.fairness import efficiency_fairness
from fedshard_lightning.metrics.fairness_report import cost_stats, fairness_report, json_safe
from fedshard_lightning.metrics.membership import MembershipAudit

__all__ = [
    "CLIENT_COLUMNS",
    "MembershipAudit",
    "UnlearningReplay",
    "plot_cost_distribution",
    "plot_round_accuracy",
]

CLIENT_COLUMNS = (
    "client",
    "n_samples",
    "alpha",
    "Z_steps",
    "Z_steps_predicted",
    "Z_latency",
    "Z_seconds",
    "acc_before",
    "acc_after",
    "delta_acc",
    "M_p_request",
    "measured",
)
"""Columns of ``fairness/clients.csv`` (and of the W&B table)."""


def latencies(alg: Any, clients: Sequence[int]) -> dict[int, int]:
    """``predict_latency([c])`` of every client; empty for a method that does not predict latency."""
    try:
        return {c: int(alg.predict_latency([c])) for c in clients}
    except NotImplementedError:
        return {}


@dataclass
class _Measured:
    """What the measured requests gave, by client."""

    z_steps: dict[int, int] = field(default_factory=dict)
    z_sec: dict[int, float] = field(default_factory=dict)
    acc_after: dict[int, float] = field(default_factory=dict)
    mp_request: dict[int, float] = field(default_factory=dict)
    drop_remaining: list[float] = field(default_factory=list)
    after_logits: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    test_after: list[float] = field(default_factory=list)


def _retrain_cost(alg: Any, client: int) -> int | None:
    """Client-steps of retraining from scratch without one client, when the algorithm says."""
    try:
        return int(alg.retrain_cost([client]))
    except NotImplementedError:
        return None


class UnlearningReplay(FederatedCallback):
    """After ``fit``: unlearning cost of every client, M_e, M_p, MIA F1, CSV/JSON/PNG and W&B report.

    Args:
        mode: ``predicted`` (``Z_c`` from ``predict_cost``, nothing is trained) or ``measured``
            (every client of the sample is unlearned alone, timed, and the run's state restored).
        clients: Clients considered (default: all). M_e and the table cover these; M_p is always
            a mean over all clients of the partition (the paper's definition).
        sample: In measured mode, unlearn only this many clients of ``clients`` (seeded choice);
            ``None`` unlearns all of them. In predicted mode it selects the MIA's evaluated clients.
        seed: Seed of the sample and of the membership-inference attack.
        mia: Run the membership-inference attack.
        eps_alpha: Floor of ``|alpha_c|`` in M_e.
        eps0: Offset of the M_p normalisation.
        eps1: Added to the range of the M_p normalisation.
        holdout: Measure ``Y(D_c)`` on each client's held-out samples (needs the datamodule's
            ``holdout_fraction > 0``) instead of its training samples.
        mia_classifier: Attack model of the MIA.
        plots: Write the two PNG plots (and send them to W&B).
        alphas: Client alphas to use, one per client of the partition, instead of probing this
            run's fitted model: methods compared side by side share one reference (SPEC section
            4; :func:`~fedshard_lightning.experiments.compare.compare` passes the first method's).
            After a run, :attr:`alphas_used` holds the alphas it used.
    """

    def __init__(
        self,
        mode: Literal["predicted", "measured"] = "predicted",
        clients: list[int] | None = None,
        sample: int | None = None,
        seed: int = 0,
        mia: bool = True,
        eps_alpha: float = 1e-6,
        eps0: float = 0.01,
        eps1: float = 1e-12,
        holdout: bool = False,
        mia_classifier: Literal[
            "gradient_boosting", "logistic", "mlp", "random_forest"
        ] = "gradient_boosting",
        plots: bool = True,
        alphas: Sequence[float] | None = None,
    ) -> None:
        if mode not in ("predicted", "measured"):
            raise ConfigError(f"UnlearningReplay.mode={mode!r}: choose predicted or measured")
        if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 1):
            raise ConfigError(f"UnlearningReplay.sample={sample!r}: must be a positive integer or null")
        for name, value in (("eps_alpha", eps_alpha), ("eps0", eps0), ("eps1", eps1)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"UnlearningReplay.{name}={value!r}: must be a positive number")
        self.mode = mode
        self.clients = None if clients is None else [int(c) for c in clients]
        self.sample = sample
        self.seed = int(seed)
        self.mia = bool(mia)
        self.eps_alpha, self.eps0, self.eps1 = float(eps_alpha), float(eps0), float(eps1)
        self.holdout = bool(holdout)
        self.mia_classifier = mia_classifier
        self.plots = bool(plots)
        self.alphas = None if alphas is None else checked_alphas(alphas, "UnlearningReplay.alphas")
        self.alphas_used: Tensor | None = None
        self.summary: dict[str, Any] | None = None
        self.rows: list[dict[str, Any]] = []

    # -- hook ------------------------------------------------------------------------------------
    def on_fit_end(self, run: RunView, metrics: dict[str, float]) -> None:
        """Replay, write the files and report (rank zero only)."""
        if not run.is_global_zero:
            return
        self.run(run, metrics)

    # -- the replay ------------------------------------------------------------------------------
    def _population(self, alg: Any) -> list[int]:
        k = alg.num_clients
        pop = alg.active_clients if self.clients is None else sorted(set(self.clients))
        bad = [c for c in pop if not 0 <= c < k]
        if bad:
            raise ConfigError(f"UnlearningReplay.clients: unknown client ids {bad} (valid ids: 0..{k - 1})")
        if not pop:
            raise ConfigError("UnlearningReplay.clients: no client to evaluate")
        return pop

    def _sampled(self, population: list[int]) -> list[int]:
        if self.sample is None or self.sample >= len(population):
            return list(population)
        rng = np.random.default_rng(self.seed)
        return sorted(int(c) for c in rng.choice(population, size=self.sample, replace=False))

    def run(self, view: RunView, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """Compute everything, write ``run_dir/fairness/*`` and log; returns the summary."""
        t_start = time.perf_counter()
        alg, dm, module = view.algorithm, view.datamodule, view.module
        k = alg.num_clients
        population = self._population(alg)
        chosen = self._sampled(population)
        measured = self.mode == "measured"
        split = "holdout" if self.holdout else "train"

        reference = {n: v.detach().clone() for n, v in alg.current_params().items()}
        t = time.perf_counter()
        if self.alphas is None:
            alphas = client_alphas(alg, reference).cpu()
        elif len(self.alphas) != k:
            raise ConfigError(
                f"UnlearningReplay.alphas: {len(self.alphas)} values for {k} clients; give one per client"
            )
        else:
            alphas = self.alphas
        self.alphas_used = alphas
        probe_seconds = time.perf_counter() - t
        acc_before = per_client_accuracy(module, reference, dm, split)
        sizes = dm.client_sizes
        z_pred = {c: int(alg.predict_cost([c])) for c in population}
        z_lat = latencies(alg, population)

        audit = None
        if self.mia:
            audit = MembershipAudit(module, dm, reference, chosen, self.seed, self.mia_classifier)
        f1_before, auc_before = audit.scores(reference) if audit is not None else (None, None)

        m = self._measure(view, chosen, acc_before, alphas, audit, split) if measured else _Measured()
        z_steps, z_sec, acc_after, mp_request = m.z_steps, m.z_sec, m.acc_after, m.mp_request
        has_after = audit is not None and m.after_logits
        f1_after, auc_after = audit.pooled_scores(m.after_logits) if has_after else (None, None)

        pop_alpha = alphas[population]
        me_clients = chosen if measured else population
        me_steps = self._me([z_steps[c] if measured else z_pred[c] for c in me_clients], alphas[me_clients])
        me_pred = self._me([z_pred[c] for c in population], pop_alpha)
        me_sec = self._me([z_sec[c] for c in chosen], alphas[chosen]) if z_sec else None
        me_lat = self._me([z_lat[c] for c in population], pop_alpha) if z_lat else None

        self.rows = []
        for c in population:
            before = float(acc_before[c])
            after_c = acc_after.get(c)
            self.rows.append(
                {
                    "client": c,
                    "n_samples": int(sizes[c]),
                    "alpha": float(alphas[c]),
                    "Z_steps": z_steps.get(c, z_pred[c]),
                    "Z_steps_predicted": z_pred[c],
                    "Z_latency": z_lat.get(c),
                    "Z_seconds": z_sec.get(c),
                    "acc_before": before,
                    "acc_after": after_c,
                    "delta_acc": (before - after_c) if after_c is not None else None,
                    "M_p_request": mp_request.get(c),
                    "measured": c in z_steps,
                }
            )

        st_steps = cost_stats([z_steps[c] for c in chosen] if z_steps else list(z_pred.values()))
        st_pred = cost_stats(list(z_pred.values()))
        st_sec = cost_stats(list(z_sec.values()))
        mp_values = list(mp_request.values())
        leaving_drop = [r["delta_acc"] for r in self.rows if r["delta_acc"] is not None]
        summary: dict[str, Any] = {
            "mode": self.mode,
            "algorithm": alg.name,
            "num_clients": k,
            "clients_evaluated": len(population),
            "clients_unlearned": len(z_steps),
            "M_e": me_sec if measured else me_steps,
            "M_e_steps": me_steps,
            "M_e_steps_predicted": me_pred,
            "M_e_latency": me_lat,
            "M_e_seconds": me_sec,
            "M_p": (sum(mp_values) / len(mp_values)) if mp_values else None,
            "M_p_median": statistics.median(mp_values) if mp_values else None,
            "mia_f1_before": f1_before,
            "mia_f1_after": f1_after,
            "mia_f1": f1_after if f1_after is not None else f1_before,
            "mia_auc_before": auc_before,
            "mia_auc_after": auc_after,
            "unlearn_seconds_mean": st_sec["mean"],
            "unlearn_seconds_var": st_sec["var"],
            "unlearn_seconds_std": st_sec["std"],
            "unlearn_client_steps_mean": st_steps["mean"],
            "unlearn_client_steps_var": st_steps["var"],
            "unlearn_client_steps_std": st_steps["std"],
            "unlearn_client_steps_min": st_steps["min"],
            "unlearn_client_steps_max": st_steps["max"],
            "predicted_client_steps_mean": st_pred["mean"],
            "predicted_client_steps_var": st_pred["var"],
            "retrain_client_steps": _retrain_cost(alg, population[0]),
            "fit_client_steps": int(getattr(alg, "total_client_steps", 0)),
            "alpha_abs_mean": float(pop_alpha.abs().mean()),
            "acc_before_mean": float(torch.nan_to_num(acc_before[population]).mean()),
            "delta_acc_leaving_mean": (sum(leaving_drop) / len(leaving_drop)) if leaving_drop else None,
            "delta_acc_remaining_mean": cost_stats(m.drop_remaining)["mean"],
            "test_accuracy": (metrics or {}).get("test_accuracy"),
            "test_accuracy_after_mean": cost_stats(m.test_after)["mean"],
            "probe_seconds": probe_seconds,
            "accuracy_split": split,
            "eps_alpha": self.eps_alpha,
            "eps0": self.eps0,
            "eps1": self.eps1,
        }
        summary["replay_seconds"] = time.perf_counter() - t_start
        self.summary = json_safe(summary)
        self._write(view)
        return self.summary

    def _measure(
        self, run: RunView, chosen: list[int], acc_before: Tensor, alphas: Tensor, audit: Any, split: str
    ) -> _Measured:
        """Unlearn every chosen client alone with ``what_if`` from the fitted state (progress in client-steps)."""
        alg, module, dm = run.algorithm, run.module, run.datamodule
        out, fitted = _Measured(), alg.state_dict()
        shown = run.is_global_zero and run.show_progress
        progress = TaskProgress("replay", sum(alg.predict_cost([c]) for c in chosen)) if shown else None
        for i, c in enumerate(chosen, start=1):
            _, res = alg.what_if(fitted, [c])
            if progress is not None:
                progress.update(res.client_steps, f"request {i}/{len(chosen)} (client {c})")
            out.z_steps[c], out.z_sec[c] = int(res.client_steps), float(res.seconds)
            after = per_client_accuracy(module, res.params, dm, split)
            out.acc_after[c] = float(after[c])
            if alg.num_clients > 1:
                report = fairness_report(acc_before, after, alphas, [c], self.eps0, self.eps1)
                out.mp_request[c] = report["M_p"]
                out.drop_remaining.append(report["remaining"]["mean"] or 0.0)
            if audit is not None:
                out.after_logits.append(audit.logits(res.params, [c]))
            out.test_after.append(run.evaluate(res.params)[0])
        if progress is not None:
            progress.close()
        return out

    def _me(self, costs: Sequence[float], alphas: Tensor) -> float:
        """M_e of the given costs."""
        return float(
            efficiency_fairness(
                torch.tensor([float(c) for c in costs], dtype=torch.float64), alphas, self.eps_alpha
            )
        )

    # -- output ----------------------------------------------------------------------------------
    def _write(self, run: RunView) -> None:
        if run.run_dir is None:
            return
        out = Path(run.run_dir) / "fairness"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "clients.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(CLIENT_COLUMNS))
            writer.writeheader()
            for row in self.rows:
                writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
        (out / "summary.json").write_text(json.dumps(self.summary, indent=2, allow_nan=False) + "\n")
        plots: dict[str, Path] = {}
        if self.plots:
            costs = {
                "client-steps": [r["Z_steps"] for r in self.rows if r["measured"] or self.mode == "predicted"]
            }
            secs = [r["Z_seconds"] for r in self.rows if r["Z_seconds"] is not None]
            if secs:
                costs["seconds"] = secs
            alpha_rows = [r for r in self.rows if r["measured"] or self.mode == "predicted"]
            name = f"{run.algorithm.name}, {self.mode}"
            plots["cost_distribution"] = plot_cost_distribution(
                costs,
                out / "cost_distribution.png",
                alphas=[r["alpha"] for r in alpha_rows],
                alpha_costs=[r["Z_steps"] for r in alpha_rows],
                title=f"Unlearning cost per client ({name})",
            )
            plots["round_accuracy"] = plot_round_accuracy(
                run.history, out / "round_accuracy.png", title=f"Global model accuracy ({name})"
            )
        self._log(run, plots)

    def _log(self, run: RunView, plots: dict[str, Path]) -> None:
        scalars = {
            f"fairness/{k}": float(v)
            for k, v in self.summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        run.log(scalars, step=len(run.history))
        table = [[row[c] for c in CLIENT_COLUMNS] for row in self.rows]
        log_wandb_report(
            run.loggers,
            "fairness",
            {"clients": (CLIENT_COLUMNS, table)},
            plots,
            self.summary,
            headline=("M_e", "M_p", "mia_f1", "unlearn_seconds_mean"),
        )
