"""Write a CIFAR-100 archive in its native format, with random images, for runs with no network.

``cifar-100-python.tar.gz`` with the real member names (``train``, ``test``, ``meta``), each a
Python 2 pickle as the official files are, so ``CIFAR100DataModule`` reads it through its own
restricted unpickler. The images are random uint8; the labels uniform over the 100 fine and 20
coarse classes. Used by ``cifar100_end_to_end.sh`` on device machines (no download there).

    python benchmarks/fake_cifar100.py DATA_DIR/cifar100 [--per-batch 10000]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "data"))
from native_formats import cifar_tar_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--per-batch", type=int, default=10_000, help="test images; training gets 5x")
    args = ap.parse_args()
    data, _ = cifar_tar_bytes("cifar100", n_per_batch=args.per_batch)
    args.folder.mkdir(parents=True, exist_ok=True)
    out = args.folder / "cifar-100-python.tar.gz"
    out.write_bytes(data)
    print(f"{out}: {len(data) / 2**20:.1f} MiB, {5 * args.per_batch} train + {args.per_batch} test images")


if __name__ == "__main__":
    main()
