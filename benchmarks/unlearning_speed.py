"""Unlearning cost: FedShard vs FedAvg retraining (FA) vs FATS, at several numbers of clients K.

For each K, every method trains once on the same data (same partition, seed and model), then
unlearns the same ``--requests`` single clients, one after the other; every request starts from
the fitted state (a pure ``what_if``), and the methods take turns on each request so that machine
noise hits them alike. Reported per method: the median wall-clock seconds of ``unlearn([c])`` (the
whole call: planning and retraining, no disk writes), the median client-steps per request, and the
speedups over FA and over FATS on both.

How the comparison is made fair:

- FedShard: R = ``--merge-rate``, A1 merging, A2 rounds in [``--t0``, ``--t1``]. Its fit spends
  C client-steps.
- FA: :class:`~fedshard_lightning.unlearning.FedAvg` with the same training budget,
  ``round(C / S)`` rounds of all clients (S = client-steps of one round of all clients); its
  unlearning retrains from scratch, so a request costs about C, as retraining FedShard would.
- FATS (budget): :class:`~fedshard_lightning.unlearning.FATS` with ``sample_size = K // 4`` draws
  per round (the ratio of ``configs/compare/digits.yaml``) and as many rounds as fit the same budget
  C (the expected number of distinct clients per round is K (1 - (1 - 1/K)^s)). The
  "speedup vs FATS" columns compare with this one.
- FATS (defaults): the defaults of its docstring, 20 rounds of 8 draws: far less training, and most
  clients never take part, so their requests cost nothing; shown for reference.

All methods: batch 10, 1 local epoch, SGD lr 0.1 (the model's optimizer), stacked clients. The
theoretical figure is FedShard's r1 = (R-1)/R * K/(K-1) * P (paper Proposition 1, equal rounds);
beside it, FedShard's own predicted ratio: client-steps of recomputing every shard of its frozen tree
without the client (``retrain_client_steps``) over those of unlearning, both known before running.

    python benchmarks/unlearning_speed.py                      # K = 64, 256, 1024, synthetic data
    python benchmarks/unlearning_speed.py --clients 64 256 --dataset digits
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from _common import quiet_trainer, silence

from fedshard_lightning.data import DigitsDataModule, SyntheticDataModule
from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FATS, FedAvg, FedShard
from fedshard_lightning.unlearning.base import Algorithm

LOCAL = {"batch_size": 10, "local_epochs": 1}


def build(
    k: int, dataset: str, per_client: int, seed: int = 0, hidden: tuple[int, ...] = (64, 64)
) -> tuple[MLP, FederatedDataModule]:
    """The model and the IID data of K clients (digits, or a synthetic set of ``per_client`` * K samples)."""
    if dataset == "digits":
        dm = DigitsDataModule(num_clients=k, partition="iid", min_client_size=1, seed=seed)
    else:
        dm = SyntheticDataModule(
            num_clients=k,
            partition="iid",
            min_client_size=1,
            seed=seed,
            num_samples=per_client * k,
            num_test=2000,
            shape=(64,),
            noise=2.0,
        )
    return MLP(hidden=hidden, lr=0.1), dm


@dataclass
class Method:
    """One trained method and its measured requests."""

    name: str
    trainer: FederatedTrainer
    fit_steps: int
    accuracy: float
    seconds: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    replay_steps: list[int] = field(default_factory=list)

    @property
    def alg(self) -> Algorithm:
        """The fitted algorithm."""
        return self.trainer.algorithm

    def unlearn(self, client: int) -> None:
        """Time one single-client request from the fitted state (a pure what-if; nothing is written)."""
        fitted = self.alg.state_dict()
        t = time.perf_counter()
        _, res = self.alg.what_if(fitted, [client])
        self.seconds.append(time.perf_counter() - t)
        self.steps.append(int(res.client_steps))
        self.replay_steps.append(int(res.retrain_client_steps))

    @property
    def median_s(self) -> float:
        """Median wall-clock seconds per request."""
        return statistics.median(self.seconds)

    @property
    def median_steps(self) -> float:
        """Median client-steps per request."""
        return statistics.median(self.steps)


def fit(name: str, alg: Algorithm, k: int, args: argparse.Namespace) -> Method:
    """Train ``alg`` on the shared config; record its training budget and test accuracy."""
    trainer = quiet_trainer(alg, vectorize="always")
    with silence():
        metrics = trainer.fit(*build(k, args.dataset, args.samples_per_client, hidden=tuple(args.hidden)))
    return Method(name, trainer, int(metrics["client_steps"]), float(metrics["test_accuracy"]))


def fats_defaults() -> dict[str, Any]:
    """FATS's own defaults (``rounds``, ``sample_size``), read from its signature."""
    params = inspect.signature(FATS.__init__).parameters
    return {n: params[n].default for n in ("rounds", "sample_size")}


