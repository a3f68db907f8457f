"""Unlearning cost: FedShard unlearning vs retraining the frozen tree from scratch (and FedAvg).

For each K: fit FedShard once (digits MLP, IID, R=2, A2 rounds), then for ``--requests`` different
single clients: time ``unlearn([c])`` and a full replay of the tree without c (what retraining from
scratch costs), restoring the fitted state between requests. Reports the median wall-clock speedup,
the client-step ratio and the paper's r1 = (R-1)/R * K/(K-1) * P.

    python benchmarks/unlearning_speed.py --clients 64 256
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import quiet_trainer, silence

from fedshard_lightning.data import DigitsDataModule, SyntheticDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedShard


def build(k: int, dataset: str):
    if dataset == "digits":
        dm = DigitsDataModule(num_clients=k, partition="iid", min_client_size=1)
    else:
        dm = SyntheticDataModule(
            num_clients=k, partition="iid", min_client_size=1, num_samples=20 * k, shape=(64,)
        )
    return MLP(hidden=(64, 64), lr=0.1), dm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--dataset", choices=["digits", "synthetic"], default="digits")
    ap.add_argument("--requests", type=int, default=3)
    args = ap.parse_args()
    print(
        f"{'K':>5} {'P':>3} {'unlearn s':>10} {'retrain s':>10} {'speedup':>8} {'step ratio':>11} {'r1':>6}"
    )
    for k in args.clients:
        alg_kw = dict(merge_rate=2, rounds="a2", t0=2, t1=8, batch_size=10, local_epochs=1)
        trainer = quiet_trainer(FedShard(**alg_kw), vectorize="always")
        with silence():
            trainer.fit(*build(k, args.dataset))
        alg = trainer.algorithm
        un_t, re_t, ratios = [], [], []
        for c in [k // 7 * (i + 1) % k for i in range(args.requests)]:
            t = time.perf_counter()
            res = alg.unlearn([c])
            un_t.append(time.perf_counter() - t)
            ratios.append(res.retrain_client_steps / res.client_steps)
            alg.load_cache(trainer.cache)
            t = time.perf_counter()
            alg._replay({c}, None)  # the whole frozen tree without c: retraining from scratch
            re_t.append(time.perf_counter() - t)
        u, r = statistics.median(un_t), statistics.median(re_t)
        print(
            f"{k:>5} {alg.planned_stages:>3} {u:>10.3f} {r:>10.3f} {r / u:>7.2f}x {statistics.median(ratios):>10.2f}x "
            f"{alg.theoretical_speedup():>6.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
