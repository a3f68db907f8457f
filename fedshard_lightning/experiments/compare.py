"""Side-by-side comparison of unlearning methods: the FedShard paper's Table 2 analogue.

Every method trains on the same data partition with the same seed and model, then unlearns the
same clients, each alone (:class:`~fedshard_lightning.callbacks.UnlearningReplay` in measured
mode). The table reports per method: ``t`` (mean unlearning seconds), the mean unlearning cost in
client-steps and its standard deviation across clients, ``M_e`` (efficiency fairness on seconds
and on client-steps), ``M_p`` (performance fairness), membership-inference F1 on the original and
the unlearned models, and test accuracy before and after. Written as ``compare.md``,
``compare.csv`` and ``compare.json`` in ``output_dir`` and, with ``wandb``, as a W&B table.

Departure from SPEC section 4: client alphas are computed against each method's own trained
model (the callback's probe round), not one reference model shared by all methods.

    python -m fedshard_lightning.experiments.compare --config configs/compare/digits.yaml
"""

from __future__ import annotations

import copy
import csv
import json
import time
from pathlib import Path
from typing import Any, Literal

from fedshard_lightning.callbacks.replay import UnlearningReplay
from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.module import FederatedModule
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning.base import Algorithm

__all__ = ["COLUMNS", "compare"]

COLUMNS = (
    "method",
    "t",
    "client_steps",
    "client_steps_std",
    "M_e",
    "M_e_steps",
    "M_p",
    "mia_f1_before",
    "mia_f1_after",
    "test_accuracy",
    "test_accuracy_after",
    "fit_seconds",
)


def _defaults(
    model: FederatedModule | None, data: FederatedDataModule | None, algorithms: list[Algorithm] | None
):
    from fedshard_lightning.data import DigitsDataModule
    from fedshard_lightning.models import MLP
    from fedshard_lightning.unlearning import FATS, FedAvg, FedShard

    model = model or MLP(hidden=(64, 64), lr=0.1)
    data = data or DigitsDataModule(num_clients=64, partition="dirichlet", rho=0.1, min_client_size=3)
    algorithms = algorithms or [FedShard(merge_rate=2), FedAvg(rounds=20), FATS(rounds=20)]
    return model, data, algorithms


def compare(
    output_dir: str = "runs/compare",
    algorithms: list[Algorithm] | None = None,
    model: FederatedModule | None = None,
    data: FederatedDataModule | None = None,
    clients: list[int] | None = None,
    num_leaving: int = 8,
    seed: int = 0,
    mia: bool = True,
    wandb: bool = False,
    precision: str = "32-true",
    accelerator: str = "cpu",
    vectorize: Literal["auto", "always", "never"] = "auto",
) -> dict[str, Any]:
    """Train every method, unlearn the same clients, write the comparison table.

    Args:
        output_dir: Folder of the table files and of each method's run directory.
        algorithms: Methods (default: FedShard, FedAvg retraining, FATS).
        model: Model template, copied for each method (default: MLP 64-64 on digits).
        data: Datamodule template, copied for each method (default: digits, K=64, Dirichlet 0.1).
        clients: Clients to unlearn, each alone (default: ``num_leaving`` spread over the ids).
        num_leaving: How many clients when ``clients`` is not given.
        seed: Training seed shared by all methods.
        mia: Run the membership-inference attack.
        wandb: Also log each run and the table to W&B (offline).
        precision: Trainer precision.
        accelerator: Trainer accelerator.
        vectorize: Trainer vectorization mode.

    Returns:
        ``{"rows": [...], "output": path}``.
    """
    model, data, algorithms = _defaults(model, data, algorithms)
    names = [a.name for a in algorithms]
    if len(set(names)) != len(names):
        raise ConfigError(f"algorithms: each method may appear once, got {names}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    probe = copy.deepcopy(data)
    probe.setup()
    k = len(probe.client_indices)
    if clients is None:
        if not 1 <= num_leaving < k:
            raise ConfigError(f"num_leaving={num_leaving}: must be in [1, {k - 1}]")
        clients = sorted({round(i * (k - 1) / max(num_leaving - 1, 1)) for i in range(num_leaving)})
    bad = [c for c in clients if not 0 <= c < k]
    if bad:
        raise ConfigError(f"clients: unknown client ids {bad} (valid: 0..{k - 1})")
    rows = []
    for alg in algorithms:
        replay = UnlearningReplay(mode="measured", clients=list(clients), seed=seed, mia=mia)
        trainer = FederatedTrainer(
            algorithm=alg,
            callbacks=[replay],
            default_root_dir=str(out / "runs"),
            run_name=f"{alg.name}-{time.strftime('%Y%m%d-%H%M%S')}",
            precision=precision,
            accelerator=accelerator,
            vectorize=vectorize,
            enable_progress_bar=False,
            eval_every_n_rounds=0,
            wandb=wandb,
            seed=seed,
        )
        metrics = trainer.fit(copy.deepcopy(model), copy.deepcopy(data))
        s = replay.summary or {}
        rows.append(
            {
                "method": alg.name,
                "t": s.get("unlearn_seconds_mean"),
                "client_steps": s.get("unlearn_client_steps_mean"),
                "client_steps_std": s.get("unlearn_client_steps_std"),
                "M_e": s.get("M_e_seconds"),
                "M_e_steps": s.get("M_e_steps"),
                "M_p": s.get("M_p"),
                "mia_f1_before": s.get("mia_f1_before"),
                "mia_f1_after": s.get("mia_f1_after"),
                "test_accuracy": metrics["test_accuracy"],
                "test_accuracy_after": s.get("test_accuracy_after_mean"),
                "fit_seconds": metrics["seconds"],
                "run_dir": str(trainer.run_dir),
            }
        )
    _write(out, rows, clients)
    if wandb:
        _log_wandb(out, rows)
    return {"rows": rows, "clients": list(clients), "output": str(out)}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _write(out: Path, rows: list[dict[str, Any]], clients: list[int]) -> None:
    with open(out / "compare.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*COLUMNS, "run_dir"])
        w.writeheader()
        w.writerows(rows)
    lines = [
        f"Unlearned clients (each alone): {clients}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows),
    ]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    (out / "compare.json").write_text(json.dumps({"clients": clients, "rows": rows}, indent=2) + "\n")


def _log_wandb(out: Path, rows: list[dict[str, Any]]) -> None:
    import wandb

    run = wandb.init(
        project="fedshard-lightning", name="compare", job_type="compare", dir=str(out), mode="offline"
    )
    run.log({"compare": wandb.Table(columns=list(COLUMNS), data=[[r[c] for c in COLUMNS] for r in rows])})
    run.finish()


def main(args: list[str] | None = None) -> None:
    """Command line: ``python -m fedshard_lightning.experiments.compare --help``."""
    import sys

    from jsonargparse import CLI

    from fedshard_lightning.errors import FedShardError

    try:
        result = CLI(compare, args=args, as_positional=False)
    except FedShardError as e:
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        raise SystemExit(2) from None
    print((Path(result["output"]) / "compare.md").read_text())


if __name__ == "__main__":
    main()
