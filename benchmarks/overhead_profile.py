"""Where a fit's and an unlearning request's time goes outside the engine's local training (cProfile).

Profiles, in one warm process with 1 torch thread:

* ``fedavg``: the default fit of ``benchmarks/peers.py`` (digits MLP, K = 64, FedAvg 20 rounds,
  batch 10, default callbacks: progress, per-round test evaluation, CSV, cache commits);
* ``fedshard``: FedShard on the same data (R = 2, A1, A2 in [2, 8]) with default callbacks;
* ``unlearn``: one single-client FedShard request (``what_if``, no disk writes) at K = 64 and
  K = 256 (the data of ``benchmarks/unlearning_speed.py``: synthetic, 20 samples per client).
* ``rounds``: the engine's CPU time per round for groups of 1 to K clients on that data (the
  fixed cost per round, without cProfile).

For each it prints the timed seconds and the cumulative seconds of named parts (local training,
the ``auto`` probe, the kernel build, aggregation, the per-round hook with its evaluation, logging
and progress, the cache commits, the unlearning bookkeeping), then cProfile's top functions.
``--torch-profiler`` adds torch.profiler's table of operator time for the engine part of the fit.

    python benchmarks/overhead_profile.py --what fedavg fedshard unlearn
    python benchmarks/overhead_profile.py --what rounds --clients 64    # engine CPU ms per round
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import tempfile
import time
from typing import Any

import torch

from fedshard_lightning import FederatedTrainer
from fedshard_lightning.data import DigitsDataModule, SyntheticDataModule
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedAvg, FedShard

# (label, file suffix, function name): cumulative time of each is reported.
PARTS = [
    ("fit (timed span)", "trainer/trainer.py", "_run_fit"),
    ("engine.train_groups", "engine/engine.py", "train_groups"),
    ("  lean rounds (run_lean)", "engine/lean_rounds.py", "run_lean"),
    ("    lean segment setup", "engine/lean_rounds.py", "__init__"),
    ("    lean averaging", "engine/lean_rounds.py", "_average"),
    ("    lean records", "engine/lean_rounds.py", "_record"),
    ("  local training (stacked)", "engine/local.py", "train_stacked"),
    ("  local training (loop)", "engine/local.py", "train_loop"),
    ("  auto probe (choose_path)", "engine/path_choice.py", "choose_path"),
    ("  kernel build + check", "engine/local.py", "program"),
    ("  aggregation (GroupSums.add)", "engine/aggregate.py", "add"),
    ("  batch schedule (plan)", "engine/schedule.py", "plan"),
    ("  per-round hook (round_end)", "trainer/trainer.py", "round_end"),
    ("    test evaluation", "trainer/trainer.py", "evaluate"),
    ("    group average", "trainer/trainer.py", "sample_weighted_average"),
    ("    fabric.call (callbacks)", "lightning/fabric/fabric.py", "call"),
    ("    progress on_round_end", "callbacks/progress.py", "on_round_end"),
    ("    metrics on_round_end", "callbacks/metrics_logger.py", "on_round_end"),
    ("    CSV writes (save)", "lightning/fabric/loggers/csv_logs.py", "save"),
    ("stage_end (commit + callbacks)", "trainer/trainer.py", "stage_end"),
    ("cache commit (RunStore.commit)", "run/store.py", "commit"),
    ("stage test evaluation (events.evaluate)", "trainer/trainer.py", "evaluate"),
    ("stage loop (StageLoop.fit)", "trainer/stage_loop.py", "fit"),
    ("  next_stage (merge, rounds)", "unlearning/fedshard.py", "next_stage"),
    ("  absorb", "unlearning/fedshard.py", "absorb"),
    ("unlearn (what_if)", "unlearning/planner.py", "what_if"),
    ("  plan_unlearn", "unlearning/fedshard.py", "plan_unlearn"),
    ("  plan_retrain (retrain cost)", "unlearning/fedshard.py", "plan_retrain"),
    ("  plan costs", "unlearning/planner.py", "cost"),
    ("  ratio_counting_leaving", "unlearning/fedshard.py", "ratio_counting_leaving"),
    ("  run_plans", "unlearning/planner.py", "run_plans"),
    ("  children average", "unlearning/fedshard.py", "_children_average"),
    ("  contract checks", "unlearning/plan_contract.py", "_call"),
]


def cumulative(stats: pstats.Stats) -> dict[str, tuple[int, float]]:
    """Calls and cumulative seconds of every part in :data:`PARTS` (first match by file and name)."""
    out = {}
    for label, suffix, name in PARTS:
        hits = [
            (v[1], v[3])
            for (fn, _line, func), v in stats.stats.items()  # type: ignore[attr-defined]
            if func == name and fn.replace("\\", "/").endswith(suffix)
        ]
        if hits:
            out[label] = (sum(h[0] for h in hits), sum(h[1] for h in hits))
    return out


def report(title: str, prof: cProfile.Profile, seconds: float, top: int) -> None:
    """Print the parts and the top functions of one profile."""
    stats = pstats.Stats(prof)
    print(f"\n### {title}: timed {seconds:.3f} s (under cProfile)")
    print("| part | calls | cumulative s | share |\n|---|---|---|---|")
    for label, (calls, ct) in cumulative(stats).items():
        print(f"| {label} | {calls} | {ct:.4f} | {100 * ct / seconds:.0f}% |")
    if top:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        print("```\n" + "\n".join(buf.getvalue().splitlines()[6:]) + "\n```")


def digits_fit(alg: Any, **kw: Any) -> tuple[dict[str, Any], FederatedTrainer]:
    """A fit on digits K = 64 with the default callbacks (peers.py's ``ours``), prints swallowed."""
    dm = DigitsDataModule(num_clients=64, partition="iid", seed=0)
    trainer = FederatedTrainer(algorithm=alg, default_root_dir=tempfile.mkdtemp(prefix="prof-"), seed=0, **kw)
    with contextlib.redirect_stdout(io.StringIO()):
        metrics = trainer.fit(MLP(hidden=(64, 64), lr=0.05), dm)
    return metrics, trainer


def profile_fit(name: str, make: Any, top: int, repeats: int) -> None:
    """Warm up, time default vs quiet (medians), then profile one default fit."""
    digits_fit(make())
    quiet = {"enable_progress_bar": False, "eval_every_n_rounds": 0}
    default_s = sorted(digits_fit(make())[0]["seconds"] for _ in range(repeats))
    quiet_s = sorted(digits_fit(make(), **quiet)[0]["seconds"] for _ in range(repeats))
    print(
        f"\n{name}: default callbacks {default_s[len(default_s) // 2]:.3f} s, quiet "
        f"{quiet_s[len(quiet_s) // 2]:.3f} s (medians of {repeats}; runs {default_s} / {quiet_s})"
    )
    prof = cProfile.Profile()
    prof.enable()
    metrics, _ = digits_fit(make())
    prof.disable()
    report(f"{name}, default callbacks", prof, metrics["seconds"], top)


def _synthetic(k: int, num_test: int, **kw: float) -> SyntheticDataModule:
    """unlearning_speed.py's data: K IID clients of 20 samples with 64 features."""
    return SyntheticDataModule(
        num_clients=k,
        partition="iid",
        min_client_size=1,
        seed=0,
        num_samples=20 * k,
        num_test=num_test,
        shape=(64,),
        **kw,
    )


def profile_unlearn(k: int, top: int) -> None:
    """Fit FedShard at K (synthetic, quiet, stacked) and profile one single-client request."""
    dm = _synthetic(k, num_test=2000, noise=2.0)
    alg = FedShard(merge_rate=2, rounds="a2", t0=2, t1=8, batch_size=10, local_epochs=1)
    trainer = FederatedTrainer(
        algorithm=alg,
        default_root_dir=tempfile.mkdtemp(prefix="prof-"),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize="always",
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(MLP(hidden=(64, 64), lr=0.1), dm)
    fitted = alg.state_dict()
    alg.what_if(fitted, [k // 2 + 1])  # warm
    times = []
    for c in (k // 6, k // 2, 5 * k // 6):
        t = time.perf_counter()
        alg.what_if(fitted, [c])
        times.append(time.perf_counter() - t)
    prof = cProfile.Profile()
    prof.enable()
    t = time.perf_counter()
    _, res = alg.what_if(fitted, [k // 2])
    seconds = time.perf_counter() - t
    prof.disable()
    print(
        f"\nunlearn K={k}: {sorted(times)[1]:.3f} s median of 3 unprofiled requests; "
        f"{res.client_steps} client-steps; engine calls = stages retrained"
    )
    report(f"FedShard unlearn, K={k}, one client", prof, seconds, top)


def round_cost(k: int, rounds: int = 40, repeats: int = 7) -> None:
    """Engine CPU time per round (best of ``repeats``) for groups of 1 to K clients, 2 steps each.

    The data of ``profile_unlearn`` (20 samples per client, batch 10): a round of m clients runs
    two stacked steps of m clients; the 1-client figure is the fixed cost per round that decides
    unlearning's wall-clock at small K.
    """
    from fedshard_lightning.engine.engine import FederatedEngine, Group, stack_params
    from fedshard_lightning.engine.schedule import LocalSchedule

    dm = _synthetic(k, num_test=200)
    dm.setup()
    torch.manual_seed(0)
    model = MLP(hidden=(64, 64), lr=0.1)
    model.bind_data(dm.input_shape, dm.num_classes)
    eng = FederatedEngine(model, dm, LocalSchedule(batch_size=10), seed=0, vectorize="always")
    theta = eng.module_params()
    cases = {
        "1 group of 1 client": [Group(0, (5,), rounds)],
        "8 groups of 1": [Group(i, (i,), rounds) for i in range(8)],
        "4 groups of 8": [Group(i, tuple(range(8 * i, 8 * i + 8)), rounds) for i in range(4)],
        f"1 group of {k}": [Group(0, tuple(range(k)), rounds)],
    }
    print(f"\n### engine CPU ms per round (best of {repeats} calls of {rounds} rounds, K = {k})")
    print("| groups | ms per round |\n|---|---|")
    for name, groups in cases.items():
        init = stack_params([theta] * len(groups))
        eng.train_groups(init, groups)
        best = float("inf")
        for _ in range(repeats):
            t = time.process_time()
            eng.train_groups(init, groups)
            best = min(best, time.process_time() - t)
        print(f"| {name} | {1e3 * best / rounds:.3f} |")


def torch_profile_fit(rows: int) -> None:
    """torch.profiler's operator table of the engine part of the default FedAvg fit."""
    from torch.profiler import ProfilerActivity, profile

    digits_fit(FedAvg(rounds=20, batch_size=10, local_epochs=1))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        digits_fit(FedAvg(rounds=20, batch_size=10, local_epochs=1))
    print("\n### torch.profiler, default FedAvg fit (operators by self CPU time)")
    print("```\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows) + "\n```")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--what", nargs="+", choices=["fedavg", "fedshard", "unlearn", "rounds"], default=["fedavg"]
    )
    ap.add_argument("--clients", type=int, nargs="+", default=[64, 256], help="K of the unlearn profiles")
    ap.add_argument("--top", type=int, default=15, help="cProfile's top functions by own time")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--torch-profiler", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    if "fedavg" in args.what:
        profile_fit(
            "FedAvg 20 rounds",
            lambda: FedAvg(rounds=20, batch_size=10, local_epochs=1),
            args.top,
            args.repeats,
        )
    if "fedshard" in args.what:
        profile_fit("FedShard", lambda: FedShard(batch_size=10, local_epochs=1), args.top, args.repeats)
    if "unlearn" in args.what:
        for k in args.clients:
            profile_unlearn(k, args.top)
    if "rounds" in args.what:
        round_cost(args.clients[0])
    if args.torch_profiler:
        torch_profile_fit(args.top)


if __name__ == "__main__":
    main()
