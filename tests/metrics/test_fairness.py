"""Tests of the FedShard fairness metrics M_e and M_p (paper section 5, SPEC section 8).

The reference is a plain-loop numpy/Python transcription of the SPEC formulas, written here
independently of the vectorised implementation.
"""

from __future__ import annotations

import datetime
import doctest
import itertools
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fedshard_lightning.metrics import (
    EfficiencyFairness,
    PerformanceFairness,
    client_distances,
    efficiency_fairness,
    performance_fairness,
)
from fedshard_lightning.metrics import fairness as fairness_module

HYPOTHESIS = settings(max_examples=60, deadline=None)


# --------------------------------------------------------------------------------------------------
# Independent reference (plain loops over clients)
# --------------------------------------------------------------------------------------------------


def ref_efficiency(costs, alphas, eps_alpha=1e-6):
    k = len(costs)
    z_avg = sum(float(z) for z in costs) / k
    total = 0.0
    for c in range(k):
        total += (z_avg - float(costs[c])) ** 2 / max(abs(float(alphas[c])), eps_alpha)
    return total / k


def ref_distances(alphas, leaving):
    out = []
    for c in range(len(alphas)):
        best = math.inf
        for r in range(len(alphas)):
            if not leaving[r]:
                best = min(best, abs(float(alphas[c]) - float(alphas[r])))
        out.append(best)
    return out


def ref_normalise(values, eps0, eps1):
    low, high = min(values), max(values)
    return [eps0 + (v - low) / (high - low + eps1) for v in values]


def ref_performance(delta_acc, alphas, leaving, eps0=0.01, eps1=1e-12):
    x = ref_normalise([float(v) for v in delta_acc], eps0, eps1)
    y = ref_normalise(ref_distances(alphas, leaving), eps0, eps1)
    total = 0.0
    for xc, yc in zip(x, y):
        total += (xc + yc) * (1.0 / xc + 1.0 / yc)
    return total / len(x)


def t64(values):
    return torch.tensor(values, dtype=torch.float64)


def tbool(values):
    return torch.tensor(values, dtype=torch.bool)


# --------------------------------------------------------------------------------------------------
# Strategies: small client populations, alphas drawn partly from a tiny pool to force ties and zeros
# --------------------------------------------------------------------------------------------------

ALPHA = st.one_of(
    st.sampled_from([0.0, 0.5, -0.5, 1.0]),
    st.floats(-math.pi, math.pi, allow_nan=False, allow_infinity=False),
)
COST = st.one_of(st.sampled_from([1.0, 2.0]), st.floats(0.0, 1e3, allow_nan=False, allow_infinity=False))
DELTA = st.one_of(st.sampled_from([0.0, 0.1]), st.floats(-1.0, 1.0, allow_nan=False, allow_infinity=False))


@st.composite
def efficiency_inputs(draw):
    k = draw(st.integers(1, 12))
    costs = draw(st.lists(COST, min_size=k, max_size=k))
    alphas = draw(st.lists(ALPHA, min_size=k, max_size=k))
    return costs, alphas


@st.composite
def performance_inputs(draw):
    k = draw(st.integers(1, 12))
    delta = draw(st.lists(DELTA, min_size=k, max_size=k))
    alphas = draw(st.lists(ALPHA, min_size=k, max_size=k))
    leaving = draw(st.lists(st.booleans(), min_size=k, max_size=k))
    leaving[draw(st.integers(0, k - 1))] = False  # at least one remaining client
    return delta, alphas, leaving


# --------------------------------------------------------------------------------------------------
# Against the reference
# --------------------------------------------------------------------------------------------------


@HYPOTHESIS
@given(efficiency_inputs())
def test_efficiency_matches_reference(inputs):
    costs, alphas = inputs
    value = efficiency_fairness(t64(costs), t64(alphas))
    assert value.dtype == torch.float64
    assert value.ndim == 0
    assert float(value) == pytest.approx(ref_efficiency(costs, alphas), rel=1e-9, abs=1e-9)


@HYPOTHESIS
@given(performance_inputs())
def test_performance_matches_reference(inputs):
    delta, alphas, leaving = inputs
    value = performance_fairness(t64(delta), t64(alphas), tbool(leaving))
    assert value.dtype == torch.float64
    assert value.ndim == 0
    assert float(value) == pytest.approx(ref_performance(delta, alphas, leaving), rel=1e-9)


