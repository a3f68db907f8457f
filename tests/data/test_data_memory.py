"""A CIFAR-10-sized dataset split over 512 clients stays ONE uint8 copy plus index tensors."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

from fedshard_lightning.data.base import FederatedDataModule

N_TRAIN, N_TEST, SAMPLE = 50_000, 10_000, (3, 32, 32)
SAMPLE_BYTES = 3 * 32 * 32


class _CifarSized(FederatedDataModule):
    """uint8 images of CIFAR-10's size, generated in place (no float intermediate)."""

    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)

    def load_split(self, train: bool):
        g = torch.Generator().manual_seed(int(train))
        n = N_TRAIN if train else N_TEST
        x = torch.randint(0, 256, (n, *SAMPLE), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
        return x, y


def _rss_bytes() -> int:
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def test_cifar_sized_data_is_one_uint8_copy(capsys):
    dm = _CifarSized(num_clients=512, partition="iid", seed=0)
    before = _rss_bytes()
    dm.setup()
    after = _rss_bytes()

    x = dm.train_x
    assert x.dtype == torch.uint8 and tuple(x.shape) == (N_TRAIN, *SAMPLE)
    assert x.nbytes == N_TRAIN * SAMPLE_BYTES
    assert x.is_contiguous() and x.untyped_storage().nbytes() == x.nbytes  # not a view of a bigger buffer
    assert len(dm.client_indices) == 512
    assert all(i.dtype == torch.int64 and i.ndim == 1 for i in dm.client_indices)
    assert sum(len(i) for i in dm.client_indices) == N_TRAIN
    assert len({i.untyped_storage().data_ptr() for i in dm.client_indices}) == 512  # own small buffers
    index_bytes = sum(i.nbytes for i in dm.client_indices)
    assert index_bytes == N_TRAIN * 8

    resident = x.nbytes + dm.train_y.nbytes + dm.test_x.nbytes + dm.test_y.nbytes + index_bytes
    delta = after - before
    with capsys.disabled():
        print(
            f"\n[memory] train_x {x.nbytes:,} B (uint8, one copy); "
            f"indices {index_bytes:,} B over 512 clients; "
            f"all resident data {resident:,} B; process RSS delta over setup {delta:,} B"
        )
    # a float32 copy of the training images alone would add 4 x 153.6 MB
    assert delta < resident + 4 * x.nbytes // 10

    # gathering one batch for many clients costs that batch only
    batch = torch.stack([i[:4] for i in dm.client_indices])
    gx, gy = dm.gather(batch)
    assert gx.shape == (512, 4, *SAMPLE) and gy.shape == (512, 4)
    assert dm.train_x.data_ptr() == x.data_ptr()
