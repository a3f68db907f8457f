"""Achieved training FLOP/s of the stacked engine against a large matmul on the same machine.

The machine's practical peak is the FLOP/s of one large fp32 matmul (``--peak-size``), measured
in the same process with the same threads. Training FLOPs are counted by
``torch.utils.flop_counter.FlopCounterMode`` on one client's forward and backward (matmuls and
convolutions; element-wise work is not counted) and scaled to the samples the run processed.

    python benchmarks/utilisation.py                 # digits MLP (64 clients, 20 rounds) and CIFAR CNN
    python benchmarks/utilisation.py --device cuda   # the same against the GPU's own fp32 matmul peak
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params

try:
    from engine_vs_loop import sync, workload
except ImportError:  # run as a module
    from benchmarks.engine_vs_loop import sync, workload


def matmul_peak(size: int, repeats: int, device: str = "cpu") -> float:
    """Median FLOP/s of ``size`` x ``size`` fp32 matmuls (torch's default precision: no TF32)."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    torch.mm(a, b)
    sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * size**3 / statistics.median(times)


def flops_per_sample(model: torch.nn.Module, dm, batch: int) -> float:
    """Counted forward + backward FLOPs of one sample in a batch of ``batch``."""
    x, y = dm.gather(dm.client_indices[0][:batch].repeat(batch)[:batch].to(dm.train_y.device))
    counter = FlopCounterMode(display=False)
    with counter:
        loss = model.per_sample_loss((x, y)).mean()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / batch


def run(
    name: str, clients: int, batch: int, rounds: int, repeats: int, peak: float, device: str = "cpu"
) -> None:
    model, dm = workload(name, clients, device)
    eng = FederatedEngine(model, dm, LocalSchedule(batch_size=batch), vectorize="always")
    init = stack_params([eng.module_params()])
    group = [Group(0, tuple(range(clients)), rounds)]
    eng.train_groups(init, [Group(0, tuple(range(clients)), 1)])  # warm-up, builds the kernels
    sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        eng.train_groups(init, group)
        sync(device)
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times)
    samples = rounds * sum(dm.client_sizes[:clients])
    flops = flops_per_sample(model, dm, batch) * samples
    achieved = flops / seconds
    print(
        f"{name:<11} {clients:>4} {batch:>3} {rounds:>3} {flops / 1e9:>9.3f} {seconds:>8.3f} "
        f"{achieved / 1e9:>9.2f} {100 * achieved / peak:>7.2f}%  {eng.local.program_status}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-size", type=int, default=4096)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args()
    dev = args.device
    peak = matmul_peak(
        args.peak_size if dev == "cpu" else max(args.peak_size, 8192), max(args.repeats, 3), dev
    )
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {name}, medians of {args.repeats}"
    )
    size = args.peak_size if dev == "cpu" else max(args.peak_size, 8192)
    print(f"large matmul ({size}^2 fp32): {peak / 1e9:.1f} GFLOP/s")
    print(
        f"{'workload':<11} {'K':>4} {'B':>3} {'R':>3} {'GFLOP':>9} {'s':>8} {'GFLOP/s':>9} {'of peak':>8}  kernel"
    )
    run("digits-mlp", 64, 10, 20, args.repeats, peak, dev)
    run("cifar-cnn", 64, 10, 1, args.repeats, peak, dev)
    run("cifar-cnn", 64, 50, 1, args.repeats, peak, dev)
    if dev != "cpu":
        run("cifar-cnn", 256, 10, 1, args.repeats, peak, dev)
        run("cifar-resnetgn", 256, 10, 1, args.repeats, peak, dev)


if __name__ == "__main__":
    main()
