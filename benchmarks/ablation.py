"""FedShard ablation at equal total client-steps: naive sharding, A1 only, A1+A2, plain FedAvg.

Paper hypothesis: naive < A1 < A1+A2 >= FedAvg. For each seed, A1+A2 runs first; its total
client-steps C fix the budget of the others: fixed rounds T = round(C / (P * S)) for the two
fixed-round variants and R_avg = round(C / S) FedAvg rounds, with S the client-steps of one round
of all clients. Reports final test accuracy (mean and std over seeds), the client-steps used and
the standard deviation over clients of the cost of unlearning each one alone (client-steps, exact
from the tree; FedAvg retraining: R_avg * (S - s_c)). ``merge="a1"`` is A1 with the cost-aware
``allocateChildShard``; ``--with-count`` adds A1 with count balancing (``a1_count``) + A2.

    python benchmarks/ablation.py --dataset digits --seeds 0 1 2
    python benchmarks/ablation.py --dataset synthetic --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics

from _common import quiet_trainer, silence

from fedshard_lightning.data import DigitsDataModule, SyntheticDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.sharding import tree_client_costs
from fedshard_lightning.unlearning import FedAvg, FedShard


def data(name: str, seed: int, k: int, rho: float):
    if name == "digits":
        return DigitsDataModule(num_clients=k, partition="dirichlet", rho=rho, min_client_size=10, seed=seed)
    return SyntheticDataModule(
        num_clients=k,
        partition="dirichlet",
        rho=rho,
        min_client_size=10,
        seed=seed,
        num_samples=3000,
        num_test=1000,
        shape=(32,),
        num_classes_=10,
        noise=2.0,
    )


def cost_std(trainer) -> float:
    """Std over clients of the client-steps of unlearning each one alone."""
    alg = trainer.algorithm
    steps = [alg.schedule.num_steps(int(n)) for n in trainer.datamodule.client_sizes]
    if isinstance(alg, FedShard):
        z = tree_client_costs([[(r.clients, r.rounds) for r in recs] for recs in alg.records], steps)
    else:
        z = [alg.rounds * (sum(steps) - s) for s in steps]
    return statistics.pstdev(float(v) for v in z)


def run(alg, name, seed, k, rho, lr):
    trainer = quiet_trainer(alg, seed=seed, vectorize="always")
    with silence():
        m = trainer.fit(MLP(hidden=(64, 64), lr=lr), data(name, seed, k, rho))
    return m["test_accuracy"], m["client_steps"], trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", choices=["digits", "synthetic"], default="digits")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rho", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--t0", type=int, default=2)
    ap.add_argument("--t1", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--with-count", action="store_true", help="also A1 with count balancing + A2")
    args = ap.parse_args()
    local = dict(batch_size=10, local_epochs=1)
    results: dict[str, list[tuple[float, int, float]]] = {
        "naive (random + fixed)": [],
        "A1 + fixed": [],
        "A1 + A2": [],
        "FedAvg": [],
    }
    if args.with_count:
        results["A1 (count) + A2"] = []
    for seed in args.seeds:
        acc, steps, trainer = run(
            FedShard(merge="a1", rounds="a2", t0=args.t0, t1=args.t1, **local),
            args.dataset,
            seed,
            args.clients,
            args.rho,
            args.lr,
        )
        results["A1 + A2"].append((acc, steps, cost_std(trainer)))
        p = trainer.algorithm.planned_stages
        per_round = trainer.algorithm.engine.client_steps_of(range(args.clients))
        t_fixed = max(1, round(steps / (p * per_round)))
        fedavg_rounds = max(1, round(steps / per_round))
        variants = [
            (
                "naive (random + fixed)",
                FedShard(merge="random", rounds="fixed", fixed_rounds=t_fixed, **local),
            ),
            ("A1 + fixed", FedShard(merge="a1", rounds="fixed", fixed_rounds=t_fixed, **local)),
            ("FedAvg", FedAvg(rounds=fedavg_rounds, **local)),
        ]
        if args.with_count:
            variants.append(
                ("A1 (count) + A2", FedShard(merge="a1_count", rounds="a2", t0=args.t0, t1=args.t1, **local))
            )
        for label, alg in variants:
            acc, s, tr = run(alg, args.dataset, seed, args.clients, args.rho, args.lr)
            results[label].append((acc, s, cost_std(tr)))
        print(f"seed {seed}: " + ", ".join(f"{k}={v[-1][0]:.4f}" for k, v in results.items()), flush=True)
    print(f"\n{args.dataset}, K={args.clients}, R=2, Dirichlet rho={args.rho}, seeds {args.seeds}")
    print(
        f"{'variant':<24} {'accuracy mean':>13} {'std':>7} {'client-steps (mean)':>20} "
        f"{'unlearning cost std over clients (client-steps, mean over seeds)':>30}"
    )
    summary = {}
    for label, rows in results.items():
        accs = [a for a, _, _ in rows]
        mean, std = statistics.mean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0
        steps = statistics.mean(s for _, s, _ in rows)
        spread = statistics.mean(c for _, _, c in rows)
        summary[label] = {
            "accuracy_mean": mean,
            "accuracy_std": std,
            "client_steps_mean": steps,
            "cost_std_steps_mean": spread,
            "accuracies": accs,
        }
        print(f"{label:<24} {mean:>13.4f} {std:>7.4f} {steps:>20.0f} {spread:>30.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
