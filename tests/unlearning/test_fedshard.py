"""FedShard training and exact unlearning (SPEC sections 2, 6, 7)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _fedshard_helpers import audit, fit, loaded, make, stage_models, unlearn

from fedshard_lightning.errors import CacheError, UnlearningRequestError
from fedshard_lightning.flcache import FLCache


def _retrained(report):
    return {(r["stage"], r["shard"]) for r in report["retrained_shards"]}


def test_exact_unlearning_single_then_multi(run_root):
    run = fit(run_root, k=8)
    before = stage_models(loaded(run_root, run))
    rep = unlearn(run_root, run, [3])
    assert rep["predicted_client_steps"] == rep["client_steps"] > 0
    assert len(_retrained(rep)) == 3  # one shard per stage, P = 3
    after_alg = loaded(run_root, run)
    after = stage_models(after_alg)
    for p, (b, a) in enumerate(zip(before, after), start=1):
        for i in range(next(iter(b.values())).shape[0]):
            same = all(torch.equal(b[k][i], a[k][i]) for k in b)
            assert same == ((p, i) not in _retrained(rep)), (p, i)
    res = audit(run_root, run)
    assert res["passed"] and res["max_abs_diff"] <= 1e-10
    rep2 = unlearn(run_root, run, [0, 6])
    assert rep2["predicted_client_steps"] == rep2["client_steps"]
    res = audit(run_root, run)
    assert res["passed"] and res["final_max_abs_diff"] <= 1e-10
    assert loaded(run_root, run).unlearned == [0, 3, 6]
    assert (run / "unlearning" / "0002" / "report.json").is_file()
    assert json.loads((run / "unlearn_report.json").read_text())["clients"] == [0, 6]


def test_request_that_empties_a_stage1_shard(run_root):
    run = fit(run_root, k=8, fixed_rounds=1)
    alg = loaded(run_root, run, fixed_rounds=1)
    pair = alg.records[0][1].clients
    rep = unlearn(run_root, run, pair, fixed_rounds=1)
    assert {"stage": 1, "shard": 1} in rep["empty_shards"]
    assert rep["predicted_client_steps"] == rep["client_steps"]
    res = audit(run_root, run, fixed_rounds=1)
    assert res["passed"]


def test_unequal_clients_sampling_and_samples_weighting_exact(run_root):
    kw = dict(
        k=9,
        data_kw=dict(partition="dirichlet", rho=0.5, min_client_size=4),
        merge_rate=3,
        client_fraction=0.6,
        merge_weighting="samples",
        rounds="a2",
        t0=1,
        t1=3,
    )
    run = fit(run_root, **kw)
    rep = unlearn(run_root, run, [2, 7], **kw)
    assert rep["predicted_client_steps"] == rep["client_steps"]
    assert audit(run_root, run, **kw)["passed"]


@pytest.mark.parametrize(("k", "r"), [(16, 2), (27, 3), (64, 2)])
def test_cost_ratio_matches_closed_form(run_root, k, r):
    kw = dict(k=k, per_client=4, merge_rate=r, fixed_rounds=1, local_steps=1, precision="32-true")
    run = fit(run_root, **kw)
    p = loaded(run_root, run, **kw).planned_stages
    assert r**p == k
    rep = unlearn(run_root, run, [k // 3], **kw)
    assert rep["client_steps"] == sum(r**q - 1 for q in range(1, p + 1))
    assert rep["retrain_client_steps"] == p * (k - 1)
    assert rep["retrain_client_steps"] / rep["client_steps"] == pytest.approx(
        p * (k - 1) / sum(r**q - 1 for q in range(1, p + 1))
    )
    assert rep["theoretical_r1"] == pytest.approx((r - 1) / r * k / (k - 1) * p)
    # the paper's r1 counts the leaving client on both sides: P K / sum_p R^p, exactly r1
    assert rep["speedup_client_steps_counting_leaving"] == pytest.approx(
        p * k / sum(r**q for q in range(1, p + 1)), rel=1e-12
    )
    assert rep["speedup_client_steps_counting_leaving"] == pytest.approx(rep["theoretical_r1"], rel=1e-12)


def test_resume_is_bit_identical(run_root, tmp_path):
    full = fit(run_root, k=8, rounds="a2", t0=1, t1=3)
    other_root = tmp_path / "other"
    partial = fit(other_root, k=8, rounds="a2", t0=1, t1=3)
    cache = FLCache(partial / "cache")
    cache.set_current(next(v for v in cache.versions() if v.endswith("stage-1")))
    trainer, model, dm = make(other_root, k=8, rounds="a2", t0=1, t1=3)
    metrics = trainer.fit(model, dm, ckpt_path=str(partial))
    assert metrics["resumed"]
    a = FLCache(full / "cache").tensors("stage_3.safetensors")
    b = FLCache(partial / "cache").tensors("stage_3.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fit_stores_each_shard_once_and_a_request_adds_only_its_shards(run_root):
    """Blobs are shared by versions: the cache holds O(K) models, and a request adds one per retrained shard."""
    run = fit(run_root, k=8)
    cache = FLCache(run / "cache")
    versions = cache.versions()
    assert len(versions) == 3
    for p in (1, 2, 3):
        digests = {tuple(cache.stack_digests(f"stage_{p}", v)) for v in versions[p - 1 :]}
        assert len(digests) == 1, p  # every later stage commit shares the stage's blobs
    for v in versions:
        cache.verify(v)
        assert not (
            run / "cache" / v / "stage_1.safetensors"
        ).exists()  # a version folder holds its manifest only
    assert len((run / "cache" / versions[-1] / "manifest.json").read_text().splitlines()) == 1
    before = {p.name for p in (run / "cache" / "blobs").rglob("*") if p.is_file()}
    old = {p: cache.stack_digests(f"stage_{p}") for p in (1, 2, 3)}
    rep = unlearn(run_root, run, [3])  # one shard per stage changes
    new = cache.current()
    changed = {
        (p, i)
        for p in (1, 2, 3)
        for i, d in enumerate(cache.stack_digests(f"stage_{p}", new))
        if d != old[p][i]
    }
    assert changed == _retrained(rep) and len(changed) == 3
    added = {p.name for p in (run / "cache" / "blobs").rglob("*") if p.is_file()} - before
    models_added = added & {d for p in (1, 2, 3) for d in cache.stack_digests(f"stage_{p}", new)}
    assert len(models_added) == 3  # exactly the retrained shards; the rest is index and metadata
    assert (
        cache.manifest(new)["files"]["theta0.safetensors"]
        == cache.manifest(versions[-1])["files"]["theta0.safetensors"]
    )
    cache.verify(new)
    cache.verify(versions[-1])  # the old version stays readable: the audit trail


def test_same_seed_bit_identical_other_seed_differs(run_root, tmp_path):
    a = FLCache(fit(run_root, k=8) / "cache").tensors("stage_3.safetensors")
    b = FLCache(fit(tmp_path / "b", k=8) / "cache").tensors("stage_3.safetensors")
    c = FLCache(fit(tmp_path / "c", k=8, seed=1) / "cache").tensors("stage_3.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("merge", ["a1", "a1_cost", "a1_count", "random"])
@pytest.mark.parametrize("rounds", ["fixed", "a2", "auto", "stage_a2"])
def test_ablation_settings_train_and_unlearn(run_root, merge, rounds):
    kw = dict(k=8, merge=merge, rounds=rounds, t0=1, t1=3, max_rounds=3, precision="64-true")
    run = fit(run_root, **kw)
    alg = loaded(run_root, run, **kw)
    for recs in alg.records:
        for rec in recs:
            assert 1 <= rec.rounds <= 3 if rounds != "fixed" else rec.rounds == 2
    unlearn(run_root, run, [5], **kw)
    assert audit(run_root, run, **kw)["passed"]


def test_a1_path_with_stage_shared_rounds_trains_and_unlearns_exactly(run_root):
    """``merge: a1_path, rounds: stage_a2``: one number of rounds per stage, every client's predicted
    cost equal to a plain loop over the frozen tree, exact unlearning (audit)."""
    kw = dict(k=8, merge="a1_path", rounds="stage_a2", max_rounds=3, precision="64-true")
    run = fit(run_root, **kw)
    alg = loaded(run_root, run, **kw)
    assert alg.variant == "merge: a1_path, rounds: stage_a2"
    for recs in alg.records:
        assert len({rec.rounds for rec in recs}) == 1 and 1 <= recs[0].rounds <= 3
    steps = alg._steps
    for c in range(8):
        want = sum(
            rec.rounds * (sum(steps[o] for o in rec.clients) - steps[c])
            for recs in alg.records
            for rec in recs
            if c in rec.clients
        )
        assert alg.predict_cost([c]) == want
    unlearn(run_root, run, [5], **kw)
    assert audit(run_root, run, **kw)["passed"]


@pytest.mark.parametrize(
    ("clients", "pattern"),
    [
        ([99], "unknown client id 99"),
        ([-1], "unknown client id -1"),
        ([1, 1], "duplicate ids"),
        ([], "at least one"),
        (["a"], "not an integer"),
        (list(range(8)), "every remaining client"),
    ],
)
def test_bad_requests_leave_cache_untouched(run_root, clients, pattern):
    run = fit(run_root, k=8, fixed_rounds=1)
    snapshot = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(UnlearningRequestError, match=pattern):
        unlearn(run_root, run, clients, fixed_rounds=1)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "journal" not in p.name} == {
        p: b for p, b in snapshot.items()
    }


def test_already_applied_request_is_not_applied_twice(run_root):
    run = fit(run_root, k=8, fixed_rounds=1)
    unlearn(run_root, run, [2], fixed_rounds=1)
    versions = FLCache(run / "cache").versions()
    again = unlearn(run_root, run, [2], fixed_rounds=1)
    assert again["already_applied"]
    assert FLCache(run / "cache").versions() == versions


def test_a_request_overlapping_an_applied_one_is_refused_and_names_the_overlap(run_root):
    run = fit(run_root, k=8, fixed_rounds=1)
    unlearn(run_root, run, [2], fixed_rounds=1)
    snapshot = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "journal" not in p.name}
    with pytest.raises(
        UnlearningRequestError, match=r"clients: \[2\] were already unlearned .* leave them out"
    ):
        unlearn(run_root, run, [2, 5], fixed_rounds=1)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "journal" not in p.name} == snapshot


def test_foreign_and_corrupt_caches_are_refused(run_root):
    run = fit(run_root, k=8, fixed_rounds=1)
    with pytest.raises(CacheError, match="another config or dataset"):
        unlearn(run_root, run, [1], fixed_rounds=1, seed=7)
    with pytest.raises(CacheError, match="another config or dataset"):
        unlearn(run_root, run, [1], fixed_rounds=1, data_kw=dict(seed=3))
    cache = FLCache(run / "cache")
    stage_file = cache.blob_path(cache.stack_digests("stage_2")[1])
    data = bytearray(stage_file.read_bytes())
    data[-3] ^= 0xFF
    stage_file.chmod(0o644)
    stage_file.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="checksum mismatch"):
        unlearn(run_root, run, [1], fixed_rounds=1)
    stage_file.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CacheError):
        unlearn(run_root, run, [1], fixed_rounds=1)


def test_a1_groups_stage_one_at_random(run_root):
    """``merge: a1`` (the default): stage 1 is the seeded random grouping of SPEC section 5 step 1."""
    from fedshard_lightning.sharding import random_grouping

    kw = dict(k=8, merge="a1", rounds="a2", t0=1, t1=3)
    run = fit(run_root, **kw)
    alg = loaded(run_root, run, **kw)
    stage_one = sorted(sorted(r.children) for r in alg.records[0])
    at_random = sorted(sorted(g) for g in random_grouping(8, 2, alg._merge_seed(1)))
    assert stage_one == at_random
    kw["merge"] = "a1_cost"  # our variant fills stage 1 by the predicted costs instead
    variant = loaded(run_root, fit(run_root, **kw), **kw)
    assert sorted(sorted(r.children) for r in variant.records[0]) != at_random


def _hand_a2(variances: list[float], t0: int, t1: int) -> list[int]:
    """SPEC section 5's A2, written out: nu = (v - v_min) / (v_max - v_min), T = round-half-up(T1 - nu (T1 - T0))."""
    lo, hi = min(variances), max(variances)
    if hi == lo:
        return [t1] * len(variances)
    return [int(np.floor(t1 - (v - lo) / (hi - lo) * (t1 - t0) + 0.5)) for v in variances]


