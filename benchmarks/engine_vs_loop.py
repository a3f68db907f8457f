"""Engine vs per-client loop: client-updates per second on the same math, in the same process.

A client-update is one client's local training of one round (1 local epoch here). Each setting
runs a warm-up round, then ``--repeats`` timed runs of ``--rounds`` rounds with each mode; the
table reports medians and the stacked/loop ratio.

    python benchmarks/engine_vs_loop.py                   # digits MLP and MNIST-shaped CNN, 64 clients
    python benchmarks/engine_vs_loop.py --suite full      # MLPs and CNNs at K = 64 and 256, B = 10 and 50
    python benchmarks/engine_vs_loop.py --suite gpu --device cuda   # the GPU grid of docs/gpu.md
    python benchmarks/engine_vs_loop.py --suite user      # models as Lightning users write them (BatchNorm, dropout)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _common import add_tf32_option, tf32_setting
from torch import nn

from fedshard_lightning.data import DigitsDataModule, SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.engine.allocator import configure_process
from fedshard_lightning.models import MLP, FedAvgCNN, ResNet18BN, ResNetGN
from fedshard_lightning.module import FederatedModule

WORKLOADS = (
    "digits-mlp",
    "mnist-2nn",
    "mnist-cnn",
    "cifar-cnn",
    "cifar-resnetgn",
    "cifar-bncnn",
    "cifar-resnet18bn",
)


class BNDropoutCNN(FederatedModule):
    """FedAvgCNN's layout as a Lightning user writes it: BatchNorm, dropout, self.log, a scheduler."""

    def configure_model(self) -> None:
        """Two conv-BN-ReLU-pool blocks, a dense layer with dropout, the classifier."""
        if getattr(self, "net", None) is None:
            self.net = nn.Sequential(
                nn.Conv2d(self.input_shape[0], 32, 5, padding=2),
                nn.BatchNorm2d(32),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 5, padding=2),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.LazyLinear(512),
                nn.ReLU(),
                nn.Dropout(0.25),
                nn.Linear(512, self.num_classes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int = 0) -> torch.Tensor:
        """Cross entropy, logged."""
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("client_loss", loss)
        return loss

    def configure_optimizers(
        self,
    ) -> tuple[list[torch.optim.Optimizer], list[torch.optim.lr_scheduler.LRScheduler]]:
        """SGD with a per-round StepLR."""
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)]


def workload(name: str, clients: int, device: str = "cpu", tf32: bool | None = None):
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
    elif name == "cifar-resnetgn":  # configs/cifar100.yaml's model on CIFAR-100-shaped data
        dm = SyntheticDataModule(
            num_clients=clients,
            partition="iid",
            num_samples=50 * clients,
            shape=(3, 32, 32),
            num_classes_=100,
            as_uint8=True,
        )
        model = ResNetGN(depth=20, width=16, groups=4, lr=0.05)
    elif name in ("cifar-bncnn", "cifar-resnet18bn"):  # BatchNorm + dropout, CIFAR-10-shaped
        dm = SyntheticDataModule(
            num_clients=clients, partition="iid", num_samples=50 * clients, shape=(3, 32, 32), as_uint8=True
        )
        # ResNet-18 at width 16 on CPU (a quarter of the usual 64 channels), full width on a GPU.
        width = 64 if device.startswith("cuda") else 16
        model = BNDropoutCNN(lr=0.05) if name == "cifar-bncnn" else ResNet18BN(width=width, lr=0.05)
    else:
        raise ValueError(name)
    dm.setup()
    torch.manual_seed(0)
    model.bind_data(dm.input_shape, dm.num_classes)
    configure_process(device, tf32)  # what the trainer does at launch
    return model.to(device), dm.to(device)


