"""Side-by-side comparison of unlearning methods: the FedShard paper's Table 2 analogue.

Every method trains on the same data partition with the same seed, model, batch size and local
epochs (checked), **at the same training budget in client-steps** (``budget="match"``: FedShard,
the first method, fits first; every other method gets the rounds that spend the same client-steps,
a FedShard with calibrated rounds the calibration cap that keeps it within them, see
:mod:`~fedshard_lightning.experiments.budget`), then unlearns the same clients, each alone
(:class:`~fedshard_lightning.callbacks.UnlearningReplay` in measured mode). With ``seeds`` it
repeats everything per seed (data partition and training seed) and reports mean ± std.

Per method: ``t`` (mean unlearning seconds per request), the mean cost in client-steps per
request, the standard deviation over clients of the cost in client-steps (M_e without the
``1/|alpha|`` weights, which one client with a near-zero alpha can dominate), and ``M_e`` under
the three cost models of SPEC section 8 as separate columns: client-steps (every client, exact
predicted costs), latency (every client, exact: each retrained round costs its slowest
participant's steps, shards of a stage retrain in parallel) and seconds (the measured clients), ``M_p``, membership-inference F1 before and after, test accuracy
before and after, and FedAvg retraining's cost over the method's (client-steps). ``M_e`` and
``M_p`` use the client alphas of the first method's model for every method (SPEC section 4: methods
compared side by side share one reference): its replay probes them, the others' replays are given them.

Written to ``output_dir``: ``compare.md``, ``compare.csv`` (one row per method and seed),
``compare.json``, ``compare.tex`` (:mod:`~fedshard_lightning.experiments.tables`) and
``cost_distribution.png`` (:mod:`~fedshard_lightning.experiments.plots`); with ``wandb``, a W&B table.

    python -m fedshard_lightning compare --config configs/compare/digits.yaml
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch

from fedshard_lightning.callbacks.replay import UnlearningReplay, latencies
from fedshard_lightning.callbacks.task_progress import TaskProgress
from fedshard_lightning.data.base import FederatedDataModule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.experiments.budget import match_budget
from fedshard_lightning.experiments.common import run_cli, seeded_model, with_seed
from fedshard_lightning.experiments.mia_report import calibrated_mia, mia_markdown, write_mia_summary
from fedshard_lightning.experiments.mia_shadow import train_shadows
from fedshard_lightning.experiments.plots import plot_cost_distributions
from fedshard_lightning.experiments.tables import COLUMNS, aggregate, write_tables
from fedshard_lightning.metrics import efficiency_fairness
from fedshard_lightning.trainer.trainer import FederatedTrainer
from fedshard_lightning.unlearning.base import Algorithm

__all__ = ["COLUMNS", "compare"]


def _defaults(
    model: L.LightningModule | None, data: FederatedDataModule | None, algorithms: list[Algorithm] | None
):
    from fedshard_lightning.data import DigitsDataModule
    from fedshard_lightning.models import MLP
    from fedshard_lightning.unlearning import FATS, FedAvg, FedShard

    model = model or MLP(hidden=(64, 64), lr=0.1)
    data = data or DigitsDataModule(num_clients=64, partition="dirichlet", rho=0.1, min_client_size=3)
    algorithms = algorithms or [FedShard(merge_rate=2), FedAvg(rounds=20), FATS(rounds=20)]
    return model, data, algorithms


def _check_same_schedule(algorithms: list[Algorithm]) -> None:
    """Batch size, local epochs and local steps must agree, or the budgets are not comparable."""
    ref = algorithms[0].schedule
    for a in algorithms[1:]:
        s = a.schedule
        if (s.batch_size, s.local_epochs, s.local_steps) != (
            ref.batch_size,
            ref.local_epochs,
            ref.local_steps,
        ):
            raise ConfigError(
                f"algorithms: {a.name} trains with batch_size={s.batch_size}, local_epochs={s.local_epochs}, "
                f"local_steps={s.local_steps} but {algorithms[0].name} with batch_size={ref.batch_size}, "
                f"local_epochs={ref.local_epochs}, local_steps={ref.local_steps}; give every method the same"
            )


def method_label(algorithm: Algorithm) -> str:
    """A comparison row's name: the method, with its variant where it runs one (``fedshard (rounds: stage_a2)``)."""
    variant = getattr(algorithm, "variant", "")
    return f"{algorithm.name} ({variant})" if variant else algorithm.name


