"""Which parts of FedShard's frozen tree depend on a leaving client (docs/unlearning.md).

Exact unlearning retrains the frozen tree without the client. A from-scratch FedShard fit on the
data without it could build another tree: A1 groups shards by alphas that the client influenced,
and A2 gives rounds from those alphas. This script fits the digits quickstart config with every
client, then again from scratch with one client's data removed, and compares the two trees with
the client's id left out: the groups of every stage and the rounds of every shard.

    python benchmarks/leaving_dependence.py --clients 0 3 17
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from fedshard_lightning.data import DigitsDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard

try:
    from _common import silence
except ImportError:  # run as a module
    from benchmarks._common import silence


class _Without(DigitsDataModule):
    """The digits partition with one client's samples removed (the others keep their data)."""

    def __init__(self, gone: int, **kw) -> None:
        super().__init__(**kw)
        self.gone = gone

    def setup(self, stage: str | None = None) -> None:
        ready = getattr(self, "_ready", False)
        super().setup(stage)
        if not ready:
            del self.client_indices[self.gone]
            del self.holdout_indices[self.gone]


def _fit(dm) -> list[list[tuple[list[int], int]]]:
    torch.manual_seed(0)
    alg = FedShard(merge_rate=2, merge="a1", rounds="a2", t0=2, t1=8, batch_size=10, local_epochs=2)
    tr = FederatedTrainer(
        algorithm=alg,
        default_root_dir=tempfile.mkdtemp(),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        enable_fairness=False,
    )
    with silence():
        tr.fit(MLP(hidden=(64, 64), lr=0.1), dm)
    return [[(list(r.clients), int(r.rounds)) for r in recs] for recs in alg.records]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", nargs="+", type=int, default=[0, 3, 17])
    args = ap.parse_args()
    kw = dict(num_clients=32, partition="dirichlet", rho=0.5, min_client_size=10, seed=0)
    full = _fit(DigitsDataModule(**kw))
    print("client  stage  groups same  rounds same (shards)  rounds of the client's shard: tree / refit")
    for c in args.clients:
        refit = _fit(_Without(c, **kw))

        def rename(i: int, c: int = c) -> int:
            return i if i < c else i + 1  # ids of the refit in the full run's numbering

        for p, (a, b) in enumerate(zip(full, refit), start=1):
            groups_a = sorted(tuple(x for x in cl if x != c) for cl, _ in a)
            groups_b = sorted(tuple(rename(x) for x in cl) for cl, _ in b)
            groups_a = [g for g in groups_a if g]
            rounds_a = {tuple(x for x in cl if x != c): t for cl, t in a}
            rounds_b = {tuple(rename(x) for x in cl): t for cl, t in b}
            common = set(rounds_a) & set(rounds_b)
            same_rounds = sum(rounds_a[g] == rounds_b[g] for g in common)
            own_a = next(t for cl, t in a if c in cl)
            own_b = next(
                (
                    rounds_b[g]
                    for g in common
                    if g == tuple(x for cl, _ in a if c in cl for x in cl if x != c)
                ),
                None,
            )
            print(
                f"{c:>6} {p:>6}  {groups_a == groups_b!s:>11}  {same_rounds:>4}/{len(common):<4} of {len(a):<4}"
                f"       {own_a} / {own_b if own_b is not None else 'other group'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
