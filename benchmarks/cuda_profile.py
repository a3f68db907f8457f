"""Where a stacked round's time goes: torch.profiler over one engine round, top operators and kernels.

    python benchmarks/cuda_profile.py --workload cifar-cnn --clients 256 --device cuda

Prints the operators sorted by device time (self), then by CPU time, so that launch-bound and
arithmetic-bound workloads both show their cost.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_loop import WORKLOADS, sync, workload

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=WORKLOADS, default="cifar-cnn")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--memory-budget-mb", type=float, default=16384.0)
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args()
    model, dm = workload(args.workload, args.clients, args.device)
    eng = FederatedEngine(
        model,
        dm,
        LocalSchedule(batch_size=args.batch),
        vectorize="always",
        memory_budget_mb=args.memory_budget_mb,
    )
    init = stack_params([eng.module_params()])
    groups = [Group(0, tuple(range(args.clients)), 1)]
    eng.train_groups(init, groups)
    eng.train_groups(init, groups)
    sync(args.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        eng.train_groups(init, groups)
        sync(args.device)
    print(
        f"{args.workload} K={args.clients} B={args.batch} on {args.device}: kernel {eng.local.program_status}"
    )
    if args.device.startswith("cuda"):
        print(
            prof.key_averages().table(
                sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60
            )
        )
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60
        )
    )


if __name__ == "__main__":
    main()