def _me(costs: list[float], alphas: list[float], eps: float) -> float | None:
    if not costs:
        return None
    return float(
        efficiency_fairness(
            torch.tensor(costs, dtype=torch.float64), torch.tensor(alphas, dtype=torch.float64), eps
        )
    )


def _after(mia_cal: dict[str, Any], name: str) -> float | None:
    """A score of the calibrated MIA after unlearning (none in predicted mode)."""
    return getattr(mia_cal["after"], name) if "after" in mia_cal else None


def _r2(alg: Algorithm, clients: list[int]) -> float | None:
    """Client-steps of unlearning ``clients`` one by one over unlearning them together (paper's r_2)."""
    together = float(alg.predict_cost(list(clients)))
    alone = sum(float(alg.predict_cost([c])) for c in clients)
    return alone / together if together > 0 else None


def compare(
    output_dir: str = "runs/compare",
    algorithms: list[Algorithm] | None = None,
    model: L.LightningModule | None = None,
    data: FederatedDataModule | None = None,
    clients: list[int] | None = None,
    num_leaving: int = 8,
    seed: int = 0,
    seeds: list[int] | None = None,
    budget: Literal["match", "as_configured"] = "match",
    mia: bool = True,
    eps_alpha: float = 1e-6,
    wandb: bool = False,
    precision: str = "32-true",
    accelerator: str = "cpu",
    vectorize: Literal["auto", "always", "never"] = "auto",
    replay: Literal["measured", "predicted"] = "measured",
    mia_attack: Literal["calibrated", "classifier"] = "calibrated",
    mia_shadows: int = 4,
    mia_bootstrap: int = 1000,
) -> dict[str, Any]:
    """Train every method at the same budget, unlearn the same clients, write the comparison tables.

    Args:
        output_dir: Folder of the table files and of each method's run directory.
        algorithms: Methods (default: FedShard, FedAvg retraining, FATS); the first one is the
            budget reference (FedShard: its rounds come from A2).
        model: Model template, copied for each method (default: MLP 64-64 on digits).
        data: Datamodule template, copied for each method and seed (default: digits, K=64, Dirichlet 0.1).
        clients: Clients to unlearn, each alone (default: ``num_leaving`` spread over the ids).
        num_leaving: How many clients when ``clients`` is not given.
        seed: Training and partition seed when ``seeds`` is not given.
        seeds: Several seeds: everything is repeated per seed (the datamodule's partition seed too)
            and the tables show mean ± std.
        budget: ``match`` (every method after the first gets the first one's fit client-steps) or
            ``as_configured`` (each method's configured rounds).
        mia: Run the membership-inference attack.
        eps_alpha: ``eps_alpha`` of M_e.
        wandb: Also log each run and the table to W&B (offline).
        precision: Trainer precision.
        accelerator: Trainer accelerator.
        vectorize: Trainer vectorization mode.
        replay: ``measured`` unlearns the chosen clients for real (seconds, M_p, MIA after);
            ``predicted`` only computes the deterministic costs (client-steps, latency) of every
            client from the fitted state, which is much faster for methods such as FATS whose
            unlearning reruns most of the training.
        mia_attack: ``calibrated`` (default): the per-example offline LiRA test of
            :mod:`~fedshard_lightning.experiments.mia_shadow` with ``mia_shadows`` FedAvg shadow
            models per seed, scored by AUC, TPR at 1% FPR and F1, before unlearning and (with
            ``replay=measured``) after unlearning each audited client (the replay's clients); ``classifier``: the
            replay's classifier on sorted softmax outputs (F1 and AUC).
        mia_shadows: Shadow models per seed (even, >= 2) of the calibrated attack.
        mia_bootstrap: Bootstrap draws of the calibrated attack's confidence intervals (``mia.json``).

    Returns:
        ``{"rows": [...], "summary": [...], "clients": [...], "output": path}``.
    """
    model, data, algorithms = _defaults(model, data, algorithms)
    names = [method_label(a) for a in algorithms]
    if len(set(names)) != len(names):
        raise ConfigError(f"algorithms: each method (and variant) may appear once, got {names}")
    if budget not in ("match", "as_configured"):
        raise ConfigError(f"budget={budget!r}: choose match or as_configured")
    if vectorize not in ("auto", "always", "never"):
        raise ConfigError(f"vectorize={vectorize!r}: choose auto, always or never")
    if replay not in ("measured", "predicted"):
        raise ConfigError(f"replay={replay!r}: choose measured or predicted")
    if mia_attack not in ("calibrated", "classifier"):
        raise ConfigError(f"mia_attack={mia_attack!r}: choose calibrated or classifier")
    if (
        isinstance(mia_shadows, bool)
        or not isinstance(mia_shadows, int)
        or mia_shadows < 2
        or mia_shadows % 2
    ):
        raise ConfigError(f"mia_shadows={mia_shadows!r}: must be an even integer >= 2")
    if isinstance(eps_alpha, bool) or not isinstance(eps_alpha, (int, float)) or not 0 < eps_alpha < math.inf:
        raise ConfigError(f"eps_alpha={eps_alpha!r}: must be a positive finite number (e.g. 1e-6)")
    _check_same_schedule(algorithms)
    seeds = [int(seed)] if not seeds else [int(s) for s in seeds]
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
    out = Path(output_dir)  # made once every argument is checked: a refused call leaves no folder
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    dist_steps: dict[str, list[float]] = {n: [] for n in names}
    dist_seconds: dict[str, list[float]] = {n: [] for n in names}
    progress = TaskProgress("compare", None, items=len(seeds) * len(algorithms))
    mia_arrays: dict[str, list[Any]] = {}
    for s in seeds:
        seed_rows = _run_seed(
            s,
            algorithms,
            model,
            data,
            clients,
            budget,
            mia,
            eps_alpha,
            wandb,
            precision,
            accelerator,
            vectorize,
            out,
            progress,
            replay,
            mia_attack if mia else None,
            mia_shadows,
        )
        for r in seed_rows:
            dist_steps[r["method"]].extend(r.pop("_z_steps"))
            dist_seconds[r["method"]].extend(r.pop("_z_seconds"))
            mia_arrays.setdefault(r["method"], []).append(r.pop("_mia", None))
        rows.extend(seed_rows)
    progress.close()
    agg = aggregate(rows)
    meta = {
        "seeds": seeds,
        "clients": list(clients),
        "budget": "every method at the first method's fit client-steps (rounds matched)"
        if budget == "match"
        else "each method's configured rounds",
        "eps_alpha": eps_alpha,
    }
    if mia and mia_attack == "calibrated":
        meta["mia"] = write_mia_summary(out / "mia.json", mia_arrays, names[0], mia_bootstrap)
    write_tables(out, agg, rows, meta)
    if meta.get("mia"):
        with open(out / "compare.md", "a") as f:
            f.write("\n" + mia_markdown(meta["mia"]) + "\n")
    plot_cost_distributions(out / "cost_distribution.png", dist_steps, dist_seconds)
    if wandb:
        _log_wandb(out, agg, rows, meta)
    return {"rows": rows, "summary": agg, "clients": list(clients), "output": str(out)}


