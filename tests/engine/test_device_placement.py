"""Stacked rounds on a stand-in accelerator (tests/_fake_device.py): tensors on one device, no per-step host reads.

CI has no CUDA device, so a defect of device placement (a CUDA datamodule handing out host
indices, say) would ship unseen until a GPU runs the ``cuda`` tests. These tests run the engine
on ``fdev``, which raises where CUDA would raise and counts what CUDA would have to read back to
the host, and check the rule of docs/gpu.md: no host read in the step loop (a sync per step
stalls the GPU's queue), the batch plan and index tensors uploaded once per round, not per step.
"""

from __future__ import annotations

import pytest
import torch
from _fake_device import FakeDevice, FdevTensor

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.engine.lean_rounds import lean_eligible
from fedshard_lightning.models import MLP, ResNetGN

K = 4
# (model, batch invariance, kernel): the hand-written chain in fixed-shape blocks; the chain on the
# lean path (no invariance: no blocks); vmap of a GroupNorm ResNet (no stacked form).
CASES = [("mlp", True, "fx+chain"), ("mlp", False, "fx+chain"), ("resnetgn", True, "vmap")]


def _engine(which: str, invariant: bool, local_steps: int, device: torch.device | None) -> FederatedEngine:
    shape = (6,) if which == "mlp" else (3, 8, 8)
    dm = SyntheticDataModule(
        num_clients=K, partition="iid", num_samples=20 * K, shape=shape, num_classes_=4, num_test=10
    )
    dm.setup()
    torch.manual_seed(0)
    model = MLP(hidden=(8,), lr=0.1) if which == "mlp" else ResNetGN(depth=8, width=4, groups=2, lr=0.05)
    model.bind_data(dm.input_shape, dm.num_classes)
    model = model.double()
    if device is not None:
        model, dm = model.to(device), dm.to(device)
    eng = FederatedEngine(
        model,
        dm,
        LocalSchedule(batch_size=5, local_steps=local_steps),
        vectorize="always",
        batch_invariant=invariant,
    )
    eng._cuda = device is not None  # the engine's CUDA decisions: blocks of 64, no CPU-only probes
    return eng


def _rounds(eng: FederatedEngine, rounds: int) -> dict[str, torch.Tensor]:
    init = stack_params([eng.module_params()])
    return eng.train_groups(init, [Group(0, tuple(range(K)), rounds)]).params


@pytest.mark.parametrize(("which", "invariant", "kernel"), CASES)
def test_stacked_rounds_keep_every_tensor_on_the_device(which: str, invariant: bool, kernel: str) -> None:
    """Training on fdev raises nowhere (a host tensor beside a device one would) and equals the CPU's."""
    with FakeDevice() as dev:
        eng = _engine(which, invariant, 3, dev.device)
        got = _rounds(eng, 2)
    assert eng.local.program_status.startswith(kernel)
    assert all(isinstance(v, FdevTensor) for v in got.values())
    want = _rounds(_engine(which, invariant, 3, None), 2)
    for k, v in want.items():
        torch.testing.assert_close(got[k].elem, v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("which", "invariant", "kernel"), CASES)
def test_host_reads_and_uploads_per_round_do_not_grow_with_local_steps(
    which: str, invariant: bool, kernel: str
) -> None:
    """Three rounds at 2 and at 8 local steps read and upload as often: nothing per step.

    A round reads its chunk's loss sums once (the finiteness check and the history); its batch
    plan and indices go up once.
    """
    seen = {}
    for steps in (2, 8):
        with FakeDevice() as dev:
            eng = _engine(which, invariant, steps, dev.device)
            _rounds(eng, 1)  # kernel choice and its check, once per engine
            dev.reset()
            _rounds(eng, 3)
            seen[steps] = (list(dev.reads), list(dev.uploads))
    assert eng.local.program_status.startswith(kernel)
    assert lean_eligible(eng, [Group(0, tuple(range(K)), 3)]) is not invariant  # the path under test
    (reads2, up2), (reads8, up8) = seen[2], seen[8]
    assert len(reads8) == len(reads2) <= 3, (reads2, reads8)
    assert len(up8) == len(up2), (up2, up8)
