"""A FedShard run under gc: requests add only their shards, a gc'd cache audits, old manifests stay."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "unlearning"))

from _fedshard_helpers import audit, fit, loaded, make, unlearn

from fedshard_lightning.flcache import FLCache
from fedshard_lightning.unlearning.plan_state import thaw


def _model_blobs(cache: FLCache, version: str) -> set[str]:
    m = cache.manifest(version)
    return {d for s in m["stacks"] for d in cache.stack_digests(s, version, m)}


def test_requests_add_their_shards_and_a_gcd_cache_still_audits(run_root: Path) -> None:
    run = fit(run_root, k=8)
    cache = FLCache(run / "cache")
    seen = _model_blobs(cache, cache.current())
    assert len(seen) == 4 + 2 + 1  # K + P bound: sum_p ceil(8 / 2**p) shard models
    for clients in ([3], [0, 6], [5]):
        rep = unlearn(run_root, run, clients)
        now = _model_blobs(cache, cache.current())
        assert len(now - seen) <= len(rep["retrained_shards"])
        seen |= now
    versions = cache.versions()
    out = cache.gc(keep=1)
    assert out["kept"] == [versions[-1]] and len(out["pruned"]) == len(versions) - 1
    assert audit(run_root, run)["passed"]
    alg = loaded(run_root, run)
    assert alg.unlearned == [0, 3, 5, 6]
    for j, v in enumerate(versions):  # the history stays: every manifest, request log and model digest
        m = cache.manifest(v)
        assert len(cache.stack_digests("stage_1", v, m)) == 4
        assert len(m["requests"]) == max(0, j - 2)  # versions 1-3 are fit's stage commits
        cache.verify(v)
    rep = unlearn(run_root, run, [1])  # a gc'd cache takes further requests
    assert rep["client_steps"] > 0 and audit(run_root, run)["passed"]


def test_the_state_declares_the_changed_shards_and_the_commit_writes_only_those(run_root: Path) -> None:
    """``changed`` is explicit state: what_if returns it (pure), cache_stacks turns it into rows."""
    run = fit(run_root, k=8)
    alg = loaded(run_root, run)
    cache = FLCache(run / "cache")
    assert alg.changed == {}
    assert all(st.rows == [] for st in alg.cache_stacks(cache).values())  # loaded: nothing to write
    before = alg.state_dict()
    state, result = alg.what_if(before, [3])
    assert alg.changed == {} and before["changed"] == {}  # what_if leaves the instance and its input alone
    retrained = {}
    for s in result.details["retrained_shards"]:
        retrained.setdefault(s["stage"], []).append(s["shard"])
    assert thaw(state["changed"]) == retrained and sorted(retrained) == [1, 2, 3]
    alg.load_state_dict(state)
    rows = {name: st.rows for name, st in alg.cache_stacks(cache).items()}
    assert rows == {f"stage_{p}": retrained[p] for p in (1, 2, 3)}
    alg.committed(cache, cache.current())  # pretend the state is the current version's: nothing changed
    assert alg.changed == {}
    other = loaded(run_root, run)  # a state that did not come from this version: every row is hashed
    other.load_state_dict(state)
    other._committed = None
    assert all(st.rows is None for st in other.cache_stacks(cache).values())


def test_records_loaded_from_the_cache_equal_those_the_request_left_in_memory(run_root: Path) -> None:
    """The load rebuilds clients, remaining clients and weights from the tree's arrays, bit for bit."""
    kw = dict(
        k=9,
        merge_rate=3,
        merge_weighting="samples",
        data_kw=dict(partition="dirichlet", rho=0.5, min_client_size=4),
    )
    run = fit(run_root, **kw)
    trainer, model, dm = make(run_root, **kw)
    trainer.unlearn(model, dm, str(run), [2, 7])
    after = trainer.algorithm
    again = loaded(run_root, run, **kw)
    assert again.tree == after.tree
    assert again.records == after.records  # dataclass equality: every field, weights as floats
    assert any(r.remaining != r.clients for recs in again.records for r in recs)
    assert all(
        r.remaining is r.clients
        for recs in again.records
        for r in recs
        if 2 not in r.clients and 7 not in r.clients
    )
