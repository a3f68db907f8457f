"""Signed contribution angle against a direct numpy reference of SPEC section 4, and update flattening."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fedshard_lightning.sharding import flatten_update, signed_angles, unflatten_update


def reference_signed_angles(
    u: np.ndarray, w: np.ndarray | None = None, g: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """SPEC section 4 written out with numpy; also says how well-defined the signs are.

    The second value is the relative gap of the top two singular values of the residuals (0 when a
    row's sign hangs on rounding): below ~1e-6 the principal direction is numerically arbitrary.
    """
    u = np.asarray(u, dtype=np.float64)
    if g is None:
        g = np.average(u, axis=0, weights=w)
    gg = g @ g
    if gg == 0:
        return np.zeros(len(u)), 1.0
    norms = np.linalg.norm(u, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = (u @ g) / (norms * np.sqrt(gg))
    a = np.arccos(np.clip(cos, -1.0, 1.0))
    a[norms == 0] = 0.0
    r = u - np.outer((u @ g) / gg, g)
    _, s, vt = np.linalg.svd(r, full_matrices=False)
    e = vt[0]
    if e[np.argmax(np.abs(e))] < 0:
        e = -e
    proj = r @ e
    if s[0] <= 1e-12 * norms.max():
        proj = np.zeros(len(u))  # all residuals (numerically) zero: sign +1
    sign = np.where(proj >= 0, 1.0, -1.0)
    gap = (s[0] - s[1]) / s[0] if len(s) > 1 and s[0] > 0 else 1.0
    # Rows with a (nearly) zero projection have a sign decided by rounding: report them as no gap.
    if s[0] > 0 and np.any((np.abs(proj) < 1e-9 * s[0]) & (np.linalg.norm(r, axis=1) > 1e-9 * s[0])):
        gap = 0.0
    return sign * a, gap


def random_updates(seed: int, n: int, d: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # A shared direction plus noise, like real client updates.
    return rng.normal(size=d) * rng.uniform(0, 2) + rng.normal(size=(n, d)) * rng.uniform(0.1, 2, size=(n, 1))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 12),
    d=st.integers(1, 40),
    weighted=st.booleans(),
)
def test_matches_numpy_reference(seed: int, n: int, d: int, weighted: bool) -> None:
    # d <= n takes the direct SVD, d > n the Gram-matrix path.
    u = random_updates(seed, n, d)
    w = np.random.default_rng(seed + 1).uniform(0.5, 3, size=n) if weighted else None
    expected, gap = reference_signed_angles(u, w)
    assume(gap > 1e-6)  # the principal direction of (nearly) tied singular values is arbitrary
    got = signed_angles(torch.from_numpy(u), None if w is None else torch.from_numpy(w))
    assert got.dtype == torch.float64
    assert got.shape == (n,)
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-7)
    assert np.all(np.abs(got.numpy()) <= math.pi)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 8), d=st.integers(1, 30))
def test_matches_reference_with_given_reference_update(seed: int, n: int, d: int) -> None:
    u = random_updates(seed, n, d)
    g = np.random.default_rng(seed + 7).normal(size=d)
    expected, gap = reference_signed_angles(u, g=g)
    assume(gap > 1e-6)
    got = signed_angles(torch.from_numpy(u), reference=torch.from_numpy(g))
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-7)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 10), d=st.integers(1, 30))
def test_invariant_to_row_order(seed: int, n: int, d: int) -> None:
    u = torch.from_numpy(random_updates(seed, n, d))
    w = torch.from_numpy(np.random.default_rng(seed).uniform(0.5, 2, size=n))
    _, gap = reference_signed_angles(u.numpy(), w.numpy())
    assume(gap > 1e-6)
    alpha = signed_angles(u, w)
    flipped = signed_angles(u.flip(0), w.flip(0)).flip(0)
    torch.testing.assert_close(flipped, alpha, rtol=0, atol=1e-10)
    perm = torch.from_numpy(np.random.default_rng(seed + 3).permutation(n))
    torch.testing.assert_close(signed_angles(u[perm], w[perm]), alpha[perm], rtol=0, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.floats(1e-6, 1e6))
def test_invariant_to_positive_scaling_and_float32_input(seed: int, scale: float) -> None:
    u = torch.from_numpy(random_updates(seed, 6, 9))
    alpha = signed_angles(u)
    torch.testing.assert_close(signed_angles(u * scale), alpha, rtol=0, atol=1e-9)
    assert signed_angles(u.float()).dtype == torch.float64


def test_two_updates_have_opposite_signs() -> None:
    u = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    alpha = signed_angles(u)
    torch.testing.assert_close(alpha.abs(), torch.full((2,), math.pi / 4, dtype=torch.float64))
    assert alpha[0] * alpha[1] < 0


def test_orientation_rule_on_a_hand_example() -> None:
    # g = (1, 0, 0); residuals (0, 2, 0), (0, -2, 0), (0, 0, 0); e = (0, 1, 0) after orientation.
    u = torch.tensor([[1.0, 2.0, 0.0], [1.0, -2.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    alpha = signed_angles(u)
    expected = torch.tensor([math.atan2(2, 1), -math.atan2(2, 1), 0.0], dtype=torch.float64)
    torch.testing.assert_close(alpha, expected)


def test_zero_updates_give_zero() -> None:
    u = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [3.0, -1.0, 0.5]], dtype=torch.float64)
    alpha = signed_angles(u)
    assert alpha[0] == 0
    expected, _ = reference_signed_angles(u.numpy())
    torch.testing.assert_close(alpha, torch.from_numpy(expected))
    assert torch.equal(signed_angles(torch.zeros(4, 5)), torch.zeros(4, dtype=torch.float64))


def test_zero_reference_gives_zero() -> None:
    u = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(signed_angles(u, reference=torch.zeros(4)), torch.zeros(3, dtype=torch.float64))
    # Updates that cancel out: their mean is the zero reference.
    v = torch.cat([u, -u])
    assert torch.equal(signed_angles(v), torch.zeros(6, dtype=torch.float64))


def test_single_update_and_parallel_updates() -> None:
    u = torch.randn(1, 7, dtype=torch.float64)
    assert torch.equal(signed_angles(u), torch.zeros(1, dtype=torch.float64))
    x = torch.randn(5, dtype=torch.float64)
    parallel = torch.stack([x, 2 * x, 0.5 * x])
    alpha = signed_angles(parallel)
    assert torch.all(alpha >= 0)  # all residuals zero -> sign +1
    assert torch.all(alpha < 1e-7)
    anti = torch.stack([x, -x, 3 * x])
    alpha = signed_angles(anti)
    assert torch.all(alpha >= 0)
    assert alpha[1] == pytest.approx(math.pi)
    assert alpha[0] == pytest.approx(0, abs=1e-7)


def test_empty_and_invalid_inputs() -> None:
    assert signed_angles(torch.zeros(0, 3)).shape == (0,)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        signed_angles(torch.zeros(3))
    with pytest.raises(ValueError, match="NaN"):
        signed_angles(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="weights"):
        signed_angles(torch.ones(2, 3), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="weights"):
        signed_angles(torch.ones(2, 3), torch.ones(3))
    with pytest.raises(ValueError, match="reference"):
        signed_angles(torch.ones(2, 3), reference=torch.ones(2))


def test_large_dimension_uses_little_memory() -> None:
    # 3 rows of 200k coordinates: the Gram path never forms an N x D singular-vector matrix.
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(3, 200_000, generator=gen, dtype=torch.float64)
    alpha = signed_angles(u)
    expected, _ = reference_signed_angles(u.numpy())
    np.testing.assert_allclose(alpha.numpy(), expected, atol=1e-9)


@pytest.mark.parametrize(("n", "d"), [(40, 700), (700, 40), (300, 300), (257, 1000)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lanczos_matches_the_dense_reference(n: int, d: int, seed: int) -> None:
    """The matrix-free top eigenvector equals the dense one up to sign; the angles agree."""
    from fedshard_lightning.sharding.contribution import _lanczos_projections, _principal_projections

    u = torch.from_numpy(random_updates(seed, n, d))
    # A planted direction in the residuals gives a clear spectral gap, as real shard updates have.
    gen = torch.Generator().manual_seed(seed)
    u += torch.outer(
        torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(d, generator=gen, dtype=torch.float64)
    )
    g = u.mean(0)
    coef = (u @ g) / (g @ g)
    keep = torch.ones(n, dtype=torch.bool)
    keep[3] = False  # a row counted as parallel is left out of both
    residuals = (u - coef[:, None] * g) * keep[:, None]
    dense = _principal_projections(residuals)
    lanczos = _lanczos_projections(u, g, coef, keep)
    scale = float(dense.abs().max())
    assert float((dense - lanczos).abs().max()) <= 1e-9 * scale
    # Same eigenvector up to sign: projections are R e, and R has full column rank here or e is
    # recovered through R^T, so equal projections mean equal directions.
    cos = float(dense @ lanczos) / float(dense.norm() * lanczos.norm())
    assert abs(abs(cos) - 1.0) < 1e-12
    a, b = signed_angles(u, method="dense"), signed_angles(u, method="lanczos")
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-12)
    expected, gap = reference_signed_angles(u.numpy())
    assert gap > 1e-6
    np.testing.assert_allclose(b.numpy(), expected, atol=1e-9)


def test_lanczos_is_deterministic_and_handles_all_parallel_rows() -> None:
    u = torch.from_numpy(random_updates(5, 400, 300))
    a, b = signed_angles(u, method="lanczos"), signed_angles(u, method="lanczos")
    assert torch.equal(a, b)
    parallel = torch.outer(
        torch.arange(1.0, 301.0, dtype=torch.float64), torch.ones(300, dtype=torch.float64)
    )
    assert torch.equal(signed_angles(parallel, method="lanczos"), signed_angles(parallel, method="dense"))
    with pytest.raises(ValueError, match="method"):
        signed_angles(u, method="svd")


# ---------------------------------------------------------------------- flatten_update


def model_state(gen: torch.Generator, lead: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    shapes = {"layer.weight": (3, 4), "layer.bias": (3,), "a.scale": (), "z.conv": (2, 1, 2, 2)}
    return {k: torch.randn((*lead, *s), generator=gen, dtype=torch.float64) for k, s in shapes.items()}


def test_flatten_update_layout_and_round_trip() -> None:
    gen = torch.Generator().manual_seed(0)
    initial = model_state(gen)
    final = {k: v + torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in initial.items()}
    flat = flatten_update(final, initial, stacked=False)
    assert flat.shape == (1 + 3 + 12 + 8,)
    manual = torch.cat([(final[k] - initial[k]).reshape(-1) for k in sorted(final)])
    assert torch.equal(flat, manual)
    # Insertion order does not matter.
    assert torch.equal(flatten_update(dict(reversed(final.items())), initial, stacked=False), flat)
    back = unflatten_update(flat, initial)
    assert list(back) == sorted(initial)
    for k in initial:
        torch.testing.assert_close(initial[k] + back[k], final[k], rtol=0, atol=1e-15)


@pytest.mark.parametrize("shared_initial", [False, True])
def test_flatten_update_stacked(shared_initial: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    n = 5
    final = model_state(gen, (n,))
    initial = model_state(gen) if shared_initial else model_state(gen, (n,))
    flat = flatten_update(final, initial, stacked=True)
    assert flat.shape == (n, 24)
    for i in range(n):
        row_final = {k: v[i] for k, v in final.items()}
        row_initial = initial if shared_initial else {k: v[i] for k, v in initial.items()}
        assert torch.equal(flat[i], flatten_update(row_final, row_initial, stacked=False))
    like = {k: v[0] for k, v in final.items()}
    back = unflatten_update(flat, like, stacked=True)
    for k in final:
        torch.testing.assert_close(initial[k] + back[k], final[k], rtol=0, atol=1e-15)


def test_flatten_update_dtype_and_errors() -> None:
    gen = torch.Generator().manual_seed(2)
    initial = {k: v.float() for k, v in model_state(gen).items()}
    final = {k: v + 1 for k, v in initial.items()}
    assert flatten_update(final, initial, stacked=False, dtype=torch.float64).dtype == torch.float64
    with pytest.raises(ValueError, match="same keys"):
        flatten_update({**final, "extra": torch.zeros(1)}, initial, stacked=False)
    with pytest.raises(ValueError, match="does not match"):
        flatten_update({**final, "layer.bias": torch.zeros(4)}, initial, stacked=False)
    with pytest.raises(ValueError, match="expected"):
        flatten_update(final, initial, stacked=True)
    with pytest.raises(ValueError, match="empty"):
        flatten_update({}, {}, stacked=False)
    with pytest.raises(ValueError, match="does not match"):
        unflatten_update(torch.zeros(5), initial)
