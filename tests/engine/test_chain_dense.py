"""The dense chain step gives the bits of the link-by-link chain step, and is used only where it applies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedshard_lightning.engine.kernels.chain import StackedChain
from fedshard_lightning.engine.kernels.chain_dense import DenseChain
from fedshard_lightning.engine.kernels.check import probe_params, reference
from fedshard_lightning.engine.kernels.fx import StackedProgram
from fedshard_lightning.models import MLP, FedAvgCNN
from fedshard_lightning.module import FederatedModule


class _TanhIdentity(FederatedModule):
    """Image input flattened, then Linear, Tanh, Identity, Linear, ReLU, Linear."""

    def configure_model(self) -> None:
        width = int(torch.tensor(self.input_shape).prod())
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(width, 7),
            nn.Tanh(),
            nn.Identity(),
            nn.Linear(7, 5),
            nn.ReLU(),
            nn.Linear(5, self.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _chain(
    model: FederatedModule, shape: tuple[int, ...], classes: int, dtype: torch.dtype = torch.float32
) -> tuple[StackedChain, list[str]]:
    model.bind_data(shape, classes)
    model.to(dtype)
    names = [n for n, _ in model.named_parameters()]
    return StackedChain.from_program(StackedProgram.build(model, names), "per_client"), names


@pytest.mark.parametrize(
    ("make", "shape"),
    [(lambda: MLP(hidden=(8, 6)), (10,)), (lambda: MLP(hidden=(4,)), (2, 3, 3)), (_TanhIdentity, (1, 4, 4))],
)
@pytest.mark.parametrize("clients", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_bits_as_the_generic_step_for_sgd_and_for_gradients(make, shape, clients, dtype):
    torch.manual_seed(0)
    model = make()
    chain, names = _chain(model, shape, 4, dtype)
    assert chain.dense is not None
    b = 5
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(clients, b, *shape, generator=gen, dtype=dtype)
    y = torch.randint(0, 4, (clients, b), generator=gen)
    sizes = torch.tensor([5, 3, 1][:clients])  # partial batches: masked weights
    weight = ((torch.arange(b) < sizes[:, None]) / sizes[:, None]).to(dtype)
    lr = {n: 0.3 for n in names}
    dense = {k: v.clone() for k, v in probe_params(model, names, clients).items()}
    generic = {k: v.clone() for k, v in dense.items()}
    for _ in range(4):  # in-place SGD: the cached views must follow the updates
        got = chain.dense.step(dense, x, y, weight, lr)[0]
        want = chain.generic_step(generic, x, y, weight, lr)[0]
        assert torch.equal(got, want)
        assert all(torch.equal(dense[k], generic[k]) for k in names)
    fresh = {k: v.clone() for k, v in dense.items()}  # new tensors: new views
    got, g_got = chain.dense.step(fresh, x, y, weight, None)
    want, g_want = chain.generic_step(dense, x, y, weight, None)
    assert torch.equal(got, want)
    assert g_got.keys() == g_want.keys() == set(names) and all(
        torch.equal(g_got[k], g_want[k]) for k in names
    )


def test_the_dense_step_is_checked_against_the_model_loss_like_any_chain():
    model = _TanhIdentity()
    chain, names = _chain(model, (1, 4, 4), 3)
    x, y = torch.randn(3, 4, 1, 4, 4), torch.randint(0, 3, (3, 4))
    chain.check(reference(model, x, y, names), x, y)  # autograd of the user's loss, by vmap


def test_chains_with_other_links_keep_the_generic_step():
    cnn = FedAvgCNN(channels=(2, 3), hidden=8)
    chain, _ = _chain(cnn, (1, 8, 8), 3)
    assert chain.dense is None
    assert DenseChain.of(chain.ops) is None