def sync(device: str) -> None:
    """Wait for queued GPU work, so wall-clock timings cover it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_mode(
    model,
    dm,
    mode: str,
    batch: int,
    rounds: int,
    repeats: int,
    device: str = "cpu",
    budget_mb: float = 2048.0,
    compile: bool = False,
    batch_invariant: bool = True,
) -> tuple[float, int, str, str]:
    """Median seconds of ``rounds`` rounds, client-updates, the mode run and the stacked kernel."""
    eng = FederatedEngine(
        model,
        dm,
        LocalSchedule(batch_size=batch),
        vectorize=mode,
        memory_budget_mb=budget_mb,
        compile=compile,
        batch_invariant=batch_invariant,
    )
    k = len(dm.client_indices)
    init = stack_params([eng.module_params()])
    groups = [Group(0, tuple(range(k)), rounds)]
    eng.train_groups(init, [Group(0, tuple(range(k)), 1)])  # warm-up
    sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        eng.train_groups(init, groups)
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times), k * rounds, eng.mode, eng.local.program_status or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=["quick", "full", "gpu", "user"], default="quick")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--workloads", nargs="*", choices=WORKLOADS, help="restrict the suite to these")
    ap.add_argument("--clients", nargs="*", type=int, help="restrict the suite to these K")
    ap.add_argument("--compile", action="store_true", help="also time the torch.compile'd stacked step")
    ap.add_argument(
        "--variant-too",
        action="store_true",
        help="also time the stacked engine without batch invariance (the cost of bit-exactness)",
    )
    ap.add_argument(
        "--memory-budget-mb",
        type=float,
        default=2048.0,
        help="the engine's chunk budget (trainer default 2048)",
    )
    add_tf32_option(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument(
        "--stacked-only",
        action="store_true",
        help="time the stacked engine alone (no loop, no auto), with the peak CUDA memory",
    )
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
    elif args.suite == "user":
        grid = [("cifar-bncnn", 64, 10), ("cifar-resnet18bn", 64, 10)]
    elif args.suite == "gpu":
        grid = [
            (name, k, 10)
            for name in ("digits-mlp", "mnist-2nn", "cifar-cnn", "cifar-resnetgn")
            for k in (64, 256)
        ]
    grid = [
        g
        for g in grid
        if (not args.workloads or g[0] in args.workloads) and (not args.clients or g[1] in args.clients)
    ]
    if args.workloads and args.clients:  # both named: exactly their product, at B = 10
        grid = [(name, k, 10) for name in args.workloads for k in args.clients]
    dev = f", device {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}{dev}, medians of {args.repeats}, "
        f"chunk budget {args.memory_budget_mb:.0f} MB, tf32 {args.tf32}"
    )
    print(
        f"{'workload':<14} {'K':>5} {'B':>4} {'loop upd/s':>11} {'stacked upd/s':>14} {'ratio':>7} {'auto picks':>11}"
        + (" variant/inv" if args.variant_too else "")
        + (" compiled/eager (compile s)" if args.compile else "")
        + "  kernel"
    )
    for name, k, b in grid:
        model, dm = workload(name, k, args.device, tf32_setting(args.tf32))
        rounds = args.rounds if "mlp" in name or "2nn" in name else 1
        kw = dict(device=args.device, budget_mb=args.memory_budget_mb)
        if args.stacked_only:
            cuda = args.device.startswith("cuda")
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t_stack, n, _, kernel = time_mode(model, dm, "always", b, rounds, args.repeats, **kw)
            peak = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB peak" if cuda else ""
            print(
                f"{name:<14} {k:>5} {b:>4} {'-':>11} {n / t_stack:>14.1f} {'-':>7} {'-':>11}  {kernel} {peak}"
            )
            continue
        t_loop, n, _, _ = time_mode(model, dm, "never", b, rounds, args.repeats, **kw)
        t_stack, _, _, kernel = time_mode(model, dm, "always", b, rounds, args.repeats, **kw)
        _, _, picked, _ = time_mode(model, dm, "auto", b, 1, 1, **kw)
        extra = ""
        if args.variant_too:
            t_var, _, _, _ = time_mode(
                model, dm, "always", b, rounds, args.repeats, batch_invariant=False, **kw
            )
            extra += f" {t_stack / t_var:>10.2f}x"
        if args.compile:
            t = time.perf_counter()
            t_comp, _, _, _ = time_mode(model, dm, "always", b, rounds, args.repeats, compile=True, **kw)
            extra += f" {t_stack / t_comp:>10.2f}x ({time.perf_counter() - t - args.repeats * t_comp:.0f} s)"
        print(
            f"{name:<14} {k:>5} {b:>4} {n / t_loop:>11.1f} {n / t_stack:>14.1f} {t_loop / t_stack:>6.2f}x {picked:>11}"
            f"{extra}  {kernel}",
            flush=True,
        )


if __name__ == "__main__":
    main()
