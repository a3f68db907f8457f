"""How much of FedShard's unlearning-cost spread A2's round range causes (SPEC section 5).

For every round setting and seed: fit FedShard (A1, cost-aware allocation) on digits K=64,
Dirichlet rho=0.1, batch 10, 2 local epochs; take the exact client-steps of unlearning each
client alone from the tree (``tree_client_costs``) and their standard deviation over clients;
then the same with every shard's rounds replaced by its stage's mean rounds (the tree and the
budget unchanged, A2's per-shard differences removed). ``A2 share`` = 1 - var(stage-mean rounds) /
var(real rounds). FedAvg retraining at the same budget has ``round(C / S) * std(s_c)``.

    python benchmarks/cost_spread.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
from _common import quiet_trainer, silence

from fedshard_lightning.data import DigitsDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.sharding import tree_client_costs
from fedshard_lightning.unlearning import FedShard

SETTINGS = {
    "a2 [2, 8]": dict(rounds="a2", t0=2, t1=8),
    "a2 [4, 6]": dict(rounds="a2", t0=4, t1=6),
    "auto (cap 8)": dict(rounds="auto", t1=8),
    "auto (cap 30)": dict(rounds="auto", t1=30),
    "fixed 5": dict(rounds="fixed", fixed_rounds=5),
}


def measure(setting: dict, merge: str, seed: int, epochs: int) -> dict:
    """Fit once; return budget, accuracy, the cost spreads and the observed auto range."""
    alg = FedShard(merge=merge, batch_size=10, local_epochs=epochs, **setting)
    trainer = quiet_trainer(alg, seed=seed, vectorize="always")
    data = DigitsDataModule(num_clients=64, partition="dirichlet", rho=0.1, min_client_size=3, seed=seed)
    with silence():
        m = trainer.fit(MLP(hidden=(64, 64), lr=0.1), data)
    steps = alg._steps
    real = tree_client_costs([[(r.clients, r.rounds) for r in recs] for recs in alg.records], steps)
    flat = tree_client_costs(
        [[(r.clients, float(np.mean([q.rounds for q in recs]))) for r in recs] for recs in alg.records], steps
    )
    fa_rounds = round(m["client_steps"] / sum(steps))
    return {
        "accuracy": m["test_accuracy"],
        "fit_client_steps": m["client_steps"],
        "cost_std": float(real.std()),
        "cost_std_stage_mean_rounds": float(flat.std()),
        "a2_share": 1.0 - float(flat.var() / real.var()) if real.var() > 0 else 0.0,
        "fedavg_cost_std": float(fa_rounds * np.std(steps)),
        "range": getattr(alg.round_policy, "observed_range", None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--merge", default="a1", choices=["a1", "a1_count", "random"])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {}
    head = (
        "| rounds | test acc | fit (client-steps) | cost std (client-steps) | std, stage-mean rounds "
        "| A2 share of variance | FedAvg same budget: std | observed range |"
    )
    print(head + "\n|---|---|---|---|---|---|---|---|")
    for name, setting in SETTINGS.items():
        rows = [measure(setting, args.merge, s, args.epochs) for s in args.seeds]
        out[name] = rows

        def ms(key: str, fmt: str = ".0f", rows=rows) -> str:
            v = [r[key] for r in rows]
            return f"{statistics.mean(v):{fmt}} ± {statistics.stdev(v) if len(v) > 1 else 0.0:{fmt}}"

        ranges = ", ".join(str(r["range"]) for r in rows) if rows[0]["range"] else "-"
        print(
            f"| {name} | {ms('accuracy', '.3f')} | {ms('fit_client_steps')} | {ms('cost_std')} "
            f"| {ms('cost_std_stage_mean_rounds')} | {ms('a2_share', '.2f')} | {ms('fedavg_cost_std')} | {ranges} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
