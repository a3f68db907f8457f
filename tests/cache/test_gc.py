"""``cache gc --keep N``: drops the models no kept version uses, keeps every manifest and index; a crash
in the middle leaves a consistent cache; a gc'd FedShard run still audits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _cli import cli

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache import FLCache, StackWrite
from fedshard_lightning.flcache.io import _flock


def _history(root: Path, versions: int = 5, n: int = 16) -> tuple[FLCache, list[dict[str, torch.Tensor]]]:
    """A cache whose versions each change one row of a stack, plus a shared theta0."""
    cache = FLCache(root / "cache")
    m = {"w": torch.randn(n, 3, 2, generator=torch.Generator().manual_seed(0))}
    states = []
    for v in range(versions):
        rows = None if v == 0 else [v]
        if v:
            m = {"w": m["w"].clone()}
            m["w"][v] += 1.0
        cache.commit(
            f"{v + 1:04d}-v",
            {"v": v},
            {"theta0.safetensors": {"t": torch.ones(2)}},
            stacks={"s": StackWrite(m, rows)},
        )
        states.append(m)
    return cache, states


def _blobs(cache: FLCache) -> set[str]:
    return {p.name for p in (cache.root / "blobs").rglob("*") if p.is_file() and not p.name.startswith(".")}


def _consistent(cache: FLCache) -> None:
    """Every manifest and index readable; every version not pruned fully intact; current not pruned."""
    pruned = cache.pruned()
    assert cache.current() not in pruned
    for v in cache.versions():
        cache.manifest(v)
        cache.stack_digests("s", v)
        cache.verify(v)


def test_gc_keeps_the_newest_versions_and_every_manifest(tmp_path: Path) -> None:
    cache, states = _history(tmp_path)
    before = _blobs(cache)
    out = cache.gc(keep=2)
    assert out["kept"] == ["0004-v", "0005-v"] and out["pruned"] == ["0001-v", "0002-v", "0003-v"]
    # Version v changes row v - 1 for good: only versions 1-3 used the original rows 1, 2 and 3, so
    # those 3 models go; the snapshot indexes stay.
    assert out["removed_blobs"] == len(before) - len(_blobs(cache)) == 3
    _consistent(cache)
    for v, state in zip(cache.versions()[-2:], states[-2:]):
        assert torch.equal(cache.stack("s", v)["w"], state["w"])
    with pytest.raises(CacheError, match="pruned version 0001-v"):
        cache.stack("s", "0001-v")
    with pytest.raises(CacheError, match="pruned"):
        cache.set_current("0002-v")
    assert cache.gc(keep=2)["removed_blobs"] == 0  # idempotent
    with pytest.raises(CacheError, match="keep at least"):
        cache.gc(keep=0)


def test_gc_keeps_the_current_version_even_when_older(tmp_path: Path) -> None:
    cache, states = _history(tmp_path)
    cache.set_current("0002-v")
    out = cache.gc(keep=1)
    assert out["kept"] == ["0002-v", "0005-v"]
    assert torch.equal(cache.stack("s")["w"], states[1]["w"])
    _consistent(cache)


def test_gc_removes_blobs_that_a_killed_writer_left(tmp_path: Path) -> None:
    cache, _ = _history(tmp_path, versions=2)
    orphan = cache.blob_path("ab" * 32)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"left by a writer killed before its CURRENT update")
    cache.gc(keep=2)
    assert not orphan.exists()
    _consistent(cache)


class _Crash(BaseException):
    """Stands for a SIGKILL: nothing after it runs, no cleanup handler catches it."""


@pytest.mark.parametrize("after", [0, 1, 2])
def test_a_crash_in_the_middle_of_gc_leaves_a_consistent_cache(
    tmp_path: Path, monkeypatch, after: int
) -> None:
    cache, states = _history(tmp_path)
    real_unlink, calls = os.unlink, []

    def dying_unlink(path, *a, **kw):
        if len(calls) == after:
            raise _Crash
        calls.append(path)
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", dying_unlink)
    with pytest.raises(_Crash):
        cache.gc(keep=2)
    monkeypatch.setattr(os, "unlink", real_unlink)
    _consistent(cache)  # PRUNED was written before the first removal
    assert cache.pruned() == {"0001-v", "0002-v", "0003-v"}
    assert torch.equal(cache.stack("s")["w"], states[-1]["w"])
    out = cache.gc(keep=2)  # the next gc finishes the job
    assert out["removed_blobs"] == 3 - after
    _consistent(cache)


def test_a_crash_before_pruned_is_written_removes_nothing(tmp_path: Path, monkeypatch) -> None:
    cache, _ = _history(tmp_path)
    before = _blobs(cache)
    import fedshard_lightning.flcache.gc as mod  # gc lives there

    def dying_write(*a, **kw):
        raise _Crash

    monkeypatch.setattr(mod, "atomic_write_json", dying_write)
    with pytest.raises(_Crash):
        cache.gc(keep=1)
    monkeypatch.undo()
    assert _blobs(cache) == before and cache.pruned() == set()
    _consistent(cache)


def test_cli_gc_and_its_one_line_errors(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cache, _ = _history(run)
    code, out, err = cli(["cache", "gc", "--ckpt_path", str(run), "--keep", "3"])
    assert code == 0 and "kept the models of 3 versions" in out and "2 versions pruned" in out, err
    code, out, err = cli(["cache", "verify", "--ckpt_path", str(run), "--all"])
    assert code == 0 and "5 versions intact" in out, err
    for args, needle in [
        (
            ["cache", "gc", "--ckpt_path", str(tmp_path / "nope"), "--keep", "1"],
            "not a fedshard_lightning run",
        ),
        (["cache", "gc", "--ckpt_path", str(run), "--keep", "0"], "--keep=0"),
        (["cache", "gc", "--ckpt_path", str(run)], "--keep"),
        (["cache", "gc", "--ckpt_path", str(run), "--keep", "two"], "invalid int"),
        (["cache", "compact", "--ckpt_path", str(run)], "invalid choice"),
        (["cache"], "cache: name a subcommand, gc or verify"),
    ]:
        code, out, err = cli(args)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (
            args,
            err,
        )
    with _flock(run):  # an unlearn (or another gc) holds the run
        code, _, err = cli(["cache", "gc", "--ckpt_path", str(run), "--keep", "1"])
    assert code == 2 and "another process" in err and len(err.strip().splitlines()) == 1
    assert cache.pruned() == {"0001-v", "0002-v"}
    code, out, err = cli(["cache", "gc", "--ckpt_path", str(run), "--keep", "1"])
    assert code == 0 and "kept the models of 1 version (0005-v)" in out and "4 versions pruned" in out, out
