"""Making a commit's files durable: every new file, then every directory naming one, is fsynced once."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from fedshard_lightning.flcache import io as cache_io

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")


def _files(tmp_path, n):
    out = []
    for i in range(n):
        sub = tmp_path / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        p = sub / f"f{i}"
        p.write_bytes(os.urandom(64))
        out.append(p)
    return out


def _recording(monkeypatch):
    seen, lock, real = [], threading.Lock(), os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        with lock:
            seen.append(path)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


@pytest.mark.parametrize("n", [1, 2, 20])
def test_every_file_then_every_directory_is_fsynced_once(tmp_path, monkeypatch, n):
    files = _files(tmp_path, n)
    dirs = {p.parent for p in files}
    seen = _recording(monkeypatch)
    cache_io._sync_paths(files, dirs)
    assert sorted(seen) == sorted([str(p) for p in files] + [str(d) for d in dirs])  # each once
    assert {str(p) for p in files} == set(seen[: len(files)])  # no directory before the last file
