"""FedShard at scale: fit and unlearn K = 4096 clients through the public API.

Three phases, each in a fresh Python process so that its peak RSS (``ru_maxrss``) is its own:

1. ``fit``: :class:`~fedshard_lightning.FederatedTrainer` with
   :class:`~fedshard_lightning.unlearning.FedShard` (R = 2, A1, A2 rounds in [2, 8], batch 10, 1
   local epoch) on IID synthetic data, ``--samples-per-client`` samples per client (64 features,
   10 classes), MLP 64-64;
2. ``unlearn-1``: ``trainer.unlearn`` of one client, from the run directory (loads the FLCache,
   retrains, commits a new cache version, writes the report);
3. ``unlearn-16``: a second request of 16 other clients (requests accumulate).

Per phase: wall-clock seconds of the trainer call (``fit`` / ``unlearn`` as a user sees it), the
algorithm's own seconds (training only, as in the reports), client-steps, peak RSS, the RSS before
any data or model existed (the interpreter and imports), and the FLCache on disk: bytes of the
unique inodes under ``RUN/cache`` (versions share unchanged files through hard links), against the
paper's O(K) bound of K + P models (Appendix D, "space complexity": sum_p ceil(K / R^p) <= K + P).

    python benchmarks/scale.py                   # K = 4096
    python benchmarks/scale.py --clients 256     # quick check
    python benchmarks/scale.py --profile /tmp/prof   # also cProfile every phase (top 25 printed)
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
from fedshard_lightning.models import MLP
from fedshard_lightning.sharding import num_stages
from fedshard_lightning.unlearning import FedShard

MERGE_RATE = 2


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cache_bytes(root: Path) -> tuple[int, int, int]:
    """Bytes of the unique inodes under ``root``, their number, and the bytes of the current version alone."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    current = json.loads((root / "CURRENT").read_text())["version"]
    own = sum(p.stat().st_size for p in (root / current).iterdir())
    return total, len(seen), own


def make(args: argparse.Namespace, root: Path) -> tuple[Any, MLP, SyntheticDataModule]:
    """Trainer, model and data of the benchmark's one config."""
    trainer = quiet_trainer(
        FedShard(merge_rate=MERGE_RATE, rounds="a2", t0=2, t1=8, batch_size=10, local_epochs=1),
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


def leaving(k: int, phase: str) -> list[int]:
    """The clients of each unlearning request (disjoint, spread over the ids)."""
    if phase == "unlearn-1":
        return [k // 3]
    return sorted({(k // 3 + 1 + i * (k // 16)) % k for i in range(16)})


def run_phase(args: argparse.Namespace) -> None:
    """Child process: run one phase, print one JSON line."""
    root = Path(args.root)
    rss0 = peak_rss_mb()
    trainer, model, dm = make(args, root)
    prof = cProfile.Profile() if args.profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    with silence():
        if args.phase == "fit":
            out = trainer.fit(model, dm)
            algo_s, steps = out["seconds"], out["client_steps"]
            extra = {"test_accuracy": out["test_accuracy"]}
        else:
            out = trainer.unlearn(model, dm, str(root / "run"), leaving(args.clients, args.phase))
            algo_s, steps = out["seconds"], out["client_steps"]
            extra = {
                "retrain_client_steps": out["retrain_client_steps"],
                "test_accuracy": out["test_accuracy_after"],
                "shards": len(out["retrained_shards"]),
            }
    wall = time.perf_counter() - t
    if prof:
        prof.disable()
        path = Path(args.profile) / f"{args.phase}.prof"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(path)
        pstats.Stats(str(path), stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    n_params = sum(p.numel() for p in trainer.module.parameters())
    model_bytes = n_params * trainer.module.param_dtype.itemsize
    total, files, own = cache_bytes(root / "run" / "cache")
    print(
        json.dumps(
            {
                "phase": args.phase,
                "wall_s": wall,
                "algo_s": algo_s,
                "client_steps": steps,
                "peak_rss_mb": peak_rss_mb(),
                "start_rss_mb": rss0,
                "cache_bytes": total,
                "cache_files": files,
                "current_version_bytes": own,
                "model_bytes": model_bytes,
                "versions": len(trainer.cache.versions()),
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
    ap.add_argument(
        "--phase", choices=["fit", "unlearn-1", "unlearn-16"], default=None, help=argparse.SUPPRESS
    )
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
    results = []
    for phase in ("fit", "unlearn-1", "unlearn-16"):
        cmd = [sys.executable, __file__, "--phase", phase, "--root", str(root), "--clients", str(k)]
        cmd += ["--samples-per-client", str(args.samples_per_client)]
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
    bound = (k + p) * results[0]["model_bytes"]
    print(f"\nmodel: {results[0]['model_bytes']:,} bytes; K + P = {k + p} models = {bound:,} bytes\n")
    head = [
        "phase",
        "wall s",
        "training s",
        "client-steps",
        "peak RSS MiB",
        "RSS after imports MiB",
        "cache MB (unique inodes)",
        "/ (K+P) models",
        "current version MB",
        "versions",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        name = r["phase"]
        if name != "fit":
            name += (
                f" ({r['shards']} shards retrained, retraining the tree: {r['retrain_client_steps']} steps)"
            )
        row = [
            name,
            f"{r['wall_s']:.1f}",
            f"{r['algo_s']:.1f}",
            str(r["client_steps"]),
            f"{r['peak_rss_mb']:.0f}",
            f"{r['start_rss_mb']:.0f}",
            f"{r['cache_bytes'] / 1e6:.1f}",
            f"{r['cache_bytes'] / bound:.2f}",
            f"{r['current_version_bytes'] / 1e6:.1f}",
            str(r["versions"]),
        ]
        print("| " + " | ".join(row) + " |", flush=True)
    print(
        f"\ntest accuracy: fit {results[0]['test_accuracy']:.4f}, after the requests "
        f"{results[1]['test_accuracy']:.4f}, {results[2]['test_accuracy']:.4f}"
    )


if __name__ == "__main__":
    main()
