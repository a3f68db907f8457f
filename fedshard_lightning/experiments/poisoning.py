r"""uf-DPA, the unfair-unlearning-triggered data poisoning attack (FedShard paper, Appendix G.5).

The attackers join with target data, train, then leave and request unlearning, hoping that an
unfair unlearning method degrades the remaining clients whose data resemble the target data.

Setting: the "two label partitions" split of :mod:`fedshard_lightning.experiments.cascade`
(``label_split``, 48 of 64 clients on one half of the labels, 16 on the other). All 16 minority
clients are the attackers and leave in one request. A remaining client is *poisoned* when its
accuracy drop ``DeltaY_r`` (accuracy on its local data before minus after the request, as a
fraction) exceeds ``threshold`` (default 0.1, ten accuracy points: above the 6.7 points of one
flipped sample of a 15-sample Digits client, so sampling noise alone poisons nobody).

Attack precision = poisoned remaining clients / remaining clients (SPEC section 10; the paper
says "the ratio of the number of successfully poisoned clients to the total number of clients":
the attackers themselves cannot be poisoned, so we divide by the clients that remain, which is the
share SPEC names). M_p of the request uses client alphas from one probe round of the first
method's trained model, shared by all methods.

Results go to ``output_dir/poisoning.json``. Run:
``python -m fedshard_lightning.experiments.poisoning --output_dir runs/poisoning``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Literal

import lightning as L

from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.experiments.common import (
    ExperimentSetting,
    fit_method,
    minority_clients,
    run_cli,
    write_json,
)
from fedshard_lightning.metrics.fairness_report import fairness_report
from fedshard_lightning.unlearning.base import Algorithm

__all__ = ["main", "poisoning"]


def poisoning(
    output_dir: str = "runs/poisoning",
    algorithms: list[Algorithm] | None = None,
    model: L.LightningModule | None = None,
    data: FederatedDataModule | None = None,
    num_clients: int = 64,
    label_split_fraction: float = 0.75,
    threshold: float = 0.1,
    holdout: bool = False,
    eps0: float = 0.01,
    eps1: float = 1e-12,
    seed: int = 0,
    precision: str = "32-true",
    accelerator: str = "cpu",
    vectorize: Literal["auto", "always", "never"] = "auto",
) -> dict[str, Any]:
    """uf-DPA of the FedShard paper, Appendix G.5; writes ``poisoning.json``.

    Args:
        output_dir: Folder of the results (``poisoning.json``) and of the runs (``runs/``).
        algorithms: Methods to compare (default: FedShard and FedAvg retraining).
        model: Model template (default: ``MLP(hidden=[64, 64], lr=0.1)``).
        data: A ``label_split`` datamodule (default: Digits with ``num_clients`` and
            ``label_split_fraction``).
        num_clients: K of the default datamodule.
        label_split_fraction: Share of clients on the first half of the labels (default data).
        threshold: Accuracy drop (fraction) above which a remaining client counts as poisoned.
        holdout: Measure accuracy on the clients' held-out samples (default data: 20% held out).
        eps0: M_p normalisation offset.
        eps1: M_p normalisation range guard.
        seed: Seed of the data split (a given datamodule is rebuilt with it) and the training.
        precision: Trainer precision.
        accelerator: Trainer accelerator.
        vectorize: Trainer vectorization mode.

    Returns:
        The results (also written to ``output_dir/poisoning.json``).
    """
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold)):
        raise ConfigError(f"threshold={threshold!r}: must be a finite number")
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
    attackers = minority_clients(dm)
    remaining = [c for c in range(dm.num_clients) if c not in set(attackers)]
    results: dict[str, Any] = {}
    for algorithm in setting.algorithms:
        t0 = time.perf_counter()
        run = fit_method(setting, algorithm)
        _, result = run.what_if(run.state, attackers)
        acc = run.accuracy(result.params)
        report = fairness_report(run.acc, acc, setting.alphas, attackers, eps0, eps1)
        drops = {c: float(report["delta"][c]) for c in range(dm.num_clients)}
        poisoned = [c for c in remaining if drops[c] > threshold]
        results[algorithm.name] = {
            "attack_precision": len(poisoned) / len(remaining),
            "poisoned_clients": poisoned,
            "M_p": report["M_p"],
            "delta_acc_remaining_mean": report["remaining"]["mean"],
            "delta_acc_remaining_max": report["remaining"]["max"],
            "delta_acc_attackers_mean": report["leaving"]["mean"],
            "delta_acc": [drops[c] for c in range(dm.num_clients)],
            "unlearn_client_steps": int(result.client_steps),
            "unlearn_seconds": float(result.seconds),
            "test_accuracy_before": run.fit_metrics.get("test_accuracy"),
            "test_accuracy_after": run.trainer.evaluate(result.params)[0],
            "run_dir": str(run.trainer.run_dir),
            "seconds": time.perf_counter() - t0,
        }
    payload: dict[str, Any] = {
        "experiment": "poisoning",
        "settings": {
            "num_clients": dm.num_clients,
            "attackers": attackers,
            "label_split_fraction": dm.label_split_fraction,
            "data": type(dm).__name__,
            "threshold": threshold,
            "accuracy_split": "holdout" if holdout else "train",
            "seed": seed,
            "eps0": eps0,
            "eps1": eps1,
        },
        "methods": results,
        "summary": {name: r["attack_precision"] for name, r in results.items()},
    }
    payload["output"] = str(write_json(Path(setting.output_dir) / "poisoning.json", payload))
    return payload


def main(args: list[str] | None = None) -> None:
    """Command line: ``python -m fedshard_lightning.experiments.poisoning --help``."""
    payload = run_cli(poisoning, args)
    for name, p in payload["summary"].items():
        print(f"{name}: attack precision {100 * p:.1f}%")
    print(f"results: {payload['output']}")


if __name__ == "__main__":
    main()
