"""On the CPU with several threads a client's bits do not depend on whether it trains alone.

ATen runs a batched GEMM of one matrix as one multi-threaded GEMM and a batch of several as
single-threaded GEMMs side by side, whose sums round differently (shapes like the digits MLP's
``[600x10] @ [10x64]`` update). The stacked path therefore never runs a call, or a step's tail,
over a single client row. The reference is the same client trained among others (two threads).
"""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_data

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.engine.local import ClientBatch
from fedshard_lightning.models import MLP


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _engine(momentum: float = 0.0) -> FederatedEngine:
    # Client sizes vary (steps 2..6 at batch 10), so a client's last steps run with fewer neighbours.
    dm = tiny_data(shape=(64,), k=6, per_client=40, classes=10, min_client_size=12, seed=3)
    dm.setup()
    torch.manual_seed(0)
    m = MLP(hidden=(600,), lr=0.1, momentum=momentum)
    m.bind_data(dm.input_shape, dm.num_classes)
    eng = FederatedEngine(m, dm, LocalSchedule(batch_size=10, local_epochs=2), seed=1, vectorize="always")
    eng._mode = "stacked"
    return eng


def _local(eng: FederatedEngine, clients: list[int]):
    start = stack_params([eng.module_params()])
    rows = torch.zeros(len(clients), dtype=torch.long)
    return eng._run_local(start, rows, ClientBatch(clients, [0] * len(clients), 1, 0))


@pytest.mark.parametrize("momentum", [0.0, 0.9])  # fused chain update; autograd-free chain + optimizer
def test_client_alone_equals_client_among_others_with_two_threads(two_threads, momentum):
    eng = _engine(momentum)
    assert eng.invariant_block() is None and eng.local.chain is not None  # the free path
    steps = eng.local.schedules(ClientBatch(list(range(6)), [0] * 6, 1, 0))[2]
    assert len(set(steps.tolist())) > 2  # clients finish at different steps
    for c in range(6):
        alone = _local(eng, [c])
        for cl in ([c, (c + 1) % 6], list(range(6)), [5 - c, c]):
            res = _local(eng, cl)
            i = cl.index(c)
            for k in alone.params:
                assert torch.equal(alone.params[k][0], res.params[k][i]), (c, cl, k)
            assert torch.equal(alone.loss_sum[0], res.loss_sum[i]), (c, cl)


def test_lean_group_alone_equals_group_among_others_with_two_threads(two_threads):
    eng = _engine()
    groups = [Group(0, (4,), 2), Group(1, (0, 1, 2), 2), Group(2, (3, 5), 2)]
    full = eng.train_groups(stack_params([eng.module_params()] * 3), groups, stage=1)
    for i, g in enumerate(groups):
        alone = eng.train_groups(stack_params([eng.module_params()]), [g], stage=1)
        for k in full.params:
            assert torch.equal(full.params[k][i], alone.params[k][0]), (i, k)
        assert [h.mean_loss[i] for h in full.history] == [h.mean_loss[0] for h in alone.history]
