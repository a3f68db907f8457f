"""Engine vs per-client loop: client-updates per second on the same math, in the same process.

A client-update is one client's local training of one round (1 local epoch here). Each setting
runs a warm-up round, then ``--repeats`` timed runs of ``--rounds`` rounds with each mode; the
table reports medians and the stacked/loop ratio.

    python benchmarks/engine_vs_loop.py                   # digits MLP and MNIST-shaped CNN, 64 clients
    python benchmarks/engine_vs_loop.py --suite full      # the issue-7 grid
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedshard_lightning.data import DigitsDataModule, SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.models import MLP, FedAvgCNN


def workload(name: str, clients: int):
    if name == "digits-mlp":
        dm = DigitsDataModule(num_clients=clients, partition="iid")
        model = MLP(hidden=(64, 64), lr=0.05)
    elif name == "mnist-2nn":
        dm = SyntheticDataModule(
            num_clients=clients, partition="iid", num_samples=60 * clients, shape=(1, 28, 28), as_uint8=True
        )
        model = MLP(hidden=(200, 200), lr=0.05)
    elif name == "mnist-cnn":
        dm = SyntheticDataModule(
            num_clients=clients, partition="iid", num_samples=60 * clients, shape=(1, 28, 28), as_uint8=True
        )
        model = FedAvgCNN(lr=0.05)
    elif name == "cifar-cnn":
        dm = SyntheticDataModule(
            num_clients=clients, partition="iid", num_samples=50 * clients, shape=(3, 32, 32), as_uint8=True
        )
        model = FedAvgCNN(lr=0.05)
    else:
        raise ValueError(name)
    dm.setup()
    torch.manual_seed(0)
    model.bind_data(dm.input_shape, dm.num_classes)
    return model, dm


def time_mode(model, dm, mode: str, batch: int, rounds: int, repeats: int) -> tuple[float, int, str, str]:
    """Median seconds of ``rounds`` rounds, client-updates, the mode run and the stacked kernel."""
    eng = FederatedEngine(model, dm, LocalSchedule(batch_size=batch), vectorize=mode)
    k = len(dm.client_indices)
    init = stack_params([eng.module_params()])
    groups = [Group(0, tuple(range(k)), rounds)]
    eng.train_groups(init, [Group(0, tuple(range(k)), 1)])  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        eng.train_groups(init, groups)
        times.append(time.perf_counter() - t)
    return statistics.median(times), k * rounds, eng.mode, eng.local.program_status or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=["issue2", "full"], default="issue2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    grid = [("digits-mlp", 64, 10), ("mnist-cnn", 64, 10)]
    if args.suite == "full":
        grid = [
            (name, k, b)
            for name, k in [
                ("digits-mlp", 64),
                ("digits-mlp", 256),
                ("mnist-2nn", 256),
                ("mnist-cnn", 64),
                ("cifar-cnn", 64),
            ]
            for b in (10, 50)
        ]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, medians of {args.repeats}")
    print(
        f"{'workload':<12} {'K':>5} {'B':>4} {'loop upd/s':>11} {'stacked upd/s':>14} {'ratio':>7} {'auto picks':>11}  kernel"
    )
    for name, k, b in grid:
        model, dm = workload(name, k)
        rounds = args.rounds if "mlp" in name or "2nn" in name else 1
        t_loop, n, _, _ = time_mode(model, dm, "never", b, rounds, args.repeats)
        t_stack, _, _, kernel = time_mode(model, dm, "always", b, rounds, args.repeats)
        _, _, picked, _ = time_mode(model, dm, "auto", b, 1, 1)
        print(
            f"{name:<12} {k:>5} {b:>4} {n / t_loop:>11.1f} {n / t_stack:>14.1f} {t_loop / t_stack:>6.2f}x {picked:>11}  {kernel}",
            flush=True,
        )


if __name__ == "__main__":
    main()
