"""FedShard at scale: fit and unlearn K = 4096 or 65,536 clients through the public API.

Phases, each in a fresh Python process so that its peak RSS (``ru_maxrss``) is its own:

1. ``fit``: :class:`~fedshard_lightning.FederatedTrainer` with
   :class:`~fedshard_lightning.unlearning.FedShard` (R = 2, A1, A2 rounds in [2, 8], batch 10, 1
   local epoch) on IID synthetic data, ``--samples-per-client`` samples per client (64 features,
   10 classes), MLP 64-64;
2. ``unlearn-1``: ``trainer.unlearn`` of one client, from the run directory (loads the FLCache,
   retrains, commits a new cache version, writes the report);
3. ``unlearn-16``: a second request of 16 other clients (requests accumulate);

or, with ``--load-only`` on an existing ``--root``: ``load``, the current version loaded piece by
piece (cache metadata, tree and shard records, model blobs), then the whole ``store.restore``;
or, with ``--requests N``: ``fit``, then N single-client requests in one process (``requests``),
``audit`` (replay of the whole frozen tree), ``gc`` (``python -m fedshard_lightning cache gc
--keep 1``) and ``audit-after-gc``. ``--audit`` appends the last three to the default phases.

Per phase: wall-clock seconds of the trainer call (``fit`` / ``unlearn`` as a user sees it), the
algorithm's own seconds (training only, as in the reports), client-steps, peak RSS, the RSS before
any data or model existed (the interpreter and imports), and the FLCache on disk: bytes of the
unique files under ``RUN/cache`` (blobs are shared by versions) against the paper's O(K) bound of
K + P models (Appendix D, "space complexity": sum_p ceil(K / R^p) <= K + P), and the model blobs
(shard models) that the phase added, against the shards it retrained.

    python benchmarks/scale.py                   # K = 4096
    python benchmarks/scale.py --clients 65536   # K = 65,536
    python benchmarks/scale.py --requests 100    # cache growth over 100 single-client requests
    python benchmarks/scale.py --clients 256     # quick check
    python benchmarks/scale.py --profile /tmp/prof   # also cProfile every phase (top 25 printed)

A cheap K = 65,536 run to time its load (one round per shard, one step per client; ``a1_count``
because the cost-aware ``a1`` is quadratic in stage 1's grouping; the load flags must match the fit's):

    FLAGS="--clients 65536 --fixed-rounds 1 --samples-per-client 10 --merge a1_count --root R"
    python benchmarks/scale.py $FLAGS --fit-only
    python benchmarks/scale.py $FLAGS --load-only
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import quiet_trainer, silence

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.flcache import FLCache
from fedshard_lightning.models import MLP
from fedshard_lightning.sharding import num_stages
from fedshard_lightning.unlearning import FedShard

MERGE_RATE = 2


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cache_state(root: Path) -> dict[str, Any]:
    """Bytes and count of the unique files under ``root``, and the model blobs of the current version."""
    from fedshard_lightning.flcache import FLCache

    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    cache = FLCache(root)
    manifest = cache.manifest()
    models = {d for s in manifest["stacks"] for d in cache.stack_digests(s, manifest=manifest)}
    blobs = {p.name for p in (root / "blobs").rglob("*") if p.is_file() and not p.name.startswith(".")}
    return {"bytes": total, "files": len(seen), "models": models, "blobs": blobs}


def make(args: argparse.Namespace, root: Path) -> tuple[Any, MLP, SyntheticDataModule]:
    """Trainer, model and data of the benchmark's one config (``--fixed-rounds``: a cheap tree builder)."""
    rounds = "fixed" if args.fixed_rounds else "a2"
    common = {"t0": 2, "t1": 8, "batch_size": 10, "local_epochs": 1}
    trainer = quiet_trainer(
        FedShard(
            merge_rate=MERGE_RATE,
            merge=args.merge,
            rounds=rounds,
            fixed_rounds=args.fixed_rounds or 1,
            **common,
        ),
        root=str(root),
        run_name="run",
        vectorize="always",
    )
    dm = SyntheticDataModule(
        num_clients=args.clients,
        partition="iid",
        min_client_size=1,
        num_samples=args.samples_per_client * args.clients,
        num_test=2000,
        shape=(64,),
        noise=2.0,
    )
    return trainer, MLP(hidden=(64, 64), lr=0.1), dm