@HYPOTHESIS
@given(performance_inputs())
def test_client_distances_match_reference(inputs):
    _, alphas, leaving = inputs
    y = client_distances(t64(alphas), tbool(leaving))
    np.testing.assert_array_equal(y.numpy(), np.array(ref_distances(alphas, leaving)))
    assert (y[~tbool(leaving)] == 0).all()


CASES = {
    # name: (delta_acc, costs, alphas, leaving)
    "ties": ([0.1, 0.1, 0.3, 0.3], [5.0, 5.0, 7.0, 7.0], [0.5, 0.5, -0.5, -0.5], [True, False, True, False]),
    "zero_alphas": ([0.0, 0.2, 0.4], [1.0, 2.0, 4.0], [0.0, 0.0, 0.0], [False, True, False]),
    "single_leaving": (
        [0.02, 0.01, 0.5, 0.0],
        [3.0, 3.5, 9.0, 2.0],
        [0.1, -0.2, 1.3, 0.4],
        [False, False, True, False],
    ),
    "all_but_one_leaving": (
        [0.3, 0.2, 0.0, 0.6],
        [1.0, 8.0, 3.0, 2.0],
        [0.7, -0.4, 0.1, 1.2],
        [True, True, False, True],
    ),
    "one_client": ([0.25], [4.0], [0.3], [False]),
    "nobody_leaving": ([0.0, 0.1, -0.05], [1.0, 1.0, 2.0], [0.2, -0.3, 0.9], [False, False, False]),
    "integer_costs": ([0.1, 0.2], [10, 30], [0.5, 1.0], [True, False]),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_parametrized_cases_match_reference(case):
    delta, costs, alphas, leaving = case
    me = efficiency_fairness(torch.as_tensor(np.asarray(costs)), t64(alphas))  # int costs stay int64
    mp_ = performance_fairness(t64(delta), t64(alphas), tbool(leaving))
    assert float(me) == pytest.approx(ref_efficiency(costs, alphas), rel=1e-12)
    assert float(mp_) == pytest.approx(ref_performance(delta, alphas, leaving), rel=1e-12)


def test_hand_computed_values():
    # M_e: Z_avg = 2, deviations (-1, 1), weights (0.5, 1) -> (1/0.5 + 1/1) / 2 = 1.5.
    assert float(efficiency_fairness(t64([1.0, 3.0]), t64([0.5, -1.0]))) == pytest.approx(1.5, rel=1e-15)
    # A zero alpha is floored at eps_alpha: (1/1e-3 + 1/1) / 2.
    value = efficiency_fairness(t64([1.0, 3.0]), t64([0.0, 1.0]), eps_alpha=1e-3)
    assert float(value) == pytest.approx(500.5, rel=1e-15)
    # One client: x~ = y~ = eps0, f = (2 eps0)(2 / eps0) = 4.
    assert float(performance_fairness(t64([0.3]), t64([0.2]), tbool([False]))) == pytest.approx(
        4.0, rel=1e-15
    )


# --------------------------------------------------------------------------------------------------
# Properties stated in the paper (section 5 and Appendix F)
# --------------------------------------------------------------------------------------------------


@HYPOTHESIS
@given(
    cost=st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False),
    alphas=st.lists(ALPHA, min_size=1, max_size=12),
)
def test_efficiency_is_exactly_zero_for_equal_costs(cost, alphas):
    """Appendix F, "reduction to equality": equal costs are perfectly efficiency-fair."""
    value = efficiency_fairness(t64([cost] * len(alphas)), t64(alphas))
    assert float(value) == 0.0


def test_efficiency_grows_with_cost_spread_and_shrinks_with_contribution():
    alphas = t64([0.5, 0.5, 0.5])
    narrow = efficiency_fairness(t64([9.0, 10.0, 11.0]), alphas)
    wide = efficiency_fairness(t64([5.0, 10.0, 15.0]), alphas)
    assert wide > narrow > 0
    assert efficiency_fairness(t64([5.0, 10.0, 15.0]), 2 * alphas) < wide


@HYPOTHESIS
@given(performance_inputs())
def test_performance_is_at_least_four(inputs):
    """Each term is 2 + x~/y~ + y~/x~ >= 4."""
    delta, alphas, leaving = inputs
    assert float(performance_fairness(t64(delta), t64(alphas), tbool(leaving))) >= 4.0 - 1e-12


