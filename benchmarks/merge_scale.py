"""A1's grouping time at stage 1 for many leaves (the cost-aware ``allocateChildShard``).

At stage 1 every alpha is 0, so all leaves are one cluster and, with equal client sizes, one tie:
the filler must not score (or tie-break) them one by one per placement. Each line times one
``a1_grouping`` call with ``N`` one-client leaves whose step counts take ``distinct`` values
(1: IID sizes; 8: skewed), merge rate 2, A2-like expected later costs, and prints the first group
(the grouping is seeded, so the same code gives the same line).

Usage::

    python benchmarks/merge_scale.py 4096 8192 65536
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fedshard_lightning.sharding import StageCosts, a1_grouping


def time_grouping(n: int, distinct: int) -> tuple[float, list[list[int]]]:
    """Seconds of one stage-1 grouping of ``n`` leaves and the grouping."""
    rng = np.random.default_rng(0)
    steps = rng.integers(2, 2 + distinct, size=n)
    costs = StageCosts([[j] for j in range(n)], steps, np.zeros(n), 4.0, 6.0 * steps)
    t = time.perf_counter()
    groups = a1_grouping(np.zeros(n), [1] * n, 2, 0, costs=costs)
    return time.perf_counter() - t, groups


def main() -> None:
    """Parse the leaf counts and print one line per (N, distinct step counts)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("leaves", type=int, nargs="*", default=[4096], help="leaf counts N (default: 4096)")
    for n in ap.parse_args().leaves:
        for distinct in (1, 8):
            seconds, groups = time_grouping(n, distinct)
            print(
                f"N={n} distinct_steps={distinct}: {seconds:.2f} s, {len(groups)} groups, first {groups[0]}"
            )


if __name__ == "__main__":
    main()
