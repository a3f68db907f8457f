"""Half precision on the CPU: a client's stacked result does not depend on its neighbours.

The CPU's bf16/fp16 ``add_(g, alpha)`` rounds the vectorized body and the scalar tail of a
tensor differently, so SGD on stacked parameters updated a client differently in another row of
the call (up to 1e-3 on digits). References: the client trained alone (padded to the fixed call
width), and ``torch.optim`` run on each row as its own tensor.
"""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_data

from fedshard_lightning.engine import FederatedEngine, LocalSchedule, stack_params
from fedshard_lightning.engine.local import ClientBatch
from fedshard_lightning.engine.optim import OptimizerSpec
from fedshard_lightning.engine.row_optim import RowOptimizer, needs_rows
from fedshard_lightning.models import MLP

HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF)
def test_half_client_alone_equals_client_among_all(dtype):
    """Widths 15 and 10 classes leave a scalar tail in the stacked biases, which some rows fall in."""
    dm = tiny_data((12,), classes=10, per_client=20)
    dm.setup()
    torch.manual_seed(0)
    m = MLP(hidden=(15,), lr=0.1)
    m.bind_data(dm.input_shape, dm.num_classes)
    m = m.to(dtype)
    eng = FederatedEngine(m, dm, LocalSchedule(batch_size=5), seed=1, vectorize="always")
    eng._mode = "stacked"
    start = stack_params([eng.module_params()])
    every = list(range(8))
    res = eng._run_local(start, torch.zeros(8, dtype=torch.long), ClientBatch(every, [0] * 8, 1, 0))
    for c in every:
        alone = eng._run_local(start, torch.zeros(1, dtype=torch.long), ClientBatch([c], [0], 1, 0))
        for k in alone.params:
            assert torch.equal(alone.params[k][0], res.params[k][c]), (c, k)


@pytest.mark.parametrize("dtype", HALF)
def test_rows_step_as_their_own_tensors_and_shrink(dtype):
    torch.manual_seed(0)
    spec = OptimizerSpec(torch.optim.SGD, ((("w", "b"), {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),))
    start = {"w": torch.randn(8, 3, 5).to(dtype), "b": torch.randn(8, 10).to(dtype)}
    leaves = {k: v.clone().requires_grad_() for k, v in start.items()}
    opt = RowOptimizer(spec, leaves)
    first = leaves  # the new leaves after a shrink are views of these
    rows = [{k: v[i].clone().requires_grad_() for k, v in start.items()} for i in range(8)]
    refs = [torch.optim.SGD(list(r.values()), lr=0.1, momentum=0.9, weight_decay=1e-3) for r in rows]
    live = 8
    for step in range(4):
        if step == 2:  # the last three clients finish
            live = 5
            new = {k: v.detach()[:live].requires_grad_() for k, v in leaves.items()}
            opt.shrink(new, live)
            leaves = new
        grads = {k: torch.randn(live, *v.shape[1:]).to(dtype) for k, v in start.items()}
        for k, v in leaves.items():
            v.grad = grads[k]
        opt.step()
        for i in range(live):
            for k, p in rows[i].items():
                p.grad = grads[k][i].clone()
            refs[i].step()
    for i in range(8):  # rows 5-7 stopped after two steps, as their references did
        for k in start:
            assert torch.equal(first[k][i].detach(), rows[i][k].detach()), (i, k)
    assert len(opt.opt.state) == 2 * live  # the finished rows' momentum is dropped


def test_rows_only_for_half_precision_on_the_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert needs_rows(torch.bfloat16, cpu) and needs_rows(torch.float16, cpu)
    assert not needs_rows(torch.float32, cpu) and not needs_rows(torch.float64, cpu)
    assert not needs_rows(torch.bfloat16, cuda)
