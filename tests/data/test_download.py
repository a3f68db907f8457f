from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
import zipfile

import pytest

from fedshard_lightning.data.download import (
    RemoteFile,
    extract,
    fetch,
    find_first,
    missing_files_error,
    verify,
)
from fedshard_lightning.errors import DataError

PAYLOAD = bytes(range(256)) * 64  # 16 KiB


def test_remote_file_requires_a_checksum():
    with pytest.raises(ValueError, match="sha256 or md5"):
        RemoteFile("a.bin", ("http://127.0.0.1/a.bin",))
    with pytest.raises(ValueError, match="hex"):
        RemoteFile("a.bin", ("http://127.0.0.1/a.bin",), md5="xyz")
    with pytest.raises(ValueError, match="plain file name"):
        RemoteFile("../a.bin", ("http://127.0.0.1/a.bin",), md5="0" * 32)


def test_checksum_match_downloads_and_verifies(server, tmp_path):
    file = server.remote("payload.bin", PAYLOAD, md5=True, sha256=True)
    path = fetch(file, tmp_path / "root", progress=False)
    assert path == tmp_path / "root" / "payload.bin"
    assert path.read_bytes() == PAYLOAD
    assert verify(path, file)
    assert not (tmp_path / "root" / "payload.bin.part").exists()


def test_checksum_mismatch_is_a_clear_error_and_leaves_nothing(server, tmp_path):
    good = server.remote("payload.bin", PAYLOAD)
    bad = RemoteFile(good.name, good.urls, md5="0" * 32)
    with pytest.raises(DataError) as info:
        fetch(bad, tmp_path, progress=False)
    message = str(info.value)
    assert "\n" not in message
    assert "payload.bin" in message
    assert "0" * 32 in message  # expected
    assert hashlib.md5(PAYLOAD).hexdigest() in message  # actual
    assert not (tmp_path / "payload.bin").exists()
    assert not (tmp_path / "payload.bin.part").exists()
    # with the right checksum, a later call downloads afresh and succeeds
    assert fetch(good, tmp_path, progress=False).read_bytes() == PAYLOAD


def test_interrupted_transfer_resumes_with_range(server, tmp_path):
    file = server.remote("payload.bin", PAYLOAD)
    server.state.cut["/files/payload.bin"] = 1
    with pytest.raises(DataError, match=r"payload\.bin"):
        fetch(file, tmp_path, progress=False, retries=1)
    part = tmp_path / "payload.bin.part"
    assert part.exists() and 0 < part.stat().st_size < len(PAYLOAD)
    assert not (tmp_path / "payload.bin").exists()
    path = fetch(file, tmp_path, progress=False, retries=1)
    assert path.read_bytes() == PAYLOAD
    assert server.requests[-1].range == f"bytes={len(PAYLOAD) // 2}-"
    assert not part.exists()


def test_interruption_is_retried_within_one_call(server, tmp_path):
    file = server.remote("payload.bin", PAYLOAD)
    server.state.cut["/files/payload.bin"] = 2
    path = fetch(file, tmp_path, progress=False, retries=3)
    assert path.read_bytes() == PAYLOAD
    assert [r.range is not None for r in server.requests] == [False, True, True]


def test_interrupted_official_download_resumes_from_the_mirror(server, tmp_path):
    server.serve("/official/payload.bin", PAYLOAD)
    file = server.remote("payload.bin", PAYLOAD).with_urls(
        server.url("/official/payload.bin"), server.url("/files/payload.bin")
    )
    server.state.cut["/official/payload.bin"] = 1
    assert fetch(file, tmp_path, progress=False).read_bytes() == PAYLOAD
    assert [(r.path, r.range) for r in server.requests] == [
        ("/official/payload.bin", None),
        ("/files/payload.bin", f"bytes={len(PAYLOAD) // 2}-"),
    ]


def test_server_without_range_support_restarts(server, tmp_path):
    file = server.remote("payload.bin", PAYLOAD)
    server.state.ignore_range = True
    (tmp_path / "payload.bin.part").write_bytes(PAYLOAD[:1000])
    path = fetch(file, tmp_path, progress=False)
    assert path.read_bytes() == PAYLOAD
    assert server.requests[0].range == "bytes=1000-"


