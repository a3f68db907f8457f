"""The vmap-free stacked kernels (fx program, hand-written chain) against vmap and the loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.engine.kernels import CHAIN, FX, VMAP, KernelChoice
from fedshard_lightning.engine.kernels.chain import StackedChain
from fedshard_lightning.engine.kernels.check import Unsupported, reference
from fedshard_lightning.engine.kernels.fx import StackedProgram
from fedshard_lightning.models import MLP, FedAvgCNN
from fedshard_lightning.module import FederatedModule


def _data(k=6, n=150, shape=(10,)):
    dm = SyntheticDataModule(
        num_clients=k,
        partition="dirichlet",
        rho=0.5,
        min_client_size=5,
        num_samples=n,
        num_test=20,
        shape=shape,
        num_classes_=4,
    )
    dm.setup()
    return dm


def _bind(m, dm, dtype=torch.float64):
    torch.manual_seed(0)
    m.bind_data(dm.input_shape, dm.num_classes)
    return m.to(dtype)


class TanhPoolNet(FederatedModule):
    """'same' padding, tanh, max-pool and a flatten by method: every hand-written link."""

    def configure_model(self) -> None:
        self.conv = nn.Conv2d(self.input_shape[0], 3, 3, padding="same")
        self.act = nn.Tanh()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(3 * (self.input_shape[1] // 2) * (self.input_shape[2] // 2), self.num_classes)

    def forward(self, x):
        h = self.pool(self.act(self.conv(x)))
        return self.fc(torch.relu(h.flatten(1)))


class BufferNet(FederatedModule):
    """Has a buffer (as batch norm does): stays on vmap."""

    def configure_model(self) -> None:
        self.fc = nn.Linear(10, 4)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.fc(x) * self.scale


class CenteredNet(FederatedModule):
    """Subtracts the batch mean: an operator with no stacked form."""

    def configure_model(self) -> None:
        self.fc = nn.Linear(10, 4)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0, keepdim=True)


class SmoothedNet(MLP):
    """Label smoothing: stacked by the fx program, but not by the hand-written chain."""

    def per_sample_loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="none", label_smoothing=0.1)


class OwnStepNet(MLP):
    """Overrides training_step (a weighted mean): the engine cannot rewrite it, so it uses vmap."""

    def training_step(self, batch, batch_idx=0):
        losses = self.per_sample_loss(batch)
        return (losses * torch.linspace(0.5, 1.5, len(losses), dtype=losses.dtype)).mean()


def _train(m, dm, mode, kernel="auto", conv_mode=None, sched=None):
    eng = FederatedEngine(m, dm, sched or LocalSchedule(batch_size=7, local_epochs=2), seed=2, vectorize=mode)
    eng.local.kernel = kernel
    if conv_mode:
        eng.local.conv_mode = conv_mode
    k = len(dm.client_indices)
    init = stack_params([eng.module_params()] * 2)
    res = eng.train_groups(init, [Group(0, tuple(range(k // 2)), 2), Group(1, tuple(range(k // 2, k)), 2)])
    return res.params, eng.local.kernel_choice


def _maxdiff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(
    ("model", "shape", "status"),
    [
        (lambda: MLP(hidden=(8, 8), lr=0.1), (10,), (CHAIN, "")),
        (lambda: MLP(hidden=(8,), lr=0.05, momentum=0.9), (10,), (CHAIN, "")),
        (lambda: FedAvgCNN(channels=(2, 3), hidden=8, lr=0.05), (1, 8, 8), (CHAIN, "")),
        (lambda: TanhPoolNet(lr=0.05, optimizer="adam"), (2, 6, 6), (CHAIN, "")),
        (lambda: SmoothedNet(hidden=(8,), lr=0.1), (10,), (FX, "no chain")),
        (lambda: BufferNet(lr=0.1), (10,), (VMAP, "the model has buffers")),
        (lambda: CenteredNet(lr=0.1), (10,), (VMAP, "tensor method mean")),
        (lambda: OwnStepNet(hidden=(8,), lr=0.1), (10,), (VMAP, "training_step is overridden")),
    ],
)
def test_kernel_choice_and_equality_with_loop(model, shape, status):
    dm = _data(shape=shape)
    m = _bind(model(), dm)
    loop, _ = _train(m, dm, "never")
    stacked, got = _train(m, dm, "always")
    kernel, reason = status
    assert got.kernel is kernel and got.reason.startswith(reason) and bool(got.reason) == bool(reason)
    assert _maxdiff(stacked, loop) <= 1e-10
    if got.kernel in (CHAIN, FX):
        fx_only, got_fx = _train(m, dm, "always", kernel="fx")
        assert got_fx == KernelChoice(FX)
        assert _maxdiff(fx_only, loop) <= 1e-10
    vm, got_vm = _train(m, dm, "always", kernel="vmap")
    assert got_vm == KernelChoice(VMAP, "chosen") and _maxdiff(vm, loop) <= 1e-10


@pytest.mark.parametrize("conv_mode", ["grouped", "per_client"])
def test_conv_modes_equal_loop(conv_mode):
    dm = _data(shape=(2, 8, 8))
    m = _bind(FedAvgCNN(channels=(3, 4), hidden=8, lr=0.05, momentum=0.5), dm)
    loop, _ = _train(m, dm, "never")
    stacked, status = _train(m, dm, "always", conv_mode=conv_mode)
    assert status == KernelChoice(CHAIN)
    assert _maxdiff(stacked, loop) <= 1e-10


def test_float32_cnn_chain_close_to_loop():
    dm = _data(shape=(1, 8, 8))
    m = _bind(FedAvgCNN(channels=(4, 8), hidden=16, lr=0.05), dm, torch.float32)
    loop, _ = _train(m, dm, "never", sched=LocalSchedule(batch_size=5, local_steps=4))
    stacked, status = _train(m, dm, "always", sched=LocalSchedule(batch_size=5, local_steps=4))
    assert status == KernelChoice(CHAIN)
    assert _maxdiff(stacked, loop) <= 1e-5


def test_program_check_refuses_a_rewrite_that_mixes_clients():
    dm = _data()
    m = _bind(MLP(hidden=(8,)), dm)
    names = [n for n, _ in m.named_parameters()]
    prog = StackedProgram.build(m, names)
    idx = torch.stack([dm.client_indices[c][:4] for c in range(3)])
    x, y = dm.gather(idx, torch.float64)
    ref = reference(m, x, y, names)
    prog.check(ref, x, y)  # the honest rewrite passes
    honest = prog.gm

    class Mixing(nn.Module):
        def forward(self, *args):
            out = honest(*args)
            return out + 0.1 * out.roll(4)  # leaks the previous client's losses into this one

    prog.gm = Mixing()
    with pytest.raises(Unsupported, match="disagrees with vmap"):
        prog.check(ref, x, y)


def test_chain_gradients_equal_autograd_and_fused_sgd_equals_step():
    dm = _data(shape=(2, 6, 6))
    m = _bind(TanhPoolNet(lr=0.1), dm)
    names = [n for n, _ in m.named_parameters()]
    prog = StackedProgram.build(m, names)
    chain = StackedChain.from_program(prog, "grouped")
    idx = torch.stack([dm.client_indices[c][:5] for c in range(3)])
    x, y = dm.gather(idx, torch.float64)
    ref = reference(m, x, y, names)
    chain.check(ref, x, y)
    params = ref.params
    weight = torch.full((3, 5), 0.2, dtype=torch.float64)
    _, grads = chain.step({k: v.clone() for k, v in params.items()}, x, y, weight, None)
    fused = {k: v.clone() for k, v in params.items()}
    chain.step(fused, x, y, weight, dict.fromkeys(names, 0.1))
    for k in names:
        torch.testing.assert_close(fused[k], params[k] - 0.1 * grads[k], rtol=0, atol=1e-12)


def test_untraceable_forward_falls_back_to_vmap():
    class Branchy(MLP):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent Python control flow: fx cannot trace it
                return self.net(x)
            return self.net(-x)

    dm = _data()
    m = _bind(Branchy(hidden=(8,), lr=0.1), dm)
    with pytest.raises(Unsupported, match="not traceable"):
        StackedProgram.build(m, [n for n, _ in m.named_parameters()])


def test_a_chain_that_disagrees_with_the_model_is_refused_and_the_checked_fx_program_trains(monkeypatch):
    """The chain is compared with the user's loss itself: a wrong backward falls back to fx, not into training."""
    dm = _data()
    m = _bind(MLP(hidden=(8,), lr=0.1), dm)
    honest = StackedChain.step

    def wrong(self, *args):
        losses, grads = honest(self, *args)
        return losses, {k: 1.01 * g for k, g in grads.items()}  # every gradient 1% too large

    monkeypatch.setattr(StackedChain, "step", wrong)
    loop, _ = _train(m, dm, "never")
    stacked, status = _train(m, dm, "always")
    assert status.kernel is FX
    assert status.reason.startswith("no chain: the hand-written backward disagrees with the model's loss")
    assert _maxdiff(stacked, loop) <= 1e-10