def _run_seed(
    seed: int,
    algorithms: list[Algorithm],
    model: L.LightningModule,
    data: FederatedDataModule,
    clients: list[int],
    budget: str,
    mia: bool,
    eps_alpha: float,
    wandb: bool,
    precision: str,
    accelerator: str,
    vectorize: str,
    out: Path,
    progress: TaskProgress,
    replay_mode: str = "measured",
    mia_attack: str | None = "classifier",
    mia_shadows: int = 4,
) -> list[dict[str, Any]]:
    """Fit and replay every method for one seed; the first method fixes the budget and the alphas.

    ``progress`` gets one update per method (a plain line off a terminal): fit and replay done.
    """
    dm = with_seed(data, seed)
    rows: list[dict[str, Any]] = []
    ref_budget: int | None = None
    step_counts: list[int] | None = None
    ref_alpha: list[float] | None = None  # every client's alpha, from the first method's probe round
    fa_cost: float | None = None
    shadows = None
    for i, template in enumerate(algorithms):
        how: dict[str, Any] = {"rule": "as configured", "rounds": getattr(template, "rounds", None)}
        alg = copy.deepcopy(template)
        if budget == "match" and i > 0:
            alg, how = match_budget(template, ref_budget, step_counts)
        replay = UnlearningReplay(
            mode=replay_mode,
            clients=list(clients),
            seed=seed,
            mia=mia_attack == "classifier",
            plots=False,
            alphas=ref_alpha,
        )
        trainer = FederatedTrainer(
            algorithm=alg,
            callbacks=[replay],
            default_root_dir=str(out / "runs"),
            run_name=f"{alg.name}{'-' + str(i) if method_label(alg) != alg.name else ''}-s{seed}-"
            f"{time.strftime('%Y%m%d-%H%M%S')}",
            precision=precision,
            accelerator=accelerator,
            vectorize=vectorize,
            enable_progress_bar=False,
            eval_every_n_rounds=0,
            wandb=wandb,
            seed=seed,
        )
        metrics = trainer.fit(seeded_model(model, seed), copy.deepcopy(dm))
        k = alg.num_clients
        if i == 0:
            ref_budget = int(metrics["client_steps"])
            step_counts = [alg.schedule.num_steps(int(n)) for n in trainer.datamodule.client_sizes]
            ref_alpha = replay.alphas_used.tolist()
            if budget == "match":
                how = {"rule": f"reference: fit spends C = {ref_budget} client-steps", "rounds": None}
            if mia_attack == "calibrated":  # FedAvg shadows at FedAvg's rounds for this budget
                shadow_rounds = max(1, round(ref_budget / max(sum(step_counts), 1)))
                shadows = train_shadows(
                    alg, trainer.module, trainer.datamodule, clients, mia_shadows, shadow_rounds, seed
                )
        mia_cal = None
        if mia_attack == "calibrated":
            mia_cal = calibrated_mia(alg, trainer, shadows, clients, seed, after=replay_mode == "measured")
        s = replay.summary or {}
        # every client's exact cost, predicted from the fitted state (the replay restored it)
        z_steps = [float(alg.predict_cost([c])) for c in range(k)]
        z_latency = [float(z) for z in latencies(alg, range(k)).values()]
        measured = [r for r in replay.rows if r["measured"] and r["Z_seconds"] is not None]
        z_sec = [float(r["Z_seconds"]) for r in measured]
        row = {
            "method": method_label(alg),
            "seed": seed,
            "fit_client_steps": int(metrics["client_steps"]),
            "test_accuracy": metrics["test_accuracy"],
            "t": s.get("unlearn_seconds_mean"),
            "client_steps": s.get("unlearn_client_steps_mean"),
            "cost_std_steps": statistics.pstdev(z_steps) if z_steps else None,
            "clients_in_M_e_steps": len(z_steps),
            "M_e_steps": _me(z_steps, [ref_alpha[c] for c in range(k)], eps_alpha),
            "M_e_latency": _me(z_latency, [ref_alpha[c] for c in range(k)], eps_alpha),
            "M_e_seconds": _me(z_sec, [ref_alpha[r["client"]] for r in measured], eps_alpha),
            "M_p": s.get("M_p"),
            "mia_f1_before": s.get("mia_f1_before") if mia_cal is None else mia_cal["before"].f1,
            "mia_f1_after": s.get("mia_f1_after") if mia_cal is None else _after(mia_cal, "f1"),
            "mia_auc_before": s.get("mia_auc_before") if mia_cal is None else mia_cal["before"].auc,
            "mia_auc_after": s.get("mia_auc_after") if mia_cal is None else _after(mia_cal, "auc"),
            "mia_tpr_before": None if mia_cal is None else mia_cal["before"].tpr_at_1fpr,
            "mia_tpr_after": None if mia_cal is None else _after(mia_cal, "tpr_at_1fpr"),
            "test_accuracy_after": s.get("test_accuracy_after_mean"),
            "budget_rule": how["rule"],
            "rounds": how.get("rounds"),
            "run_dir": str(trainer.run_dir),
            "_z_steps": z_steps,
            "_z_seconds": z_sec,
            "_mia": mia_cal,
            "num_clients": k,
            "merge_rate": getattr(alg, "merge_rate", None),
            "stages": len(getattr(alg, "records", []) or []) or None,
            "leaving_together": len(clients),
            "r2_steps": _r2(alg, clients),
        }
        if alg.name == "fedavg":
            fa_cost = row["client_steps"]
        rows.append(row)
        spent = metrics["client_steps"] + sum(r["Z_steps"] for r in replay.rows if r["measured"])
        progress.update(
            spent,
            f"method {progress.items_done + 1}/{progress.items} {method_label(alg)} (seed {seed}) done · "
            f"test_accuracy {metrics['test_accuracy']:.4f}",
            item=True,
        )
    for row in rows:
        row["speedup_steps"] = (fa_cost / row["client_steps"]) if fa_cost and row["client_steps"] else None
    return rows


