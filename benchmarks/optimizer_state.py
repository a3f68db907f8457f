"""Client optimizer state reset every round or kept (``trainer.optimizer_state``), on digits.

AdamW (lr 3e-3, weight decay 0.05) on cross entropy with label smoothing 0.1, an MLP of two
hidden layers of 64, FedShard on the digits quickstart partition (32 clients, Dirichlet 0.5).
Prints each setting's test accuracy and loss; with ``keep`` it then unlearns ``--clients`` and audits the
result against a retrain from scratch (``max_abs_diff`` 0 is bit-exact).

    python benchmarks/optimizer_state.py --clients 2 7
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F

from fedshard_lightning.data import DigitsDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard

try:
    from _common import silence
except ImportError:  # run as a module
    from benchmarks._common import silence


class SmoothedAdamW(MLP):
    """AdamW (lr 3e-3, weight decay 0.05) on cross entropy with label smoothing 0.1."""

    def __init__(self, **kw) -> None:
        kw = {"hidden": (64, 64), "optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.05, **kw}
        super().__init__(**kw)

    def per_sample_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Label-smoothed cross entropy per sample (smoothing keeps AdamW's steps from saturating)."""
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="none", label_smoothing=0.1)


def _fresh() -> tuple[SmoothedAdamW, DigitsDataModule]:
    torch.manual_seed(0)
    data = DigitsDataModule(num_clients=32, partition="dirichlet", rho=0.5, min_client_size=10, seed=0)
    return SmoothedAdamW(), data


def _trainer(root: str, state: str) -> FederatedTrainer:
    algorithm = FedShard(merge_rate=2, merge="a1", rounds="a2", t0=2, t1=8, batch_size=10, local_epochs=2)
    return FederatedTrainer(
        algorithm=algorithm,
        default_root_dir=root,
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        enable_fairness=False,
        optimizer_state=state,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", nargs="+", type=int, default=[2, 7], help="clients keep's run unlearns")
    args = ap.parse_args()
    print("optimizer_state  test_accuracy  test_loss  fit_s  then unlearn + audit")
    for state in ("reset", "keep"):
        root = tempfile.mkdtemp(prefix=f"optstate-{state}-")
        t = time.perf_counter()
        with silence():
            trainer = _trainer(root, state)
            metrics = trainer.fit(*_fresh())
        took = time.perf_counter() - t
        audit = "-"
        if state == "keep":
            with silence():
                _trainer(root, state).unlearn(*_fresh(), str(trainer.run_dir), args.clients)
                diff = _trainer(root, state).audit(*_fresh(), str(trainer.run_dir))["max_abs_diff"]
            audit = f"clients {args.clients}: max_abs_diff={diff:g}"
        acc, loss = metrics["test_accuracy"], metrics["test_loss"]
        print(f"{state:15}  {acc:13.4f}  {loss:9.4f}  {took:5.1f}  {audit}")


if __name__ == "__main__":
    main()
