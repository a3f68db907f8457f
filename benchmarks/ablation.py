"""FedShard ablation at equal client-step budgets: M_e in client-steps per variant, paired over seeds.

Rows (SPEC section 5, docs/fairness.md "FedShard's defaults and our variants"):

- ``A1 + A2 (paper)``: ``merge: a1, rounds: auto``, FedShard as the paper specifies it. Its fit's
  client-steps ``C`` are the seed's budget; its model's probe round gives every client's alpha, the
  weights of every row's M_e (one reference, as ``compare`` does).
- ``naive``: ``merge: random, rounds: fixed``; ``A1 + fixed``: ``merge: a1, rounds: fixed``; both
  with ``fixed_rounds = round(C / (P S))`` (``P`` stages, ``S`` the client-steps of one round of
  all clients).
- ``a1_cost``: ``merge: a1_cost, rounds: auto``; ``stage_a2``: ``merge: a1, rounds: stage_a2``;
  ``a1_path + stage_a2``: ``merge: a1_path, rounds: stage_a2`` (the comparison's variant). Their
  calibration cap is ``floor(C / (P S))`` (:func:`~fedshard_lightning.experiments.budget.match_budget`),
  so that they train no more than ``C``.
- ``FedAvg``: retraining at ``round(C / S)`` rounds; its client-step cost ``Z_c = T (S - s_c)`` is
  exact without training (every client in every round), so its M_e at ``T`` rounds is ``T^2`` times
  its M_e at one round. Every row is compared with FedAvg at that row's own fit budget ``B``
  (``T = round(B / S)``): a row whose calibration stopped before the cap is not flattered by a
  FedAvg that trained longer.

Every row's ``Z_c`` is FedShard's ``predict_cost([c])`` from its frozen tree (exact client-steps).
Printed: per seed and row M_e over FedAvg's at the row's budget and the row's budget over ``C``; then
per row the mean fit client-steps and M_e, the geometric
mean of M_e / M_e(FedAvg) with its 95% t interval (on log ratios), and the paired differences of M_e
against the paper row and against FedAvg at the row's budget, mean and 95% t interval over seeds.

    python benchmarks/ablation.py --seeds 0 1 2 3 4 --jobs 3 --json runs/ablation.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from concurrent.futures import ProcessPoolExecutor
from typing import Any

ROWS = ["A1 + A2 (paper)", "naive", "A1 + fixed", "a1_cost", "stage_a2", "a1_path + stage_a2", "FedAvg"]


def run_seed(seed: int, clients: int, local_epochs: int, max_rounds: int) -> dict[str, Any]:
    """Fit every row for one seed; return each row's fit client-steps, M_e and cost std."""
    import contextlib
    import io
    import tempfile

    from fedshard_lightning.data import DigitsDataModule
    from fedshard_lightning.experiments.budget import match_budget
    from fedshard_lightning.experiments.common import seeded_model, with_seed
    from fedshard_lightning.experiments.compare import _me
    from fedshard_lightning.metrics.client_alpha import client_alphas
    from fedshard_lightning.models import MLP
    from fedshard_lightning.sharding import num_stages
    from fedshard_lightning.trainer import FederatedTrainer
    from fedshard_lightning.unlearning import FedShard

    local = {"merge_rate": 2, "batch_size": 10, "local_epochs": local_epochs, "max_rounds": max_rounds}
    data = DigitsDataModule(num_clients=clients, partition="dirichlet", rho=0.1, min_client_size=3)
    root = tempfile.mkdtemp(prefix="ablation-")

    def fit(alg: Any) -> Any:
        trainer = FederatedTrainer(
            algorithm=alg,
            default_root_dir=root,
            enable_progress_bar=False,
            eval_every_n_rounds=0,
            enable_fairness=False,
            seed=seed,
        )
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.fit(seeded_model(MLP(hidden=(64, 64), lr=0.1), seed), with_seed(data, seed))
        return trainer

    paper = fit(FedShard(merge="a1", rounds="auto", **local))
    alg = paper.algorithm
    alphas = client_alphas(paper).tolist()
    steps = [float(alg.schedule.num_steps(int(n))) for n in paper.datamodule.client_sizes]
    c_budget, per_round = int(alg.total_client_steps), sum(steps)
    stages = num_stages(clients, 2)
    rows: dict[str, dict[str, float]] = {}

    def record(name: str, fitted: Any) -> None:
        a = fitted.algorithm
        z = [float(a.predict_cost([c])) for c in range(clients)]
        rows[name] = {
            "fit_client_steps": float(a.total_client_steps),
            "M_e": _me(z, alphas, 1e-6),
            "cost_std": statistics.pstdev(z),
            "rounds": [max(r.rounds for r in recs) for recs in a.records],
        }

    record("A1 + A2 (paper)", paper)
    t_fixed = max(1, round(c_budget / (stages * per_round)))
    for name, template in {
        "naive": FedShard(merge="random", rounds="fixed", fixed_rounds=t_fixed, **local),
        "A1 + fixed": FedShard(merge="a1", rounds="fixed", fixed_rounds=t_fixed, **local),
        "a1_cost": FedShard(merge="a1_cost", rounds="auto", **local),
        "stage_a2": FedShard(merge="a1", rounds="stage_a2", **local),
        "a1_path + stage_a2": FedShard(merge="a1_path", rounds="stage_a2", **local),
    }.items():
        matched, _ = match_budget(template, c_budget, steps)
        record(name, fit(matched))
    t_avg = max(1, round(c_budget / per_round))
    z_fa = [t_avg * (per_round - s) for s in steps]
    rows["FedAvg"] = {
        "fit_client_steps": t_avg * per_round,
        "M_e": _me(z_fa, alphas, 1e-6),
        "cost_std": statistics.pstdev(z_fa),
        "rounds": [t_avg],
    }
    return {"seed": seed, "budget": c_budget, "rows": rows}


