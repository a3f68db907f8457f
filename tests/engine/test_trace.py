"""The loss tracer records the graph ``torch.fx.symbolic_trace`` records, without torch's overrides table."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fedshard_lightning.engine.kernels.check import _LossOf
from fedshard_lightning.engine.kernels.fx import _PER_SAMPLE_FUNCTIONS
from fedshard_lightning.engine.kernels.trace import trace
from fedshard_lightning.models import MLP
from fedshard_lightning.module import FederatedModule


class _Functions(FederatedModule):
    """torch.* and F.* calls, positional and keyword arguments, a method and an operator."""

    def configure_model(self) -> None:
        self.conv = nn.Conv2d(1, 3, 3)
        self.fc = nn.Linear(3 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.flatten(torch.relu(self.conv(x)), 1)
        return torch.tanh(self.fc(h)).relu() * 2.0

    def per_sample_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.nll_loss(F.log_softmax(F.gelu(self(x)), 1), y, reduction="none")


def _models() -> list[nn.Module]:
    mlp = MLP(hidden=(8,))
    mlp.bind_data((6,), 4)
    fns = _Functions()
    fns.bind_data((1, 6, 6), 5)
    return [mlp, fns]


def _calls(gm: fx.GraphModule) -> list[tuple[str, object]]:
    return [(n.op, n.target) for n in gm.graph.nodes]


@pytest.mark.parametrize("index", [0, 1])
def test_same_nodes_and_values_as_symbolic_trace(index):
    model = _models()[index]
    want = fx.symbolic_trace(_LossOf(model))
    root = _LossOf(model)
    got = fx.GraphModule(root, trace(root, _PER_SAMPLE_FUNCTIONS))
    assert _calls(got) == _calls(want)
    x = torch.randn(7, *model.input_shape)
    y = torch.randint(0, model.num_classes, (7,))
    assert torch.equal(got(x, y), want(x, y))
    assert torch.equal(got(x, y), model.per_sample_loss((x, y)))


def test_the_patched_functions_are_restored_even_when_tracing_fails():
    before = (F.cross_entropy, F.log_softmax, torch.relu, torch.flatten)

    class Untraceable(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow: fx raises
                return x
            return -x

    with pytest.raises(Exception, match="symbolically traced"):
        trace(Untraceable(), _PER_SAMPLE_FUNCTIONS)
    assert (F.cross_entropy, F.log_softmax, torch.relu, torch.flatten) == before
    trace(_LossOf(_models()[1]), _PER_SAMPLE_FUNCTIONS)
    assert (F.cross_entropy, F.log_softmax, torch.relu, torch.flatten) == before


def test_building_the_default_program_never_builds_the_overrides_table():
    """In a fresh process (the table is per process): fx's route would fill this cache."""
    code = (
        "import torch, torch.overrides as o\n"
        "from fedshard_lightning.models import MLP\n"
        "from fedshard_lightning.engine.kernels.fx import StackedProgram\n"
        "m = MLP(hidden=(8,)); m.bind_data((6,), 4)\n"
        "StackedProgram.build(m, [n for n, _ in m.named_parameters()])\n"
        "print(o._get_overridable_functions.cache_info().currsize)\n"
        "torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))\n"  # control: fx alone
        "import torch.nn.functional as F\n"
        "class L(torch.nn.Module):\n"
        "    def forward(self, x): return F.relu(x)\n"
        "torch.fx.symbolic_trace(L())\n"
        "print(o._get_overridable_functions.cache_info().currsize)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ours, control = out.stdout.split()
    assert ours == "0"
    assert control != "0"  # the route it avoids does build it
