"""FLCache format 2: content-addressed blobs shared by versions, stacks with snapshot + delta indexes,
and a manifest whose load time does not grow with K."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache import FLCache, StackWrite


def _models(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, 4, 3, generator=gen),
        "b": torch.randn(n, 4, generator=gen, dtype=torch.float64),
        "s": torch.randn(n, generator=gen).to(torch.bfloat16),
    }


def _blobs(cache: FLCache) -> set[str]:
    return {p.name for p in (cache.root / "blobs").rglob("*") if p.is_file() and not p.name.startswith(".")}


def test_stack_round_trip_and_version_folders_hold_only_manifests(tmp_path: Path) -> None:
    cache = FLCache(tmp_path / "cache")
    m = _models(10)
    cache.commit(
        "0001-a", {"x": 1}, {"theta0.safetensors": {"t": torch.arange(3.0)}}, stacks={"s": StackWrite(m)}
    )
    out = cache.stack("s")
    assert all(torch.equal(out[k], m[k]) and out[k].dtype == m[k].dtype for k in m)
    # Keys come sorted, as load_file gave them: safetensors' load(bytes) order differs between
    # processes, and DDP ranks gather parameters in dict order.
    assert list(out) == sorted(m) and list(cache.tensors("theta0.safetensors")) == ["t"]
    assert torch.equal(cache.tensors("s.safetensors")["w"], m["w"])  # a stack reads as its format-1 file
    assert sorted(p.name for p in (cache.root / "0001-a").iterdir()) == ["manifest.json"]
    assert len(set(cache.stack_digests("s"))) == 10
    cache.verify()


def test_a_version_adds_exactly_the_rows_it_changed(tmp_path: Path) -> None:
    cache = FLCache(tmp_path / "cache")
    m = _models(64)
    theta0 = {"theta0.safetensors": {"t": torch.arange(3.0)}}
    cache.commit("0001-fit", {}, theta0, stacks={"s": StackWrite(m)})
    first, before = cache.stack_digests("s"), _blobs(cache)
    m2 = {k: v.clone() for k, v in m.items()}
    m2["w"][[5, 40]] += 1.0
    cache.commit("0002-req", {}, theta0, stacks={"s": StackWrite(m2, rows=[5, 40])})
    added = _blobs(cache) - before
    second = cache.stack_digests("s")
    assert {i for i in range(64) if first[i] != second[i]} == {5, 40}
    assert added == {second[5], second[40]}  # two models, no new snapshot (delta <= sqrt(64)), theta0 shared
    assert cache.manifest()["stacks"]["s"]["delta"].keys() == {"5", "40"}
    old = cache.stack("s", "0001-fit")  # the old version stays readable
    assert all(torch.equal(old[k], m[k]) for k in m)
    new = cache.stack("s")
    assert all(torch.equal(new[k], m2[k]) for k in m)
    # rows=None (state from elsewhere): every row is hashed, only missing blobs are written.
    before = _blobs(cache)
    cache.commit("0003-same", {}, theta0, stacks={"s": StackWrite(m2)})
    assert cache.stack_digests("s") == second
    assert _blobs(cache) == before


def test_snapshot_is_rewritten_once_the_delta_outgrows_sqrt_n(tmp_path: Path) -> None:
    cache = FLCache(tmp_path / "cache")
    n = 49
    m = _models(n)
    cache.commit("0001", {}, {}, stacks={"s": StackWrite(m)})
    snap = cache.manifest()["stacks"]["s"]["snapshot"]
    since, rewrites = 0, 0
    for j in range(1, 20):
        m["w"][j] += 1.0
        cache.commit(f"{j + 1:04d}", {}, {}, stacks={"s": StackWrite(m, rows=[j])})
        entry = cache.manifest()["stacks"]["s"]
        since += 1
        if since <= math.isqrt(n):
            assert entry["snapshot"] == snap and len(entry["delta"]) == since
        else:
            assert entry["snapshot"] != snap and entry["delta"] == {}
            snap, since, rewrites = entry["snapshot"], 0, rewrites + 1
        assert torch.equal(cache.stack("s")["w"], m["w"])
    assert rewrites == 2
    for v in cache.versions():
        cache.verify(v)


def test_identical_files_are_one_blob_and_reuse_needs_no_copy(tmp_path: Path) -> None:
    cache = FLCache(tmp_path / "cache")
    t = {"t": torch.arange(5.0)}
    cache.commit("0001", {}, {"a.safetensors": t, "b.safetensors": t})
    files = cache.manifest()["files"]
    assert files["a.safetensors"] == files["b.safetensors"] and len(_blobs(cache)) == 1
    cache.commit("0002", {}, {}, reuse={"c.safetensors": "a.safetensors"})
    assert cache.manifest()["files"]["c.safetensors"] == files["a.safetensors"]
    assert torch.equal(cache.tensors("c.safetensors")["t"], t["t"])
    with pytest.raises(CacheError, match="no such file"):
        cache.commit("0003", {}, {}, reuse={"d.safetensors": "zzz.safetensors"})


def test_a_torn_blob_left_by_a_crash_is_written_again(tmp_path: Path) -> None:
    cache = FLCache(tmp_path / "cache")
    t = {"t": torch.arange(5.0)}
    cache.commit("0001", {}, {"a.safetensors": t})
    path = cache.path_of("a.safetensors")
    path.write_bytes(path.read_bytes()[:10])  # what a power cut can leave of an uncommitted blob
    cache.commit("0002", {}, {"a.safetensors": t})
    assert torch.equal(cache.tensors("a.safetensors")["t"], t["t"])


def test_manifest_and_index_at_k_65536_stay_small_and_complete(tmp_path: Path) -> None:
    """The per-version part of loading at K = 65,536 (P = 16): manifest, structure-free index of every
    stage (snapshot + delta), without the model blobs themselves."""
    cache = FLCache(tmp_path / "cache")
    k, new, dirs = 65536, [], set()
    stacks = {}
    gen = torch.Generator().manual_seed(0)
    for p in range(1, 17):
        n = -(-k // 2**p)
        raw = torch.randint(0, 256, (n, 32), dtype=torch.uint8, generator=gen)
        from safetensors.torch import save

        snap = cache.writer.put(save({"digests": raw}), new, dirs)
        delta = {str(i): f"{i:064x}" for i in range(0, n, max(1, n // 16))}
        stacks[f"stage_{p}"] = {"rows": n, "snapshot": snap, "delta": delta}
    vdir = cache.root / "0001-fake"
    vdir.mkdir(parents=True)
    (vdir / "manifest.json").write_text(
        json.dumps(
            {
                "format": "fedshard-flcache/2",
                "files": {},
                "stacks": stacks,
                "unlearned": list(range(16)),
                "requests": [{"request": 1}],  # an inline log, as written before the log moved to blobs
            }
        )
    )
    from fedshard_lightning.flcache import sha256_file

    (cache.root / "CURRENT").write_text(
        json.dumps({"version": "0001-fake", "manifest_sha256": sha256_file(vdir / "manifest.json")})
    )
    manifest = cache.manifest()
    digests = [cache.stack_digests(f"stage_{p}", manifest=manifest) for p in range(1, 17)]
    assert sum(len(d) for d in digests) == sum(-(-k // 2**p) for p in range(1, 17))
    assert manifest["requests"] == [{"request": 1}]
    assert (vdir / "manifest.json").stat().st_size < 20_000  # what a load reads does not grow with K


def test_malformed_row_counts_and_out_of_range_rows_are_refused(tmp_path: Path) -> None:
    cache = FLCache(tmp_path / "cache")
    cache.commit("0001", {}, {}, stacks={"s": StackWrite(_models(4))})
    with pytest.raises(CacheError, match="rows out of range"):
        cache.commit("0002", {}, {}, stacks={"s": StackWrite(_models(4), rows=[4])})
    with pytest.raises(CacheError, match="same leading number of rows"):
        cache.commit("0003", {}, {}, stacks={"s": StackWrite({"a": torch.zeros(2, 1), "b": torch.zeros(3)})})
    assert cache.current() == "0001"


def test_the_request_log_is_stored_once_per_entry(tmp_path: Path) -> None:
    """Each manifest lists digests of its log entries; an entry shared with earlier versions is one blob."""
    cache = FLCache(tmp_path / "cache")
    log = []
    for j in range(5):
        log.append({"request": j + 1, "clients": [j], "retrained_shards": [{"stage": 1, "shard": j}] * 20})
        cache.commit(f"{j + 1:04d}", {"requests": log}, {})
        assert cache.manifest()["requests"] == log
        raw = json.loads((cache.root / f"{j + 1:04d}" / "manifest.json").read_text())
        assert len(raw["requests"]["blobs"]) == j + 1
    assert len(_blobs(cache)) == 5  # one blob per entry, shared by every later version
    assert cache.manifest("0002")["requests"] == log[:2]
    entry = cache.blob_path(
        json.loads((cache.root / "0005" / "manifest.json").read_text())["requests"]["blobs"][0]
    )
    entry.write_bytes(b'{"request": 99}')
    with pytest.raises(CacheError, match="checksum mismatch"):
        cache.manifest()