def test_corrupt_partial_file_is_discarded_and_fetched_again(server, tmp_path):
    file = server.remote("payload.bin", PAYLOAD)
    (tmp_path / "payload.bin.part").write_bytes(b"\xff" * 100)  # wrong bytes from an earlier run
    path = fetch(file, tmp_path, progress=False)
    assert path.read_bytes() == PAYLOAD
    assert [r.range for r in server.requests] == ["bytes=100-", None]


def test_verified_file_is_not_fetched_again(server, tmp_path):
    file = server.remote("payload.bin", PAYLOAD)
    fetch(file, tmp_path, progress=False)
    server.requests.clear()
    mtime = (tmp_path / "payload.bin").stat().st_mtime_ns
    assert fetch(file, tmp_path, progress=False).read_bytes() == PAYLOAD
    assert server.requests == []
    assert (tmp_path / "payload.bin").stat().st_mtime_ns == mtime


def test_existing_file_that_fails_verification_is_kept_as_bad_and_replaced(server, tmp_path, caplog):
    file = server.remote("payload.bin", PAYLOAD)
    (tmp_path / "payload.bin").write_bytes(b"stale")
    with caplog.at_level("WARNING", logger="fedshard_lightning.data.download"):
        assert fetch(file, tmp_path, progress=False).read_bytes() == PAYLOAD
    assert len(server.requests) == 1
    assert (tmp_path / "payload.bin.bad").read_bytes() == b"stale", "a hand-placed file is never deleted"
    [message] = [r.getMessage() for r in caplog.records]
    assert "\n" not in message and "fails verification" in message and "kept as payload.bin.bad" in message
    # A second bad copy does not overwrite the first.
    (tmp_path / "payload.bin").write_bytes(b"stale again")
    file_again = RemoteFile(file.name, file.urls, md5=file.md5, size=len(PAYLOAD) + 1)
    with pytest.raises(DataError):
        fetch(file_again, tmp_path, progress=False, retries=1)
    assert (tmp_path / "payload.bin.bad").read_bytes() == b"stale"
    assert (tmp_path / "payload.bin.bad.2").read_bytes() == b"stale again"


def test_download_failure_names_the_manual_route(server, tmp_path):
    file = RemoteFile("gone.bin", (server.url("/a/gone.bin"),), md5="0" * 32)
    with pytest.raises(DataError) as info:
        fetch(file, tmp_path / "root", progress=False, retries=1)
    message = str(info.value)
    assert "\n" not in message
    assert f"put gone.bin (md5 {'0' * 32}) into {tmp_path / 'root'}" in message
    assert message.endswith("--data.download false")


def test_mirror_fallback(server, tmp_path):
    file = server.remote("payload.bin", PAYLOAD)
    mirrored = file.with_urls(server.url("/missing/payload.bin"), file.urls[0])
    assert fetch(mirrored, tmp_path, progress=False).read_bytes() == PAYLOAD
    assert [r.path for r in server.requests] == ["/missing/payload.bin", "/files/payload.bin"]


def test_all_urls_failing_names_file_and_urls(server, tmp_path):
    file = RemoteFile("gone.bin", (server.url("/a/gone.bin"), server.url("/b/gone.bin")), md5="0" * 32)
    with pytest.raises(DataError) as info:
        fetch(file, tmp_path, progress=False, retries=3)
    message = str(info.value)
    assert "\n" not in message and "gone.bin" in message and "/a/gone.bin" in message and "404" in message
    assert len(server.requests) == 2  # a 404 is not retried
    assert not (tmp_path / "gone.bin").exists()