@HYPOTHESIS
@given(
    inputs=performance_inputs(),
    scale=st.floats(1e-3, 1e3),
    shift=st.floats(-1.0, 1.0),
)
def test_performance_is_four_when_degradation_is_affine_in_distance(inputs, scale, shift):
    """The minimum of f is at x~ == y~: a drop proportional to uniqueness is perfectly fair."""
    _, alphas, leaving = inputs
    y = client_distances(t64(alphas), tbool(leaving))
    spread = float(y.max() - y.min())
    # x~ equals y~ up to eps1 (1e-12) over the drops' range: the property is exact only when that
    # range dwarfs eps1 (hypothesis found scale 2**-8 times a 6e-8 spread: off by 3e-6).
    assume(spread == 0.0 or scale * spread >= 1e-4)
    value = performance_fairness(scale * y + shift, t64(alphas), tbool(leaving))
    assert float(value) == pytest.approx(4.0, abs=1e-6)


@HYPOTHESIS
@given(inputs=performance_inputs(), seed=st.integers(0, 2**32 - 1))
def test_performance_is_minimal_when_degradation_is_ranked_like_distance(inputs, seed):
    """Appendix F, lemma `mpequiv2`: for a fixed multiset of drops, ranking them like y minimises M_p.

    Normalisation is monotone and permutation-invariant, and each term is 2 + x~/y~ + y~/x~, so
    by the rearrangement inequality pairing the sorted x~ with the sorted y~ (and hence 1/y~ in
    opposite order) minimises both sums. This holds for every permutation, ties included. (The
    lemma's closed form of the swap difference has a sign slip; the conclusion is right.)
    """
    delta, alphas, leaving = inputs
    alphas_t, leaving_t = t64(alphas), tbool(leaving)
    y = client_distances(alphas_t, leaving_t)
    matched = torch.empty(len(delta), dtype=torch.float64)
    matched[torch.argsort(y, stable=True)] = torch.sort(t64(delta)).values
    permuted = matched[torch.from_numpy(np.random.default_rng(seed).permutation(len(delta)))]
    best = performance_fairness(matched, alphas_t, leaving_t)
    other = performance_fairness(permuted, alphas_t, leaving_t)
    assert float(best) <= float(other) * (1 + 1e-12)


def test_performance_penalises_remaining_client_losing_more_than_unique_leaver():
    """Paper section 5.1, second example: a remaining client hurt more than a unique leaver is unfair."""
    alphas, leaving = t64([0.0, 0.1, 1.0]), tbool([False, True, True])
    fair = performance_fairness(t64([0.0, 0.1, 0.5]), alphas, leaving)
    unfair = performance_fairness(t64([0.5, 0.1, 0.0]), alphas, leaving)
    assert fair < unfair


@HYPOTHESIS
@given(performance_inputs(), st.integers(0, 2**32 - 1))
def test_metrics_are_invariant_to_client_order(inputs, seed):
    """What makes the order of DDP gathering irrelevant."""
    delta, alphas, leaving = inputs
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(delta)))
    d, a, m = t64(delta), t64(alphas), tbool(leaving)
    torch.testing.assert_close(
        performance_fairness(d, a, m), performance_fairness(d[order], a[order], m[order])
    )
    torch.testing.assert_close(efficiency_fairness(d, a), efficiency_fairness(d[order], a[order]))


# --------------------------------------------------------------------------------------------------
# Metric classes
# --------------------------------------------------------------------------------------------------


