"""The cached step layout against the values written out per client."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.engine.schedule import LocalSchedule
from fedshard_lightning.engine.step_layout import StepLayout, StepLayouts


@settings(max_examples=40, deadline=None)
@given(
    n=st.lists(st.integers(0, 45), min_size=1, max_size=8),
    b=st.integers(1, 7),
    epochs=st.integers(1, 2),
    chain=st.booleans(),
)
def test_layout_equals_the_values_per_client(n, b, epochs, chain):
    sched = LocalSchedule(batch_size=b, local_epochs=epochs)
    _, gsz, steps = sched.plan(np.asarray(n), 0, 1, np.zeros(len(n), np.int64), 0, np.arange(len(n)))
    lay = StepLayout.of(gsz, steps, torch.device("cpu"), b, torch.float64, chain)
    # Order: by decreasing steps, ties by position.
    want = sorted(range(len(n)), key=lambda i: (-int(steps[i]), i))
    assert lay.order.tolist() == want and lay.order_t.tolist() == want
    assert lay.in_order == (want == list(range(len(n))))
    assert lay.s_max == max(int(s) for s in steps)
    for s in range(lay.s_max):
        assert lay.live[s] == sum(int(steps[i]) > s for i in range(len(n)))
        for j, i in enumerate(want):
            assert lay.gsz[s, j] == gsz[i, s]
            if chain:
                row = lay.weight_all[s, j].tolist()
                size = int(gsz[i, s])
                assert row == [1.0 / size if k < size else 0.0 for k in range(b)]
    assert (lay.size_t is None) == chain and (lay.weight_all is None) == (not chain)
    if not chain:
        assert lay.size_t.tolist() == lay.gsz.tolist()


def test_layouts_are_kept_by_their_batch_sizes():
    layouts = StepLayouts(batch_size=4, dtype=torch.float32, limit=2)
    a = (np.array([[4, 2], [4, 4]]), np.array([2, 2]))
    b = (np.array([[4, 4], [4, 2]]), np.array([2, 2]))
    cpu = torch.device("cpu")
    first = layouts(*a, cpu, True)
    assert layouts(*a, cpu, True) is first  # the same sizes: the same layout
    assert layouts(*b, cpu, True) is not first
    assert layouts(*a, cpu, False) is not first  # another step kind
    assert layouts(*a, cpu, True) is not first  # over the limit: made afresh, equal
    assert layouts(*a, cpu, True).weight_all.tolist() == first.weight_all.tolist()