def test_unreachable_host_is_retried_then_reported(tmp_path):
    file = RemoteFile("x.bin", ("http://127.0.0.1:9/x.bin",), md5="0" * 32)
    with pytest.raises(DataError, match=r"x\.bin"):
        fetch(file, tmp_path, progress=False, retries=2, timeout=2)


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_extract_tar_gz_atomic_and_idempotent(tmp_path):
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(_tar_gz({"top/x.txt": b"x", "top/sub/y.txt": b"y"}))
    dest = tmp_path / "out"
    extract(archive, dest)
    assert (dest / "top" / "x.txt").read_bytes() == b"x"
    assert (dest / "top" / "sub" / "y.txt").read_bytes() == b"y"
    assert (dest / ".a.tar.gz.extracted").exists()
    left = sorted(p.name for p in dest.iterdir() if not p.name.endswith(".lock"))
    assert left == [".a.tar.gz.extracted", "top"]  # no temp folder left
    (dest / "top" / "x.txt").write_bytes(b"edited")
    extract(archive, dest)  # the marker says done: nothing is rewritten
    assert (dest / "top" / "x.txt").read_bytes() == b"edited"


def test_extract_zip_members_and_gz(tmp_path):
    archive = tmp_path / "b.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("gzip/one.gz", b"1")
        zf.writestr("gzip/two.gz", b"2")
    extract(archive, tmp_path / "z", members=["gzip/one.gz"])
    assert (tmp_path / "z" / "gzip" / "one.gz").read_bytes() == b"1"
    assert not (tmp_path / "z" / "gzip" / "two.gz").exists()
    with pytest.raises(DataError, match=r"missing\.gz"):
        extract(archive, tmp_path / "z2", members=["gzip/missing.gz"])
    single = tmp_path / "c.txt.gz"
    single.write_bytes(gzip.compress(b"hello"))
    extract(single, tmp_path / "g")
    assert (tmp_path / "g" / "c.txt").read_bytes() == b"hello"


def test_extract_two_member_sets_into_one_folder_keeps_both(tmp_path):
    archive = tmp_path / "gzip.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("gzip/emnist-letters-train.gz", b"L")
        zf.writestr("gzip/emnist-digits-train.gz", b"D")
    extract(archive, tmp_path / "e", members=["gzip/emnist-letters-train.gz"])
    extract(archive, tmp_path / "e", members=["gzip/emnist-digits-train.gz"])
    assert (tmp_path / "e" / "gzip" / "emnist-letters-train.gz").read_bytes() == b"L"
    assert (tmp_path / "e" / "gzip" / "emnist-digits-train.gz").read_bytes() == b"D"


def test_progress_bar_on_a_terminal(server, tmp_path, monkeypatch):
    import sys

    from fedshard_lightning.data import download

    monkeypatch.setattr(download, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    file = server.remote("payload.bin", PAYLOAD)
    assert fetch(file, tmp_path, progress=True).read_bytes() == PAYLOAD


def test_extract_corrupt_archive_is_a_data_error_and_leaves_no_files(tmp_path):
    archive = tmp_path / "bad.tar.gz"
    archive.write_bytes(_tar_gz({"top/x.txt": b"x" * 10_000})[:60])
    with pytest.raises(DataError, match=r"bad\.tar\.gz"):
        extract(archive, tmp_path / "out")
    assert [p for p in (tmp_path / "out").iterdir() if not p.name.endswith(".lock")] == []


def test_extract_refuses_path_traversal(tmp_path):
    archive = tmp_path / "evil.tar.gz"
    archive.write_bytes(_tar_gz({"../escape.txt": b"x"}))
    with pytest.raises(DataError):
        extract(archive, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists()


def test_missing_files_error_is_one_line(tmp_path):
    error = missing_files_error("MNIST", tmp_path, ["a.gz", "b.gz"], "https://example.org/mnist/")
    message = str(error)
    assert isinstance(error, DataError)
    assert "\n" not in message
    for part in ("MNIST", str(tmp_path), "a.gz, b.gz", "https://example.org/mnist/", "download: true"):
        assert part in message


def test_find_first(tmp_path):
    (tmp_path / "b").write_bytes(b"")
    assert find_first(tmp_path, ["a", "b"]) == tmp_path / "b"
    assert find_first(tmp_path, ["a"]) is None
    assert os.fspath(find_first(tmp_path, ["b", "a"])) == os.fspath(tmp_path / "b")
