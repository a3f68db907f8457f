r"""Cascaded leaving (FedShard paper, Appendix G.5; SPEC section 10).

Setting ("two label partitions"): the data is split by labels into two halves; with
``label_split_fraction = 0.75`` and 64 clients, 48 clients hold data of the first half of the
labels (the majority) and 16 the other half (the minority), IID inside each group
(:func:`~fedshard_lightning.data.partition.label_split_partition`; the majority group is
clients ``0..47``).

Protocol, for every method (FedShard by default, and FedAvg retraining; any
:class:`~fedshard_lightning.unlearning.Algorithm` works):

1. Train on all clients; ``Y_c`` = accuracy of the trained model on client ``c``'s data.
2. ``initial_leavers`` (5) clients drawn (seeded, the same for every method) from the minority
   leave: one unlearning request.
3. Every remaining client ``r`` compares its payoffs (paper G.5):
   staying ``W^k = -DeltaY_r - Z``, leaving ``W^l = -Y*``; it leaves iff ``W^k < W^l``, i.e.
   ``DeltaY_r > Y* - Z``.
4. The clients that decided to leave are unlearned together (one request) and step 3 repeats
   with the new model, until nobody leaves. At ``max_iterations`` cascade steps it stops: the
   clients that decided to leave in the last step count as cascaded leavers (not unlearned), and
   ``stopped_at_max_iterations`` says the cascade was cut.

Our readings, where the paper leaves quantities undefined (also in ``docs/fairness.md``):

* ``DeltaY_r``: accuracy on ``r``'s local data (training samples, or its held-out samples with
  ``holdout: true``) of the model before the latest request minus after it, as a fraction in
  ``[0, 1]``. The payoff compares staying vs leaving *now*, so earlier drops (already accepted)
  are not counted again.
* ``Z``: the cost of the latest request to the system, normalised by the cost of the original
  training so that it is unit-free like an accuracy: ``Z = cost_weight * cost(request) /
  cost(fit)``, with cost in client-steps (deterministic, default) or seconds. ``cost_weight`` is
  the accuracy drop a client would accept to avoid one full retraining (default 0.01: a full
  retraining weighs like one accuracy point). The paper reports unlearning time; it gives no
  normalisation, and an unnormalised time in seconds cannot be subtracted from an accuracy.
* ``Y*``: not defined in the paper. We read it as the client's *reservation* loss: what it is
  ready to lose before leaving beats staying (its outside option). A constant per experiment,
  ``y_star`` (default 0.1, ten accuracy points). It must exceed the accuracy granularity of one
  client's data: with 64 Digits clients a majority client holds about 15 samples, so one sample
  flipping by chance is 6.7 points; with ``y_star = 0.05`` that noise alone makes clients leave
  (measured 2026-11-27: FedShard 9, FedAvg retraining 17 cascaded leavers, docs/fairness.md),
  with 0.1 neither method causes any, as the paper reports for exact methods.

Results go to ``output_dir/cascade.json``: per method, the number of cascaded leavers (not
counting the initial ones), who they are (majority / minority), every iteration's request, cost
and accuracy drops, and M_p of the first request (client alphas from one probe round on the first
method's trained model, shared by all methods, SPEC section 4).

Run: ``python -m fedshard_lightning.experiments.cascade --output_dir runs/cascade`` (``--help``
for the options; ``--config file.yaml`` takes the same keys, with ``class_path`` for
``algorithms``, ``model`` and ``data``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

import lightning as L
import numpy as np

from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.experiments.common import (
    ExperimentSetting,
    MethodRun,
    fit_method,
    minority_clients,
    mp_score,
    request_cost,
    run_cli,
    write_json,
)
from fedshard_lightning.metrics.fairness_report import fairness_report
from fedshard_lightning.unlearning.base import Algorithm

__all__ = ["ExperimentSetting", "MethodRun", "cascade", "main", "minority_clients"]


# --------------------------------------------------------------------------------------------------
# Cascaded leaving
# --------------------------------------------------------------------------------------------------


def cascade(
    output_dir: str = "runs/cascade",
    algorithms: list[Algorithm] | None = None,
    model: L.LightningModule | None = None,
    data: FederatedDataModule | None = None,
    num_clients: int = 64,
    label_split_fraction: float = 0.75,
    initial_leavers: int = 5,
    y_star: float = 0.1,
    cost_weight: float = 0.01,
    cost_unit: Literal["client_steps", "seconds"] = "client_steps",
    max_iterations: int = 20,
    holdout: bool = False,
    eps0: float = 0.01,
    eps1: float = 1e-12,
    seed: int = 0,
    precision: str = "32-true",
    accelerator: str = "cpu",
    vectorize: Literal["auto", "always", "never"] = "auto",
) -> dict[str, Any]:
    """Cascaded-leaving simulation of the FedShard paper, Appendix G.5; writes ``cascade.json``.

    Args:
        output_dir: Folder of the results (``cascade.json``) and of the runs (``runs/``).
        algorithms: Methods to compare (default: FedShard and FedAvg retraining).
        model: Model template (default: ``MLP(hidden=[64, 64], lr=0.1)``).
        data: A ``label_split`` datamodule (default: Digits with ``num_clients`` and
            ``label_split_fraction``).
        num_clients: K of the default datamodule.
        label_split_fraction: Share of clients on the first half of the labels (default data).
        initial_leavers: Minority clients that leave first (the paper: 5 of 16).
        y_star: ``Y*``, the reservation loss (accuracy fraction) of a client.
        cost_weight: Accuracy-equivalent of a request that costs as much as the original training.
        cost_unit: ``client_steps`` (deterministic) or ``seconds`` for ``Z``.
        max_iterations: Stop after this many cascade steps even if clients still leave.
        holdout: Measure accuracy on the clients' held-out samples (default data: 20% held out).
        eps0: M_p normalisation offset.
        eps1: M_p normalisation range guard.
        seed: Seed of the data split (a given datamodule is rebuilt with it), the training and
            the draw of the initial leavers.
        precision: Trainer precision.
        accelerator: Trainer accelerator.
        vectorize: Trainer vectorization mode.

    Returns:
        The results (also written to ``output_dir/cascade.json``).
    """
    if cost_unit not in ("client_steps", "seconds"):
        raise ConfigError(f"cost_unit={cost_unit!r}: choose client_steps or seconds")
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 0:
        raise ConfigError(
            f"max_iterations={max_iterations!r}: must be an integer >= 0 (0: only the initial request)"
        )
    setting = ExperimentSetting.build(
        output_dir,
        algorithms,
        model,
        data,
        num_clients,
        label_split_fraction,
        seed,
        precision=precision,
        accelerator=accelerator,
        vectorize=vectorize,
        holdout=holdout,
    )
    dm = setting.datamodule
    dm.setup("fit")
    minority = minority_clients(dm)
    if not 1 <= initial_leavers <= len(minority):
        raise ConfigError(
            f"initial_leavers={initial_leavers}: must be in [1, {len(minority)}] (minority size)"
        )
    rng = np.random.default_rng([seed, 5_051])
    first = sorted(int(c) for c in rng.choice(minority, size=initial_leavers, replace=False))
    k = dm.num_clients
    results: dict[str, Any] = {}
    for algorithm in setting.algorithms:
        t0 = time.perf_counter()
        run = fit_method(setting, algorithm)
        present = set(range(k))
        leavers, prev_acc = first, run.acc
        iterations: list[dict[str, Any]] = []
        mp_first = None
        cascaded: list[int] = []
        stopped = False
        state = run.state
        for it in range(max_iterations + 1):
            state, result = run.what_if(state, leavers)
            acc = run.accuracy(result.params)
            z = cost_weight * request_cost(result, run, cost_unit)
            present -= set(leavers)
            report = fairness_report(prev_acc, acc, None, leavers, present=sorted(present | set(leavers)))
            delta = report["delta"]
            if it == 0:
                mp_first = mp_score(setting, run.acc - acc, leavers, eps0, eps1)
            stay = sorted(present)
            next_leavers = [r for r in stay if float(delta[r]) > y_star - z]
            iterations.append(
                {
                    "iteration": it,
                    "leaving": leavers,
                    "client_steps": int(result.client_steps),
                    "seconds": float(result.seconds),
                    "Z": z,
                    "threshold": y_star - z,
                    "delta_acc_remaining": report["remaining"],
                    "delta_acc_leaving": report["leaving"],
                    "test_accuracy": run.trainer.evaluate(result.params)[0],
                    "decide_to_leave": next_leavers,
                }
            )
            if it > 0:
                cascaded.extend(leavers)
            if not next_leavers:
                break
            if len(next_leavers) >= len(present):
                # Everyone wants to leave: the federation dissolves; nothing is left to unlearn into.
                cascaded.extend(next_leavers)
                iterations[-1]["dissolved"] = True
                break
            if it == max_iterations:
                # The cap: these clients decided to leave (they are cascaded leavers) but are not
                # unlearned, and the cascade might have gone on; the results say so.
                cascaded.extend(next_leavers)
                iterations[-1]["stopped_at_max_iterations"] = stopped = True
                break
            prev_acc, leavers = acc, next_leavers
        minority_set = set(minority)
        results[algorithm.name] = {
            "initial_leavers": first,
            "cascaded_leavers": len(cascaded),
            "cascaded_clients": sorted(cascaded),
            "cascaded_minority": sum(c in minority_set for c in cascaded),
            "cascaded_majority": sum(c not in minority_set for c in cascaded),
            "remaining_clients": k - len(first) - len(cascaded),
            "stopped_at_max_iterations": stopped,
            "iterations": iterations,
            "M_p_first_request": mp_first,
            "test_accuracy_fit": run.fit_metrics.get("test_accuracy"),
            "fit_client_steps": run.fit_metrics.get("client_steps"),
            "fit_seconds": run.fit_metrics.get("seconds"),
            "run_dir": str(run.trainer.run_dir),
            "seconds": time.perf_counter() - t0,
        }
    payload = {
        "experiment": "cascade",
        "settings": {
            "num_clients": k,
            "minority_clients": minority,
            "label_split_fraction": dm.label_split_fraction,
            "data": type(dm).__name__,
            "initial_leavers": initial_leavers,
            "y_star": y_star,
            "cost_weight": cost_weight,
            "cost_unit": cost_unit,
            "accuracy_split": "holdout" if holdout else "train",
            "seed": seed,
            "eps0": eps0,
            "eps1": eps1,
        },
        "methods": results,
        "summary": {name: r["cascaded_leavers"] for name, r in results.items()},
    }
    payload["output"] = str(write_json(setting.output_dir / "cascade.json", payload))
    return payload


def main(args: list[str] | None = None) -> None:
    """Command line: ``python -m fedshard_lightning.experiments.cascade --help``."""
    payload = run_cli(cascade, args)
    for name, n in payload["summary"].items():
        print(f"{name}: {n} cascaded leaver(s)")
    print(f"results: {payload['output']}")


if __name__ == "__main__":
    main()