@HYPOTHESIS
@given(inputs=performance_inputs(), cuts=st.lists(st.integers(0, 12), max_size=4))
def test_metric_classes_equal_functional_over_batches(inputs, cuts):
    delta, alphas, leaving = inputs
    k = len(delta)
    bounds = [0, *sorted(min(c, k) for c in cuts), k]  # empty batches allowed
    d, a, m = t64(delta), t64(alphas), tbool(leaving)
    me, mp_ = EfficiencyFairness(), PerformanceFairness()
    for lo, hi in itertools.pairwise(bounds):
        me.update(d[lo:hi], a[lo:hi])
        mp_.update(d[lo:hi], a[lo:hi], m[lo:hi])
    torch.testing.assert_close(me.compute(), efficiency_fairness(d, a), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mp_.compute(), performance_fairness(d, a, m), rtol=1e-12, atol=0.0)


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric EfficiencyFairness was called before")
def test_metric_class_options_forward_and_reset():
    d, a, m = t64([0.0, 0.2, 0.5]), t64([0.0, 0.3, 0.0]), tbool([False, True, False])
    me, mp_ = EfficiencyFairness(eps_alpha=0.1), PerformanceFairness(eps0=0.1, eps1=1e-6)
    assert EfficiencyFairness.higher_is_better is False and EfficiencyFairness.is_differentiable is False
    assert PerformanceFairness.higher_is_better is False and PerformanceFairness.is_differentiable is False
    torch.testing.assert_close(me(d, a), efficiency_fairness(d, a, eps_alpha=0.1))
    torch.testing.assert_close(mp_(d, a, m), performance_fairness(d, a, m, eps0=0.1, eps1=1e-6))
    me.reset()
    with pytest.raises(ValueError, match=r"before any client was passed to update\(\)"):
        me.compute()


def test_metric_keeps_float64_after_moving_and_float32_inputs():
    metric = PerformanceFairness().to("cpu")
    assert metric.dtype == torch.float64
    metric.update(
        torch.tensor([0.1, 0.2], dtype=torch.float32), torch.tensor([0.0, 1.0]), tbool([False, True])
    )
    assert metric.compute().dtype == torch.float64


def test_performance_metric_accepts_batch_of_only_leaving_clients():
    """y is a minimum over all remaining clients, so it is computed after all batches arrive."""
    metric = PerformanceFairness()
    metric.update(t64([0.4, 0.3]), t64([1.0, 0.9]), tbool([True, True]))
    metric.update(t64([0.0]), t64([0.0]), tbool([False]))
    expected = ref_performance([0.4, 0.3, 0.0], [1.0, 0.9, 0.0], [True, True, False])
    assert float(metric.compute()) == pytest.approx(expected, rel=1e-12)


# --------------------------------------------------------------------------------------------------
# Argument errors
# --------------------------------------------------------------------------------------------------

GOOD = t64([0.1, 0.2])
MASK = tbool([True, False])

ERRORS = {
    "costs_not_tensor": (lambda: efficiency_fairness([1.0, 2.0], GOOD), r"`costs` to be a torch\.Tensor"),
    "costs_2d": (lambda: efficiency_fairness(GOOD[None], GOOD), r"`costs` to be a 1-D tensor"),
    "costs_bool": (lambda: efficiency_fairness(MASK, GOOD), r"`costs` to be a real-valued"),
    "alphas_nan": (
        lambda: efficiency_fairness(GOOD, t64([0.1, math.nan])),
        r"`alphas` to contain only finite",
    ),
    "length_mismatch": (
        lambda: efficiency_fairness(GOOD, t64([0.1])),
        r"`costs` and `alphas` to have the same",
    ),
    "costs_empty": (lambda: efficiency_fairness(t64([]), t64([])), r"`costs` to hold at least one client"),
    "eps_alpha_zero": (
        lambda: efficiency_fairness(GOOD, GOOD, eps_alpha=0.0),
        r"`eps_alpha` to be a positive",
    ),
    "eps_alpha_nan": (lambda: efficiency_fairness(GOOD, GOOD, eps_alpha=math.nan), r"`eps_alpha`"),
    "eps_alpha_bool": (lambda: efficiency_fairness(GOOD, GOOD, eps_alpha=True), r"`eps_alpha`"),
    "delta_inf": (
        lambda: performance_fairness(t64([math.inf, 0.0]), GOOD, MASK),
        r"`delta_acc` to contain only",
    ),
    "mask_not_bool": (
        lambda: performance_fairness(GOOD, GOOD, torch.tensor([1, 0])),
        r"`leaving_mask`.*torch\.bool",
    ),
    "mask_not_tensor": (
        lambda: performance_fairness(GOOD, GOOD, [True, False]),
        r"`leaving_mask` to be a torch",
    ),
    "mask_length": (
        lambda: performance_fairness(GOOD, GOOD, tbool([True])),
        r"`delta_acc` and `leaving_mask`",
    ),
    "alphas_length": (lambda: performance_fairness(GOOD, t64([0.1]), MASK), r"`delta_acc` and `alphas`"),
    "all_leaving": (
        lambda: performance_fairness(GOOD, GOOD, tbool([True, True])),
        r"`leaving_mask` to leave at",
    ),
    "delta_empty": (
        lambda: performance_fairness(t64([]), t64([]), tbool([])),
        r"`delta_acc` to hold at least one client",
    ),
    "eps0_negative": (lambda: performance_fairness(GOOD, GOOD, MASK, eps0=-0.1), r"`eps0` to be a positive"),
    "eps1_zero": (lambda: performance_fairness(GOOD, GOOD, MASK, eps1=0.0), r"`eps1` to be a positive"),
    "distances_all_leaving": (lambda: client_distances(GOOD, tbool([True, True])), r"`leaving_mask`"),
    "metric_eps_alpha": (lambda: EfficiencyFairness(eps_alpha=-1.0), r"`eps_alpha`"),
    "metric_eps0": (lambda: PerformanceFairness(eps0=0), r"`eps0`"),
    "metric_update_mismatch": (
        lambda: EfficiencyFairness().update(GOOD, t64([1.0])),
        r"`costs` and `alphas`",
    ),
}


