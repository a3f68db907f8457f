"""What MKL's reproducible mode (CNR ``AUTO``, set by the engine) costs against its default dispatch.

One process, one engine per workload, stacked path (``vectorize: always``); the two modes are
switched between repeats (MKL's service call takes effect at once), so load drift hits both alike.
Prints medians of the stacked rounds' wall time per mode and their ratio.

    python benchmarks/blas_mode.py                    # digits MLP K=64, CIFAR CNN K=16, ResNetGN K=8
    python benchmarks/blas_mode.py --repeats 9 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from engine_vs_loop import workload

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.engine.blas import blas_mode, set_blas_mode

CASES = {"digits-mlp": 64, "cifar-cnn": 16, "cifar-resnetgn": 8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, MKL mode at start {blas_mode()}"
    )
    print("| workload | K | AUTO s/round (median) | default (OFF) s/round | AUTO / default |")
    print("|---|---|---|---|---|")
    for name in args.workloads:
        k = CASES[name]
        model, dm = workload(name, k)
        eng = FederatedEngine(model, dm, LocalSchedule(batch_size=10), vectorize="always")
        init = stack_params([eng.module_params()])
        groups = [Group(0, tuple(range(k)), args.rounds)]
        times: dict[str, list[float]] = {"AUTO": [], "OFF": []}
        for mode in ("AUTO", "OFF"):  # warm both
            set_blas_mode(mode)
            eng.train_groups(init, groups)
        for _ in range(args.repeats):
            for mode in ("AUTO", "OFF"):
                set_blas_mode(mode)
                t = time.perf_counter()
                eng.train_groups(init, groups)
                times[mode].append((time.perf_counter() - t) / args.rounds)
        auto, off = statistics.median(times["AUTO"]), statistics.median(times["OFF"])
        print(f"| {name} | {k} | {auto:.4f} | {off:.4f} | {auto / off:.2f}x |", flush=True)
    set_blas_mode("AUTO")


if __name__ == "__main__":
    main()
