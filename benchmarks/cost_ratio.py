"""FedShard's unlearning cost ratio to retraining, both ways, against the paper's r1.

Per client c (each unlearned alone, exact client-steps from the tree, no training needed):

- ``leaving excluded`` (the unlearn report's ``speedup_client_steps``): retraining the frozen tree
  without c over retraining c's shards without c: ``retrain_cost([c]) / predict_cost([c])``;
- ``leaving counted`` (the paper's r1 exactly, ``speedup_client_steps_counting_leaving``): the fit
  of the whole tree over c's shards with all their clients.

    python benchmarks/cost_ratio.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics

from _common import quiet_trainer, silence

from fedshard_lightning.data import DigitsDataModule, SyntheticDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedShard


def datamodule(name: str, seed: int):
    if name == "digits K=64":
        return DigitsDataModule(num_clients=64, partition="dirichlet", rho=0.1, min_client_size=3, seed=seed)
    if name == "synthetic K=256":
        return SyntheticDataModule(
            num_clients=256, partition="dirichlet", rho=0.1, min_client_size=1, num_samples=10240, num_test=1000,
            shape=(32,), num_classes_=10, noise=2.0, seed=seed,
        )  # fmt: skip
    return SyntheticDataModule(
        num_clients=64,
        partition="iid",
        num_samples=64 * 20,
        num_test=200,
        shape=(32,),
        num_classes_=10,
        seed=seed,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    print("| data | rounds | r1 (theory) | leaving excluded (report) | leaving counted (paper's r1) |")
    print("|---|---|---|---|---|")
    for name in ("digits K=64", "synthetic K=256", "synthetic IID K=64, 20 samples"):
        for label, kw in (("a2 [2, 8]", dict(rounds="a2", t0=2, t1=8)), ("fixed 5", dict(rounds="fixed"))):
            excl, incl, r1 = [], [], 0.0
            for seed in args.seeds:
                alg = FedShard(merge="a1", batch_size=10, local_epochs=2, **kw)
                trainer = quiet_trainer(alg, seed=seed, vectorize="always")
                with silence():
                    trainer.fit(MLP(hidden=(64, 64), lr=0.1), datamodule(name, seed))
                for c in range(alg.num_clients):
                    excl.append(alg.retrain_cost([c]) / alg.predict_cost([c]))
                    incl.append(alg.ratio_counting_leaving([c]))
                r1 = alg.theoretical_speedup()
            print(
                f"| {name} | {label} | {r1:.2f} | {statistics.mean(excl):.2f} "
                f"(clients {min(excl):.2f}-{max(excl):.2f}) | {statistics.mean(incl):.2f} "
                f"(clients {min(incl):.2f}-{max(incl):.2f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
