"""Time FedShard's first stage(s) of ``configs/cifar100.yaml`` and project the whole run.

The config's model and algorithm (ResNetGN-20, K=512, rho=0.1, R=2, A2 rounds in [4, 7], B=20,
1 local epoch) on synthetic data of CIFAR-100's shape and size (50,000 + 10,000 uint8 images,
3x32x32, 100 classes), so no download is needed. The run stops after ``--stages`` stages; the
projection scales the measured client-steps per second to the whole run: every stage trains
every client, for between t0 and t1 rounds (A2), over P = log_R(K) + 1 stages.

    python benchmarks/cifar100_stage.py --accelerator cuda
    python benchmarks/cifar100_stage.py --accelerator cpu --clients 32 --samples 3200   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
import time

import torch
from _common import add_tf32_option, tf32_setting

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.models import ResNetGN
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard


class _Stop(Exception):
    """Raised after the last stage to time."""


class _StageTimer(FederatedCallback):
    def __init__(self, stages: int) -> None:
        self.stages = stages
        self.rows: list[dict[str, float]] = []
        self.t = time.perf_counter()

    def on_stage_start(self, trainer, stage, groups) -> None:
        self.t = time.perf_counter()

    def on_stage_end(self, trainer, stage, metrics) -> None:
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        self.rows.append({"stage": stage, "wall": time.perf_counter() - self.t, **metrics})
        print(
            f"stage {stage}: {int(metrics['shards'])} shards, rounds {int(metrics['rounds_min'])}-"
            f"{int(metrics['rounds_max'])}, {int(metrics['client_steps'])} client-steps, "
            f"{self.rows[-1]['wall']:.1f} s wall, test accuracy {metrics.get('test_accuracy', float('nan')):.4f}",
            flush=True,
        )
        if stage >= self.stages:
            raise _Stop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accelerator", default="cuda")
    ap.add_argument("--clients", type=int, default=512)
    ap.add_argument("--samples", type=int, default=50_000)
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--vectorize", default="auto", choices=["auto", "always", "never"])
    add_tf32_option(ap)
    args = ap.parse_args()
    dm = SyntheticDataModule(
        num_clients=args.clients,
        partition="dirichlet",
        rho=0.1,
        min_client_size=10,
        num_samples=args.samples,
        num_test=10_000,
        shape=(3, 32, 32),
        num_classes_=100,
        as_uint8=True,
    )
    model = ResNetGN(depth=20, width=16, groups=4, optimizer="sgd", lr=0.1)
    alg = FedShard(merge_rate=2, merge="a1", rounds="a2", t0=4, t1=7, batch_size=20, local_epochs=1)
    timer = _StageTimer(args.stages)
    trainer = FederatedTrainer(
        algorithm=alg,
        accelerator=args.accelerator,
        default_root_dir=tempfile.mkdtemp(prefix="cifar100-stage-"),
        enable_progress_bar=False,
        vectorize=args.vectorize,
        tf32=tf32_setting(args.tf32),
        callbacks=[timer],
        enable_fairness=False,  # times the stages only
    )
    dev = torch.cuda.get_device_name() if args.accelerator == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, device {dev}, K={args.clients}, {args.samples} samples, "
        f"tf32 {args.tf32}",
        flush=True,
    )
    t = time.perf_counter()
    with contextlib.suppress(_Stop):
        trainer.fit(model, dm)
    print(f"wall including set-up: {time.perf_counter() - t:.1f} s; engine mode {alg.engine.mode}")
    steps = sum(r["client_steps"] for r in timer.rows)
    wall = sum(r["wall"] for r in timer.rows)
    rate = steps / wall
    stages = round(math.log(args.clients, 2)) + 1
    per_round = sum(-(-n // 20) for n in dm.client_sizes)  # one local epoch of every client
    lo, hi = stages * 4 * per_round, stages * 7 * per_round
    print(
        f"measured: {steps:.0f} client-steps in {wall:.1f} s = {rate:.1f} client-steps/s "
        f"({rate / (per_round / args.clients):.1f} client-updates/s)"
    )
    print(
        f"projected whole run (P={stages} stages x 4-7 rounds x {per_round} client-steps): "
        f"{lo / rate / 60:.1f}-{hi / rate / 60:.1f} min"
    )


if __name__ == "__main__":
    main()