def _t95(n: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1))


def _mean_ci(values: list[float]) -> tuple[float, float, float]:
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan, math.nan
    h = _t95(len(values)) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - h, m + h


def fedavg_at(res: dict[str, Any], budget: float) -> float:
    """FedAvg retraining's M_e at ``round(budget / S)`` rounds (``Z_c = T (S - s_c)``: M_e grows as ``T^2``)."""
    fa = res["rows"]["FedAvg"]
    t_ref = fa["rounds"][0]
    per_round = fa["fit_client_steps"] / t_ref
    return fa["M_e"] * (max(1, round(budget / per_round)) / t_ref) ** 2


def summarize(results: list[dict[str, Any]]) -> str:
    """Per-seed rows, then per row: mean M_e, ratio to FedAvg and paired differences with 95% t CIs."""
    results = sorted(results, key=lambda r: r["seed"])
    lines = [
        "M_e / M_e of FedAvg at the row's fit budget, per seed (the row's fit client-steps / C below it):",
        "",
        "| seed | C | " + " | ".join(ROWS[:-1]) + " |",
        "|---|---|" + "---|" * (len(ROWS) - 1),
    ]
    for res in results:
        cells = []
        for name in ROWS[:-1]:
            r = res["rows"][name]
            ratio = r["M_e"] / fedavg_at(res, r["fit_client_steps"])
            cells.append(f"{ratio:.2f} ({r['fit_client_steps'] / res['budget']:.2f})")
        lines.append(f"| {res['seed']} | {res['budget']:,} | " + " | ".join(cells) + " |")
    n = len(results)
    lines += [
        "",
        f"{n} seeds ({', '.join(str(r['seed']) for r in results)}); 95% t intervals, {n - 1} degrees of freedom.",
        "",
        "| row | fit client-steps (mean) | M_e (mean) | M_e / FedAvg: geometric mean [95% CI] | "
        "seeds below FedAvg | M_e - paper: mean [95% CI] | M_e - FedAvg at the row's budget: mean [95% CI] |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ROWS:
        me = [r["rows"][name]["M_e"] for r in results]
        fa = [fedavg_at(r, r["rows"][name]["fit_client_steps"]) for r in results]
        paper = [r["rows"]["A1 + A2 (paper)"]["M_e"] for r in results]
        fit = statistics.fmean(r["rows"][name]["fit_client_steps"] for r in results)
        lm, llo, lhi = _mean_ci([math.log(a / b) for a, b in zip(me, fa)])
        dp = _mean_ci([a - b for a, b in zip(me, paper)])
        df = _mean_ci([a - b for a, b in zip(me, fa)])
        below = sum(a < b for a, b in zip(me, fa))
        lines.append(
            f"| {name} | {fit:,.0f} | {statistics.fmean(me):.3g} | {math.exp(lm):.2f} "
            f"[{math.exp(llo):.2f}, {math.exp(lhi):.2f}] | {below}/{n} | "
            f"{dp[0]:.3g} [{dp[1]:.3g}, {dp[2]:.3g}] | {df[0]:.3g} [{df[1]:.3g}, {df[2]:.3g}] |"
        )
    return "\n".join(lines)


def main() -> None:
    """Fit every seed (``--jobs`` at a time), print the per-seed and the paired tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--local_epochs", type=int, default=2)
    ap.add_argument("--max_rounds", type=int, default=30, help="calibration cap of the paper row (auto)")
    ap.add_argument("--jobs", type=int, default=1, help="seeds fitted at once (one process each)")
    ap.add_argument("--json", default=None, help="write every seed's rows here")
    ap.add_argument(
        "--from_json", nargs="+", default=None, help="only print the tables of earlier --json files"
    )
    args = ap.parse_args()
    if args.from_json:
        results = []
        for path in args.from_json:
            with open(path) as f:
                results += json.load(f)
        print(summarize(results))
        return
    work = [(s, args.clients, args.local_epochs, args.max_rounds) for s in args.seeds]
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(run_seed, *zip(*work)))
    else:
        results = [run_seed(*w) for w in work]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(summarize(results))


if __name__ == "__main__":
    main()
