"""A FedShard run under gc: requests add only their shards, a gc'd cache audits, old manifests stay."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "unlearning"))

from _fedshard_helpers import audit, fit, loaded, unlearn

from fedshard_lightning.cache import FLCache


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