def ratio(a: float, b: float) -> str:
    """``a / b`` as a speedup, or ``-`` when undefined."""
    return f"{a / b:.2f}x" if b > 0 else "-"


def run_k(k: int, args: argparse.Namespace) -> list[list[str]]:
    """Fit every method at K clients, serve the same requests, return the table rows."""
    fs = fit(
        "FedShard",
        FedShard(merge_rate=args.merge_rate, rounds="a2", t0=args.t0, t1=args.t1, **LOCAL),
        k,
        args,
    )
    budget = fs.fit_steps
    engine = fs.alg.engine
    per_round = engine.client_steps_of(range(k))  # one round of all clients
    fa_rounds = max(1, round(budget / per_round))
    s = max(1, k // 4)
    distinct = k * (1 - (1 - 1 / k) ** s)
    fats_rounds = max(1, round(budget / (distinct * per_round / k)))
    methods = [
        fs,
        fit(f"FA, same budget ({fa_rounds} rounds)", FedAvg(rounds=fa_rounds, **LOCAL), k, args),
        fit(
            f"FATS, same budget ({fats_rounds} r x {s} draws)",
            FATS(rounds=fats_rounds, sample_size=s, **LOCAL),
            k,
            args,
        ),
    ]
    d = fats_defaults()
    methods.append(
        fit(f"FATS, defaults ({d['rounds']} r x {d['sample_size']} draws)", FATS(**d, **LOCAL), k, args)
    )
    requests = [(2 * i + 1) * k // (2 * args.requests) for i in range(args.requests)]
    for c in requests:
        for m in methods:
            m.unlearn(c)
    fa, fats = methods[1], methods[2]
    rows = []
    for m in methods:
        rows.append(
            [
                str(k),
                m.name,
                str(m.fit_steps),
                f"{m.accuracy:.3f}",
                f"{m.median_s:.3f}",
                f"{m.median_steps:.0f}",
                ratio(fa.median_s, m.median_s),
                ratio(fa.median_steps, m.median_steps),
                ratio(fats.median_s, m.median_s),
                ratio(fats.median_steps, m.median_steps),
                f"{fs.alg.theoretical_speedup():.2f} (P={fs.alg.planned_stages})" if m is fs else "",
                ratio(statistics.median(m.replay_steps), m.median_steps) if m is fs else "",
            ]
        )
    print(f"K={k}: requests for clients {requests}", flush=True)
    return rows


HEADER = [
    "K",
    "method",
    "fit client-steps",
    "test acc",
    "unlearn s (median)",
    "client-steps / request (median)",
    "vs FA (wall)",
    "vs FA (steps)",
    "vs FATS (wall)",
    "vs FATS (steps)",
    "r1 (theory)",
    "tree replay / unlearn (steps)",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--dataset", choices=["digits", "synthetic"], default="synthetic")
    ap.add_argument("--samples-per-client", type=int, default=20, help="synthetic data only")
    ap.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[64, 64],
        help="MLP hidden widths: wider gives each client more work per round against the fixed cost",
    )
    ap.add_argument("--requests", type=int, default=3, help="single-client requests per method (>= 3)")
    ap.add_argument("--merge-rate", type=int, default=2)
    ap.add_argument("--t0", type=int, default=2)
    ap.add_argument("--t1", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads", flush=True)
    rows = []
    for k in args.clients:
        rows.extend(run_k(k, args))
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for row in rows:
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