def leaving(k: int, phase: str, j: int = 0) -> list[int]:
    """The clients of each unlearning request (disjoint, spread over the ids)."""
    if phase == "unlearn-1":
        return [k // 3]
    if phase == "requests":
        return [(k // 5 + j * (k // 101 or 1) + j) % k]
    return sorted({(k // 3 + 1 + i * (k // 16)) % k for i in range(16)})


def load_pieces(trainer: Any, model: MLP, dm: SyntheticDataModule, run: Path) -> dict[str, Any]:
    """Wall and CPU seconds of each piece of loading the run's current version, then of the whole restore.

    After the trainer's setup (data, model, engine: not timed): the cache metadata (``CURRENT``, the
    manifest, every stage's frozen structure and stack index), the tree and shard records rebuilt
    from the structure, the model blobs read, checked and stacked; then ``store.restore`` (all of
    it, including theta^0 and the client sizes, page cache warm). CPU seconds (this process's) tell
    the cost apart from the waiting on a shared machine.
    """
    trainer._setup(model, dm, run, "audit")
    alg, cache = trainer.algorithm, FLCache(run / "cache")
    marks = [(time.perf_counter(), time.process_time())]
    version = cache.current()
    manifest = cache.manifest(version)
    stages = int(manifest["stages_done"])
    structures = [
        cache.tensors(f"structure_{p}.safetensors", version, manifest=manifest) for p in range(1, stages + 1)
    ]
    for p in range(1, stages + 1):
        cache.stack_digests(f"stage_{p}", version, manifest)
    marks.append((time.perf_counter(), time.process_time()))
    alg.restore_structure(structures, {int(c) for c in manifest.get("unlearned", [])})
    marks.append((time.perf_counter(), time.process_time()))
    models = [cache.stack(f"stage_{p}", version, manifest=manifest) for p in range(1, stages + 1)]
    marks.append((time.perf_counter(), time.process_time()))
    del models
    trainer.store.restore(alg, trainer.device, trainer.vectorize)
    marks.append((time.perf_counter(), time.process_time()))
    out: dict[str, Any] = {}
    for name, (w0, c0), (w1, c1) in zip(("metadata", "tree_records", "blobs", "restore"), marks, marks[1:]):
        out[f"load_{name}_s"], out[f"load_{name}_cpu_s"] = w1 - w0, c1 - c0
    return {
        **out,
        "version": version,
        "records": sum(len(r) for r in alg.records),
    }


def run_phase(args: argparse.Namespace) -> None:
    """Child process: run one phase, print one JSON line."""
    root = Path(args.root)
    rss0 = peak_rss_mb()
    cache_root = root / "run" / "cache"
    before = cache_state(cache_root) if args.phase != "fit" else {"blobs": set(), "bytes": 0}
    trainer, model, dm = make(args, root)
    prof = cProfile.Profile() if args.profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    extra: dict[str, Any] = {}
    with silence():
        if args.phase == "fit":
            out = trainer.fit(model, dm)
            algo_s, steps = out["seconds"], out["client_steps"]
            extra = {"test_accuracy": out["test_accuracy"]}
        elif args.phase in ("unlearn-1", "unlearn-16"):
            out = trainer.unlearn(model, dm, str(root / "run"), leaving(args.clients, args.phase))
            algo_s, steps = out["seconds"], out["client_steps"]
            extra = {
                "retrain_client_steps": out["retrain_client_steps"],
                "test_accuracy": out["test_accuracy_after"],
                "shards": len(out["retrained_shards"]),
            }
        elif args.phase == "requests":
            algo_s, steps, shards, per = 0.0, 0, 0, []
            for j in range(args.requests):
                trainer, model, dm = make(args, root)
                tj = time.perf_counter()
                out = trainer.unlearn(model, dm, str(root / "run"), leaving(args.clients, "requests", j))
                per.append(time.perf_counter() - tj)
                algo_s += out["seconds"]
                steps += out["client_steps"]
                shards += len(out["retrained_shards"])
            extra = {
                "test_accuracy": out["test_accuracy_after"],
                "shards": shards,
                "requests": args.requests,
                "request_wall_s_mean": sum(per) / len(per),
            }
        elif args.phase == "load":
            extra = load_pieces(trainer, model, dm, root / "run")
            algo_s, steps = 0.0, 0
        elif args.phase in ("audit", "audit-after-gc"):
            # The algorithm's audit (the trainer's exits 1 on failure): the figures are wanted either way.
            trainer._load_run(model, dm, str(root / "run"), "audit")
            out = trainer.algorithm.audit(args.tolerance)
            algo_s, steps = 0.0, 0
            stage_max: dict[int, float] = {}
            for sh in out["shards"]:
                stage_max[sh["stage"]] = max(stage_max.get(sh["stage"], 0.0), sh["max_abs_diff"])
            extra = {
                "passed": out["passed"],
                "max_abs_diff": out["max_abs_diff"],
                "final_max_abs_diff": out["final_max_abs_diff"],
                "stage_max_abs_diff": [stage_max[q] for q in sorted(stage_max)],
                "tolerance": args.tolerance,
            }
        else:  # gc, through the command line
            from fedshard_lightning.cli import main as cli_main

            cli_main(["cache", "gc", "--ckpt_path", str(root / "run"), "--keep", "1"])
            algo_s, steps = 0.0, 0
    wall = time.perf_counter() - t
    if prof:
        prof.disable()
        path = Path(args.profile) / f"{args.phase}.prof"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(path)
        pstats.Stats(str(path), stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    if trainer.module is None:  # gc: no model was built
        trainer, model, dm = make(args, root)
        model.bind_data(dm.input_shape if hasattr(dm, "input_shape") else (64,), 10)
    n_params = sum(p.numel() for p in model.parameters())
    model_bytes = n_params * torch.finfo(next(model.parameters()).dtype).bits // 8
    after = cache_state(cache_root)
    new_blobs = after["blobs"] - before["blobs"]
    print(
        json.dumps(
            {
                "phase": args.phase,
                "wall_s": wall,
                "algo_s": algo_s,
                "client_steps": steps,
                "peak_rss_mb": peak_rss_mb(),
                "start_rss_mb": rss0,
                "cache_bytes": after["bytes"],
                "cache_files": after["files"],
                "bytes_added": after["bytes"] - before["bytes"],
                "models_current": len(after["models"]),
                "models_added": len(new_blobs & after["models"]),
                "other_blobs_added": len(new_blobs - after["models"]),
                "model_bytes": model_bytes,
                "versions": len(FLCache(cache_root).versions()),
                **extra,
            }
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4096)
    ap.add_argument("--samples-per-client", type=int, default=20)
    ap.add_argument("--root", default=None, help="where the run goes (default: a new temporary folder)")
    ap.add_argument("--profile", default=None, help="folder for one cProfile file per phase")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--requests", type=int, default=0, help="fit, N single-client requests, audit, gc, audit")
    ap.add_argument("--audit", action="store_true", help="append audit, gc, audit-after-gc")
    ap.add_argument("--tolerance", type=float, default=0.0, help="audit tolerance (default 0: bit-exact)")
    ap.add_argument(
        "--fixed-rounds", type=int, default=0, help="N rounds per shard instead of A2 (a cheap tree to load)"
    )
    ap.add_argument(
        "--merge",
        default="a1",
        choices=["a1", "a1_count", "random"],
        help="FedShard's merge policy (default a1)",
    )
    ap.add_argument(
        "--fit-only", action="store_true", help="only the fit phase (e.g. to --load-only it later)"
    )
    ap.add_argument("--load-only", action="store_true", help="time loading the run in --root, piece by piece")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.phase:
        run_phase(args)
        return
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-scale-"))
    k, p = args.clients, num_stages(args.clients, MERGE_RATE)
    print(
        f"K={k}, R={MERGE_RATE}, P={p}, {args.samples_per_client} samples per client, torch {torch.__version__} "
        f"with {torch.get_num_threads()} intra-op threads; run in {root}",
        flush=True,
    )
    tail = ["audit", "gc", "audit-after-gc"]
    phases = ["fit", "requests", *tail] if args.requests else ["fit", "unlearn-1", "unlearn-16"]
    if args.audit and not args.requests:
        phases += tail
    if args.fit_only or args.load_only:
        phases = ["fit"] if args.fit_only else ["load"]
    results = []
    for phase in phases:
        cmd = [sys.executable, __file__, "--phase", phase, "--root", str(root), "--clients", str(k)]
        cmd += ["--samples-per-client", str(args.samples_per_client), "--requests", str(args.requests)]
        cmd += [
            "--tolerance",
            str(args.tolerance),
            "--fixed-rounds",
            str(args.fixed_rounds),
            "--merge",
            args.merge,
        ]
        if args.profile:
            cmd += ["--profile", args.profile]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"phase {phase} failed:\n{proc.stderr[-4000:]}")
        if args.profile:
            print(proc.stderr, file=sys.stderr)
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{phase}: done in {results[-1]['wall_s']:.1f} s", flush=True)
    mb = results[0]["model_bytes"]
    bound = (k + p) * mb
    print(f"\nmodel: {mb:,} bytes; K + P = {k + p} models = {bound:,} bytes\n")
    head = [
        "phase",
        "wall s",
        "training s",
        "client-steps",
        "peak RSS MiB",
        "RSS after imports MiB",
        "cache MB (unique files)",
        "/ (K+P) models",
        "shards retrained",
        "models added",
        "other blobs added",
        "MB added",
        "versions",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        name = r["phase"]
        if "retrain_client_steps" in r:
            name += f" (retraining the tree: {r['retrain_client_steps']} steps)"
        if r["phase"] == "requests":
            name += f" ({r['requests']} x 1 client, {r['request_wall_s_mean']:.1f} s each)"
        if r["phase"] == "load":
            name += (
                f" ({r['version']}, {r['records']} shard records; wall / CPU s: metadata "
                f"{r['load_metadata_s']:.3f} / {r['load_metadata_cpu_s']:.3f}, tree + records "
                f"{r['load_tree_records_s']:.3f} / {r['load_tree_records_cpu_s']:.3f}, blobs "
                f"{r['load_blobs_s']:.2f} / {r['load_blobs_cpu_s']:.2f}; whole restore "
                f"{r['load_restore_s']:.2f} / {r['load_restore_cpu_s']:.2f})"
            )
        if "passed" in r:
            name += (
                f" ({'passed' if r['passed'] else 'FAILED'} at {r['tolerance']:.0e}: max abs diff "
                f"{r['max_abs_diff']:.1e}, final model {r['final_max_abs_diff']:.1e}, stage 1 "
                f"{r['stage_max_abs_diff'][0]:.1e})"
            )
        row = [
            name,
            f"{r['wall_s']:.1f}",
            f"{r['algo_s']:.1f}",
            str(r["client_steps"]),
            f"{r['peak_rss_mb']:.0f}",
            f"{r['start_rss_mb']:.0f}",
            f"{r['cache_bytes'] / 1e6:.1f}",
            f"{r['cache_bytes'] / bound:.3f}",
            str(r.get("shards", "-" if r["phase"] != "fit" else r["models_current"])),
            str(r["models_added"]),
            str(r["other_blobs_added"]),
            f"{r['bytes_added'] / 1e6:.2f}",
            str(r["versions"]),
        ]
        print("| " + " | ".join(row) + " |", flush=True)
    if args.requests:
        after = next(r for r in results if r["phase"] == "requests")
        limit = 1.1 * (k + p) + args.requests * p
        print(
            f"\ncache after fit + {args.requests} requests: {after['cache_bytes'] / mb:.1f} models "
            f"(bound 1.1 (K + P) + {args.requests} P = {limit:.1f})"
        )
    accs = [f"{r['phase']} {r['test_accuracy']:.4f}" for r in results if "test_accuracy" in r]
    print("test accuracy: " + ", ".join(accs))


if __name__ == "__main__":
    main()
