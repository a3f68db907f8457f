"""``compile=True``: the torch.compile'd stacked step equals the eager one (slow: compiles on CPU)."""

from __future__ import annotations

import pytest
import torch

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.models import MLP

pytestmark = pytest.mark.slow


def _run(dtype, compiled, groups):
    dm = SyntheticDataModule(
        num_clients=16,
        partition="dirichlet",
        rho=0.5,
        min_client_size=5,
        num_samples=320,
        shape=(10,),
        num_classes_=4,
    )
    dm.setup()
    torch.manual_seed(0)
    m = MLP(hidden=(16,), lr=0.1)
    m.bind_data(dm.input_shape, dm.num_classes)
    eng = FederatedEngine(
        m.to(dtype), dm, LocalSchedule(batch_size=5), seed=1, vectorize="always", compile=compiled
    )
    # compiled steps run fixed shapes (one compile per shape); eager CPU chain steps need none
    assert eng.invariant_block() == (8 if compiled else None)
    return eng.train_groups(stack_params([eng.module_params()] * len(groups)), groups, stage=1).params


def test_compiled_equals_eager_float64_and_is_batch_invariant_float32():
    groups = [Group(0, tuple(range(8)), 2), Group(1, tuple(range(8, 16)), 2)]
    eager, comp = _run(torch.float64, False, groups), _run(torch.float64, True, groups)
    assert max(float((eager[k] - comp[k]).abs().max()) for k in eager) <= 1e-10
    both = _run(torch.float32, True, groups)
    alone = _run(torch.float32, True, groups[1:])
    assert all(torch.equal(both[k][1], alone[k][0]) for k in both)


def test_compiled_steps_compile_once_per_shape_not_once_per_round():
    """New parameter tensors every round must not invalidate the compiled step (no identity guards)."""
    from torch._dynamo.utils import counters

    groups = [Group(0, tuple(range(8)), 6), Group(1, tuple(range(8, 16)), 6)]  # 6 rounds
    _run(torch.float32, True, groups[:1])  # warm: every shape of one round compiled
    before = counters["stats"]["unique_graphs"]
    _run(torch.float32, True, groups)
    assert counters["stats"]["unique_graphs"] - before <= 2  # at most the step sizes not seen yet
