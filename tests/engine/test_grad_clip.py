"""Each client's gradients clipped by its own norm or values, against torch's clip functions on one client alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _models import PlainMLP

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, LocalSchedule, stack_params
from fedshard_lightning.engine.grad_clip import GradClip, clip_rows
from fedshard_lightning.engine.local import ClientBatch
from fedshard_lightning.models import MLP


class OwnClipMLP(MLP):
    """Clips by value in its own hook, whatever the trainer's setting."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="value")


def _grads(m: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.01, 0.3, 1.0, 5.0, 40.0][:m], dtype=dtype)  # below and above the limit
    return [
        torch.randn(m, *shape, generator=gen, dtype=dtype) * scale.view(m, *[1] * len(shape))
        for shape in ((7, 5), (5,), (3, 7))
    ]


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_row_equals_torch_clipping_that_client_alone(algorithm, dtype):
    grads = _grads(5, dtype)
    stacked = [g.clone() for g in grads]
    clip_rows(stacked, GradClip(0.5, algorithm))
    for i in range(5):
        params = [torch.nn.Parameter(g[i].clone()) for g in grads]
        for p in params:
            p.grad = p.detach().clone()
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(params, 0.5)
        else:
            torch.nn.utils.clip_grad_value_(params, 0.5)
        assert all(torch.equal(s[i], p.grad) for s, p in zip(stacked, params)), i  # bit for bit
    changed = [not torch.equal(s, g) for s, g in zip(stacked, grads)]
    assert all(changed)


def _data() -> SyntheticDataModule:
    dm = SyntheticDataModule(
        num_clients=6,
        partition="dirichlet",
        rho=0.5,
        min_client_size=5,
        num_samples=150,
        num_test=20,
        shape=(10,),
        num_classes_=4,
    )
    dm.setup()
    return dm


def _reference(model, dm, local, batch, start, clip) -> dict[str, torch.Tensor]:
    """A plain per-client loop: the model's optimizer, cross entropy, torch's clipping before each step."""
    gidx, sizes, steps = local.schedules(batch)  # which samples each step takes (the keyed plan)
    out = {n: [] for n in start}
    for i in range(len(batch.clients)):
        worker = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in worker.named_parameters():
                p.copy_(start[n][i])
        opt = worker.configure_optimizers()
        for s in range(int(steps[i])):
            x, y = dm.gather(torch.as_tensor(gidx[i, s, : sizes[i, s]]), torch.float64)
            opt.zero_grad()
            F.cross_entropy(worker(x), y).backward()
            clip(list(worker.parameters()))
            opt.step()
        for n, p in worker.named_parameters():
            out[n].append(p.detach().clone())
    return {n: torch.stack(v) for n, v in out.items()}


CASES = [
    (
        MLP,
        dict(hidden=(16,), lr=0.5, momentum=0.9),
        0.05,
        "norm",
        lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05),
    ),
    (MLP, dict(hidden=(16,), lr=0.5), 0.05, "norm", lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05)),
    (
        MLP,
        dict(hidden=(16,), optimizer="adam", lr=0.01),
        0.01,
        "value",
        lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.01),
    ),
    (PlainMLP, dict(lr=0.5), 0.05, "norm", lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05)),
    (
        OwnClipMLP,
        dict(hidden=(16,), lr=0.5),
        None,
        "norm",
        lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.02),
    ),
]


@pytest.mark.parametrize(
    "cls,kw,val,algorithm,clip",
    CASES,
    ids=["sgd-momentum", "plain-sgd-chain", "adam-value", "vmap", "own-hook"],
)
def test_stacked_and_loop_equal_a_plain_clipped_loop_float64(cls, kw, val, algorithm, clip):
    dm = _data()
    torch.manual_seed(0)
    model = cls(**kw)
    if isinstance(model, MLP):
        model.bind_data(dm.input_shape, dm.num_classes)
    else:
        model(torch.zeros(1, *dm.input_shape))  # builds the lazy layer
    model = model.double()
    eng = FederatedEngine(
        model,
        dm,
        LocalSchedule(batch_size=7, local_epochs=2),
        seed=3,
        gradient_clip_val=val,
        gradient_clip_algorithm=algorithm,
    )
    clients = list(range(6))
    batch = ClientBatch(clients, [0] * 6, 1, 0)
    start = stack_params([eng.module_params()] * 6)
    want = _reference(model, dm, eng.local, batch, start, clip)
    loop = eng.local.train_loop(start, batch).params
    assert max(float((loop[k] - want[k]).abs().max()) for k in want) <= 1e-12
    if cls is OwnClipMLP:  # its hook must see one client's gradients: the engine trains it on the loop
        eng._decide_on(start, batch)
        assert eng.mode == "loop" and "configure_gradient_clipping" in eng.mode_reason
    else:
        stacked = eng.local.train_stacked(start, batch).params
        kernel = eng.local.kernel_choice.kernel.name
        assert kernel == ("vmap" if cls is PlainMLP else "fx+chain"), (
            kernel
        )  # the kernels the cases mean to cover
        assert max(float((stacked[k] - want[k]).abs().max()) for k in want) <= 1e-10
    unclipped = _reference(model, dm, eng.local, batch, start, lambda ps: None)
    assert max(float((unclipped[k] - want[k]).abs().max()) for k in want) > 1e-3  # clipping changed it