def _log_wandb(
    out: Path, agg: list[dict[str, Any]], rows: list[dict[str, Any]], meta: dict[str, Any]
) -> None:
    """The summary as a W&B table: per column its mean and sample std over seeds, as in compare.md.

    The table's run joins the group of the method runs it summarizes (the setting, e.g.
    ``digits-K64-rho0.1``), is named after it, and records the methods, seeds, clients and the
    W&B ids of those runs, so that two comparisons in one project stay apart.
    """
    import wandb

    from fedshard_lightning.loggers.run_loggers import wandb_state

    states = [wandb_state(Path(r["run_dir"])) for r in rows]
    group = next((st["group"] for st in states if st.get("group")), None)
    config = {
        **meta,
        "methods": list(dict.fromkeys(r["method"] for r in rows)),
        "runs": [st["id"] for st in states if st.get("id")],
    }
    run = wandb.init(
        project="fedshard-lightning",
        name=f"compare-{group}" if group else "compare",
        group=group,
        job_type="compare",
        config=config,
        dir=str(out),
        mode="offline",
    )
    cols = ["method", "seeds", *(f"{h}, {stat}" for _, h, _ in COLUMNS for stat in ("mean", "sample std"))]
    data = [
        [e["method"], len(e["seeds"]), *(e[k][stat] for k, _, _ in COLUMNS for stat in ("mean", "std"))]
        for e in agg
    ]
    run.log({"compare": wandb.Table(columns=cols, data=data)})
    run.finish()


def main(args: list[str] | None = None, prog: str | None = None) -> None:
    """Command line: ``python -m fedshard_lightning compare --help`` (or ``python -m fedshard_lightning.experiments.compare``)."""
    result = run_cli(compare, args, prog)
    print((Path(result["output"]) / "compare.md").read_text())


if __name__ == "__main__":
    main()