@pytest.mark.parametrize("call, match", ERRORS.values(), ids=ERRORS.keys())
def test_argument_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_metric_compute_with_no_remaining_client_raises():
    metric = PerformanceFairness()
    metric.update(GOOD, GOOD, tbool([True, True]))
    with pytest.raises(ValueError, match=r"`leaving_mask` to leave at least one remaining client"):
        metric.compute()


def test_docstring_examples():
    result = doctest.testmod(fairness_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0


# --------------------------------------------------------------------------------------------------
# DDP: two CPU processes, gloo, states gathered with dist_reduce_fx="cat"
# --------------------------------------------------------------------------------------------------


def _ddp_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    costs = torch.rand(10, generator=gen, dtype=torch.float64) * 100
    alphas = (torch.rand(10, generator=gen, dtype=torch.float64) - 0.5) * 2
    alphas[3] = 0.0
    delta = torch.rand(10, generator=gen, dtype=torch.float64) * 0.3
    leaving = torch.zeros(10, dtype=torch.bool)
    leaving[[1, 4, 8]] = True
    return costs, alphas, delta, leaving


def _ddp_scenarios(leaving: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Per scenario, the client indices of each rank (each rank updates in two batches)."""
    everyone = torch.arange(len(leaving))
    return {
        "halves": [everyone[:5], everyone[5:]],
        "uneven": [everyone[:9], everyone[9:]],
        "idle_rank": [everyone, everyone[:0]],  # rank 1 never calls update
        "leavers_apart": [everyone[leaving], everyone[~leaving]],  # rank 0 holds no remaining client
    }


def _ddp_worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)  # fail, do not hang, if a rank dies
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        costs, alphas, delta, leaving = _ddp_data()
        results = {}
        for name, split in _ddp_scenarios(leaving).items():
            me, mp_ = EfficiencyFairness(), PerformanceFairness()
            mine = split[rank]
            for part in (mine[: len(mine) // 2], mine[len(mine) // 2 :]):
                if len(part) and not (name == "idle_rank" and rank == 1):
                    me.update(costs[part], alphas[part])
                    mp_.update(delta[part], alphas[part], leaving[part])
            results[name] = (me.compute(), mp_.compute())
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_equal_single_process(tmp_path):
    # Fork, as Lightning's "ddp_fork" strategy does on CPU: spawn re-imports torch and torchmetrics
    # in every child, about 10x slower on a loaded machine. The workers use one intra-op thread.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    init_method = f"file://{tmp_path / 'rendezvous'}"
    context = mp.start_processes(
        _ddp_worker, args=(2, init_method, str(tmp_path)), nprocs=2, join=False, start_method=method
    )
    deadline = time.monotonic() + 120
    while not context.join(timeout=1.0):  # raises if a worker fails
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two DDP workers did not finish within 120 s")
    costs, alphas, delta, leaving = _ddp_data()
    expected_me = efficiency_fairness(costs, alphas)
    expected_mp = performance_fairness(delta, alphas, leaving)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(results) == set(_ddp_scenarios(leaving))
        for name, (me, mp_) in results.items():
            torch.testing.assert_close(me, expected_me, rtol=1e-12, atol=0.0, msg=f"M_e, {name}, rank {rank}")
            torch.testing.assert_close(
                mp_, expected_mp, rtol=1e-12, atol=0.0, msg=f"M_p, {name}, rank {rank}"
            )
