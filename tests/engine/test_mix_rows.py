"""mix_rows: every output row a term-by-term sum, whichever rows are computed with it."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard_lightning.engine.mix_rows import mix_rows


def _reference(models, mix):
    """A plain loop of the rule: zeros, then each term weighted (weight cast to the dtype) and added in order."""
    out = {}
    for k, v in models.items():
        acc = torch.zeros(v.shape[1:], dtype=v.dtype)
        for row, w in mix:
            acc = acc + v[row] * torch.tensor(w, dtype=torch.float64).to(v.dtype)
        out[k] = acc
    return out


def _models(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, 3, 2, generator=gen),
        "s": torch.randn(n, generator=gen),  # a scalar per row
        "d": torch.randn(n, 4, generator=gen, dtype=torch.float64),
        "b": torch.randn(n, 2, generator=gen),
    }


def test_mix_rows_is_termwise_and_subset_invariant():
    models = _models(5)
    mixes = [[(0, 0.25), (3, 0.75)], [(1, 1 / 3), (2, 1 / 3), (4, 1 / 3)], []]
    out = mix_rows(models, mixes)
    assert list(out) == list(models)
    for k, v in models.items():
        for i, mix in enumerate(mixes):
            want = torch.zeros(v.shape[1:], dtype=v.dtype)
            for row, w in mix:
                want = want + v[row] * torch.tensor(w, dtype=torch.float64).to(v.dtype)
            assert out[k][i].shape == want.shape and torch.equal(out[k][i], want)
            assert torch.equal(mix_rows(models, [mix])[k][0], out[k][i])  # computed alone: same bits
    assert all(torch.equal(v, torch.zeros_like(v[:0])) for v in mix_rows(models, []).values())


@settings(max_examples=40, deadline=None)
@given(
    mixes=st.lists(
        st.lists(st.tuples(st.integers(0, 5), st.floats(0.01, 1.0)), min_size=0, max_size=4),
        min_size=1,
        max_size=4,
    ),
    fresh_rows=st.lists(st.integers(0, 5), unique=True, max_size=3),
)
def test_fresh_rows_are_read_from_their_tensors(mixes, fresh_rows):
    """Rows given as ``fresh`` are read from there: the same bits as the loop on the models with those rows put in."""
    models = _models(6)
    fresh = _models(len(fresh_rows), seed=1)
    put = {k: v.clone() for k, v in models.items()}
    for i, r in enumerate(fresh_rows):
        for k in put:
            put[k][r] = fresh[k][i]
    out = mix_rows(models, mixes, (fresh_rows, fresh))
    for i, mix in enumerate(mixes):
        want = _reference(put, mix)
        for k in models:
            assert torch.equal(out[k][i], want[k])