@pytest.mark.parametrize("rounds", ["auto", "stage_a2"])
def test_auto_rounds_on_a_tiny_tree_match_a_hand_computation(run_root, rounds):
    """``rounds: auto`` (the default): stages 1-2 train to convergence, their fewest and most rounds
    become [T0, T1], stage 3 gets A2 over that range, the final stage T1. ``stage_a2``: the same
    range, one number of rounds per stage."""
    kw = dict(k=16, rounds=rounds, max_rounds=6, tolerance=1e-2, patience=1)
    alg = loaded(run_root, fit(run_root, **kw), **kw)
    assert [len(recs) for recs in alg.records] == [8, 4, 2, 1]
    calibrated = [rec.rounds for recs in alg.records[:2] for rec in recs]
    assert all(1 <= t <= 6 for t in calibrated)
    t0, t1 = min(calibrated), max(calibrated)
    assert alg.round_policy.observed_range == (t0, t1)
    children = [[alg.records[1][ch].alpha for ch in rec.children] for rec in alg.records[2]]
    want = _hand_a2([float(np.var(c)) for c in children], t0, t1)
    if rounds == "stage_a2":
        assert len({rec.rounds for rec in alg.records[0]}) == len({rec.rounds for rec in alg.records[1]}) == 1
        want = [int(np.floor(np.mean(want) + 0.5))] * len(want)
    assert [rec.rounds for rec in alg.records[2]] == want
    assert [rec.rounds for rec in alg.records[3]] == [t1]
