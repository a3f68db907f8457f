"""Batch-invariant FedAvg sums (engine/aggregate.py) against the chunk-dependent GEMV / index_add they replace.

python benchmarks/aggregation.py     # 64 clients, one group (FedAvg) and 32 groups (FedShard stage 1)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedshard_lightning.engine.aggregate import GroupSums


def old(params, n, owners, G):
    acc = {k: torch.zeros(G, *v.shape[1:]) for k, v in params.items()}
    own_t = torch.as_tensor(owners)
    single = owners[0] if owners.count(owners[0]) == len(owners) else None
    for k in acc:
        if single is not None:
            acc[k][single] += (n @ params[k].reshape(len(owners), -1)).view(acc[k].shape[1:])
        else:
            w = n.view(-1, *([1] * (params[k].ndim - 1)))
            acc[k].index_add_(0, own_t, params[k] * w)
    return acc


def new(params, n, owners, G):
    counts = [owners.count(g) for g in range(G)]
    s = GroupSums({k: torch.zeros(G, *v.shape[1:]) for k, v in params.items()}, counts)
    s.add(params, n, owners)
    return s.totals()


def main() -> None:
    """Time both sums for the digits MLP and the FedAvg CNN, one group and 32 groups of 64 clients."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per variant (median)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name, shapes in [
        ("digits MLP", [(64, 64), (64,), (64, 64), (64,), (10, 64), (10,)]),
        ("FedAvgCNN", [(32, 1, 5, 5), (32,), (64, 32, 5, 5), (64,), (512, 3136), (512,), (10, 512), (10,)]),
    ]:
        for G in (1, 32):
            m = 64
            params = {f"p{i}": torch.randn(m, *s) for i, s in enumerate(shapes)}
            n = torch.randint(5, 50, (m,)).float()
            owners = sorted([i % G for i in range(m)])
            t = {"old": [], "new": []}
            for _ in range(args.repeats):
                for f, key in ((old, "old"), (new, "new")):
                    a = time.perf_counter()
                    f(params, n, owners, G)
                    t[key].append(time.perf_counter() - a)
            o, nw = statistics.median(t["old"]), statistics.median(t["new"])
            print(
                f"{name:<11} m=64 groups={G:<3} GEMV/index_add {o * 1e3:7.2f} ms   GroupSums {nw * 1e3:7.2f} ms  ({nw / o:.2f}x)"
            )


if __name__ == "__main__":
    main()
