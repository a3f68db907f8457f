"""A client's float32 result does not depend on which clients share its stacked call."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_data, tiny_model

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.engine.local import ClientBatch
from fedshard_lightning.models import MLP, FedAvgCNN, ResNetGN

CASES = [(MLP, (10,)), (FedAvgCNN, (1, 28, 28)), (ResNetGN, (3, 16, 16))]


def _setup(cls, shape):
    dm = tiny_data(shape)
    dm.setup()
    m = tiny_model(cls)
    m.bind_data(dm.input_shape, dm.num_classes)
    eng = FederatedEngine(m, dm, LocalSchedule(batch_size=5), seed=1, vectorize="always")
    return dm, eng


@pytest.mark.parametrize(("cls", "shape"), CASES)
def test_client_alone_equals_client_among_others(cls, shape):
    """Through the engine's own dispatch (fixed-shape calls where the kernel needs them)."""
    _dm, eng = _setup(cls, shape)
    eng._mode = "stacked"
    start = stack_params([eng.module_params()])
    neighbours = [[1], [1, 2, 3, 7, 4, 5], [0, 5, 5, 1, 6, 2, 3, 4], [7, 6, 5, 4, 3, 2, 0, 1]]
    alone = eng._run_local(start, torch.zeros(1, dtype=torch.long), ClientBatch([1], [0], 1, 0))
    for cl in neighbours:
        res = eng._run_local(
            start, torch.zeros(len(cl), dtype=torch.long), ClientBatch(cl, [0] * len(cl), 1, 0)
        )
        i = cl.index(1)
        for k in alone.params:
            assert torch.equal(alone.params[k][0], res.params[k][i]), (cl, k)
        assert torch.equal(alone.loss_sum[0], res.loss_sum[i])


@pytest.mark.parametrize(("cls", "shape"), CASES)
def test_group_model_independent_of_other_groups_and_chunking(cls, shape):
    _dm, eng = _setup(cls, shape)
    ref_groups = [Group(0, (1, 3), 2), Group(1, (0, 2, 4), 2), Group(2, (5, 6, 7), 1)]
    init = stack_params([eng.module_params()] * 3)
    full = eng.train_groups(init, ref_groups, stage=1)
    eng.chunk = 2
    alone = eng.train_groups(stack_params([eng.module_params()]), [ref_groups[1]], stage=1)
    for k in full.params:
        assert torch.equal(full.params[k][1], alone.params[k][0]), k


def test_fixed_shape_only_where_needed():
    _, eng = _setup(MLP, (10,))
    assert eng.invariant_block() is None  # hand-written kernels: one GEMM per client already
    _, eng = _setup(ResNetGN, (3, 16, 16))
    assert eng.invariant_block() == 8  # vmap: grouped kernels, fixed at 8 clients per call
    eng.batch_invariant = False
    assert eng.invariant_block() is None
