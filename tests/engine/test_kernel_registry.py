"""The kernel registry: every kernel says what it is, the choice follows the registry's order, and
every kernel that trains a tiny MLP gives the per-client loop's float64 result (the loop itself
against plain SGD written here)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, LocalSchedule, stack_params
from fedshard_lightning.engine.kernel_choice import choose_kernel
from fedshard_lightning.engine.kernels import (
    CHAIN,
    FX,
    KERNELS,
    LOOP,
    STACKED,
    VMAP,
    ClientBatch,
    Probe,
    by_name,
)
from fedshard_lightning.models import MLP


def _engine(dtype=torch.float64):
    dm = SyntheticDataModule(
        num_clients=4,
        partition="dirichlet",
        rho=0.5,
        min_client_size=5,
        num_samples=90,
        num_test=10,
        shape=(6,),
    )
    dm.setup()
    torch.manual_seed(0)
    model = MLP(hidden=(8,), lr=0.1)
    model.bind_data(dm.input_shape, dm.num_classes)
    model.to(dtype)
    return FederatedEngine(model, dm, LocalSchedule(batch_size=7, local_epochs=2), seed=3)


def test_every_kernel_has_a_name_and_a_one_line_reason():
    names = [k.name for k in KERNELS]
    assert len(set(names)) == len(names) == 4
    for k in KERNELS:
        assert k.name and k.reason and "\n" not in k.reason, k
        assert by_name(k.name) is k
    assert STACKED == (CHAIN, FX, VMAP) and KERNELS[-1] is LOOP  # the loop: the reference, chosen by timing
    with pytest.raises(ValueError, match="no kernel 'gemm'"):
        by_name("gemm")


def test_the_choice_takes_the_first_registered_kernel_that_can_train_the_model(monkeypatch):
    local = _engine().local
    args = (local.module, local.names, local.conv_mode)
    assert choose_kernel(*args, "auto", local._check_sample)[0].kernel is STACKED[0]
    refused = []

    def refuse(kernel):
        def unsupported(self, probe: Probe) -> str:
            refused.append(kernel.name)
            return f"{kernel.name} refused"

        monkeypatch.setattr(type(kernel), "unsupported", unsupported)

    refuse(CHAIN)
    choice, program, chain = choose_kernel(*args, "auto", local._check_sample)
    assert (choice.kernel, choice.reason, chain) == (FX, "fx+chain refused", None) and program is not None
    refuse(FX)
    choice, program, chain = choose_kernel(*args, "auto", local._check_sample)
    assert (choice.kernel, choice.reason, program, chain) == (VMAP, "fx refused", None, None)
    assert refused == ["fx+chain", "fx+chain", "fx"]  # in the registry's order, each asked once
    assert choose_kernel(*args, "vmap", local._check_sample)[0].reason == "chosen"


def _plain_sgd(local, start, batch):
    """Plain SGD on the mean cross entropy, one client after the other: the loop's reference."""
    gidx, sizes, steps = local.schedules(batch)
    module = local.module
    out = {n: [] for n in local.names}
    for i in range(len(batch.clients)):
        params = {n: start[n][i].clone() for n in local.names}
        for s in range(int(steps[i])):
            x, y = local.dm.gather(torch.as_tensor(gidx[i, s, : sizes[i, s]]), local.dtype)
            p = {n: v.requires_grad_() for n, v in params.items()}
            loss = F.cross_entropy(functional_call(module, p, (x,)), y)
            grads = torch.autograd.grad(loss, list(p.values()))
            params = {n: (v - module.lr * g).detach() for (n, v), g in zip(p.items(), grads)}
        for n in local.names:
            out[n].append(params[n])
    return {n: torch.stack(v) for n, v in out.items()}


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_every_kernel_that_trains_a_tiny_mlp_gives_the_loop_result(kernel):
    eng = _engine()
    local = eng.local
    batch = ClientBatch([0, 1, 2, 3], [0, 0, 1, 1], 1, 0)
    start = stack_params([eng.module_params()] * 4)
    with torch.no_grad():  # distinct starting rows, so a mixed-up row shows
        for n in local.names:
            start[n] += 0.1 * torch.randn(
                start[n].shape, generator=torch.Generator().manual_seed(1), dtype=start[n].dtype
            )
    loop = LOOP.train(local, start, batch).params
    sgd = _plain_sgd(local, start, batch)
    assert max(float((loop[n] - sgd[n]).abs().max()) for n in local.names) <= 1e-12
    if kernel is LOOP:
        return
    local.kernel = kernel.name
    local.program()
    assert local.kernel_choice.kernel is kernel  # a tiny MLP: every stacked kernel can train it
    got = kernel.train(local, start, batch).params
    assert max(float((got[n] - loop[n]).abs().max()) for n in local.names) <= 1e-12
    other = next(k for k in STACKED if k is not kernel)
    with pytest.raises(ValueError, match=re.escape(f"not {other.name}")):
        other.train(local, start, batch)
