"""Start-up of a FedAvg CNN fit on MNIST-shaped data: seconds to the first line and to training.

Writes random images and labels as the four native MNIST IDX files (no download), then runs
``python -m fedshard_lightning fit --config configs/mnist.yaml`` with FedAvg and an empty
path-choice cache (so ``vectorize: auto`` times the paths), and stops it once training begins:
when the probe prints ``vectorize: auto: done`` (or, decided otherwise, ``local training:``).

    python benchmarks/startup.py --repeats 3
"""

from __future__ import annotations

import argparse
import gzip
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def write_mnist(folder: Path, n_train: int, n_test: int) -> None:
    """Random 28x28 digits in the four gzipped IDX files MNISTDataModule reads."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        arrays = {
            "images-idx3": rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8),
            "labels-idx1": (np.arange(n) % 10).astype(np.uint8),
        }
        for kind, a in arrays.items():
            head = (0x0800 | a.ndim).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in a.shape)
            (folder / f"{prefix}-{kind}-ubyte.gz").write_bytes(gzip.compress(head + a.tobytes(), mtime=0))


def one_start(data_dir: Path, clients: int, work: Path) -> tuple[float, float]:
    """(seconds to the first printed line, seconds to the start of training) of one fresh fit."""
    cmd = [
        sys.executable,
        "-m",
        "fedshard_lightning",
        "fit",
        "--config",
        str(ROOT / "configs" / "mnist.yaml"),
        "--data.init_args.data_dir",
        str(data_dir),
        "--data.init_args.download",
        "false",
        "--data.init_args.num_clients",
        str(clients),
        "--trainer.algorithm",
        "fedshard_lightning.unlearning.FedAvg",
        "--trainer.default_root_dir",
        str(work / "runs"),
    ]
    cache = tempfile.mkdtemp(dir=work)  # empty: the paths are timed
    env = {**os.environ, "FEDSHARD_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    first = started = None
    assert proc.stdout is not None
    for line in proc.stdout:
        first = first if first is not None else time.perf_counter() - t0
        if line.startswith(("vectorize: auto: done", "local training:")):
            started = time.perf_counter() - t0
            break
    os.killpg(proc.pid, signal.SIGTERM)  # training has begun: the rest is not start-up
    proc.wait()
    if first is None or started is None:
        raise SystemExit(f"the fit ended before training began (exit {proc.returncode})")
    return first, started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--train", type=int, default=4000, help="training images written")
    ap.add_argument("--test", type=int, default=1000, help="test images written")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        work = Path(tmp)
        write_mnist(work / "data" / "mnist", args.train, args.test)
        runs = [one_start(work / "data", args.clients, work) for _ in range(args.repeats)]
    for i, (first, started) in enumerate(runs, 1):
        print(f"run {i}: first line {first:.1f} s, training {started:.1f} s")
    print(
        f"median of {len(runs)}: first line {statistics.median(r[0] for r in runs):.1f} s, "
        f"training {statistics.median(r[1] for r in runs):.1f} s (1-min load {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after)"
    )


if __name__ == "__main__":
    main()
