"""M_e under the client-step and latency cost models, for fitted runs of the digits comparison.

Reads each run's FLCache (no training): every client's unlearning cost from ``predict_cost`` and
``predict_latency``, weighed by one set of client alphas for all runs (a probe round of the first
run's model, SPEC section 4), as ``compare`` does. The runs must come from the setting of
``configs/compare/digits.yaml`` (digits, K = 64, Dirichlet 0.1, MLP 64-64) with the given seed.

    python benchmarks/cost_models.py --seed 0 runs/compare-digits/runs/fedshard-s0-* runs/compare-digits/runs/fedavg-s0-*
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def load(run: Path, seed: int) -> Any:
    """The run's trainer with its algorithm restored from the cache, built from the recorded settings."""
    from fedshard_lightning import unlearning
    from fedshard_lightning.data import DigitsDataModule
    from fedshard_lightning.experiments.common import seeded_model, with_seed
    from fedshard_lightning.models import MLP
    from fedshard_lightning.trainer import FederatedTrainer

    classes = {"fedshard": unlearning.FedShard, "fedavg": unlearning.FedAvg, "fats": unlearning.FATS}
    version = json.loads((run / "cache" / "CURRENT").read_text())["version"]
    manifest = json.loads((run / "cache" / version / "manifest.json").read_text())
    algorithm = classes[manifest["algorithm"]](**manifest["hparams"])
    trainer = FederatedTrainer(
        algorithm=algorithm,
        default_root_dir=str(run.parent),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        seed=seed,
    )
    data = with_seed(
        DigitsDataModule(num_clients=64, partition="dirichlet", rho=0.1, min_client_size=3), seed
    )
    trainer._load_run(seeded_model(MLP(hidden=(64, 64), lr=0.1), seed), data, str(run), "audit")
    return trainer


def main() -> None:
    """Print one line per run: fit budget, mean and std of the costs, M_e in both models and over FedAvg's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    from fedshard_lightning.experiments.compare import _me, method_label
    from fedshard_lightning.metrics.client_alpha import client_alphas

    rows, alphas = [], None
    for run in args.runs:
        trainer = load(run, args.seed)
        alg = trainer.algorithm
        if alphas is None:
            alphas = client_alphas(trainer).tolist()
        k = alg.num_clients
        steps = [float(alg.predict_cost([c])) for c in range(k)]
        latency = [float(alg.predict_latency([c])) for c in range(k)]
        rows.append(
            {
                "method": method_label(alg),
                "fit_client_steps": alg.total_client_steps,
                "cost_mean": statistics.fmean(steps),
                "cost_std": statistics.pstdev(steps),
                "M_e_steps": _me(steps, alphas, 1e-6),
                "M_e_latency": _me(latency, alphas, 1e-6),
            }
        )
    fedavg = next((r for r in rows if r["method"] == "fedavg"), None)
    for r in rows:
        r["M_e_steps_over_fedavg"] = r["M_e_steps"] / fedavg["M_e_steps"] if fedavg else None
        print(json.dumps({"seed": args.seed, **r}))


if __name__ == "__main__":
    main()
