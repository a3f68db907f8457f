"""Loading never executes code and never trusts a modified byte (SPEC section 6).

A cache tensor file swapped for a malicious pickle is refused before anything reads it as a
pickle (its __reduce__ would create a marker file); a flipped byte anywhere in any tensor file
fails its checksum; a damaged manifest is a one-line CLI error; ``test`` reads model.safetensors
without unpickling.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
from _reliability_helpers import cli, copy_run, error_lines, snapshot
from safetensors.torch import load_file

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache import FLCache, load_tensors, sha256_file


class _Evil:
    """Unpickling this creates ``marker`` (a stand-in for running arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _evil_bytes(marker: Path) -> bytes:
    path = marker.with_name(marker.name + ".pt")
    torch.save({"weight": _Evil(marker)}, path)
    return path.read_bytes()


def _replace(path: Path, data: bytes) -> None:
    path.unlink()  # break a hard link shared with other versions
    path.write_bytes(data)


def _one_line_error(code, err, *needles):
    lines = error_lines(err)
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory, reference_run) -> Path:
    """A copy of the reference run; each test restores what it changes."""
    return copy_run(reference_run, tmp_path_factory.mktemp("safe") / "run")


@pytest.fixture
def restore(run):
    before = snapshot(run)
    yield
    for path in [p for p in run.rglob("*") if p.is_file() and p not in before]:
        path.unlink()
    for path, data in before.items():
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)


def test_the_payload_is_live(tmp_path):
    """Sanity check: plain unpickling of the payload does create the marker."""
    marker = tmp_path / "marker"
    data = _evil_bytes(marker)
    marker.unlink(missing_ok=True)
    (tmp_path / "evil.pt").write_bytes(data)
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


TENSOR_FILES = ["theta0.safetensors", "stage_1.safetensors", "stage_2.safetensors", "stage_3.safetensors"]


def _blob(cache: FLCache, name: str) -> Path:
    """The blob behind a tensor file; a stage's models are a stack of blobs (its row 1 here)."""
    stem = name.removesuffix(".safetensors")
    if stem in cache.manifest()["stacks"]:
        return cache.blob_path(cache.stack_digests(stem)[1 if len(cache.stack_digests(stem)) > 1 else 0])
    return cache.path_of(name)


@pytest.mark.parametrize("name", TENSOR_FILES)
def test_malicious_pickle_in_the_cache_is_refused(run, restore, tmp_path, name):
    cache = FLCache(run / "cache")
    version = cache.current()
    marker = tmp_path / "pwned"
    _replace(_blob(cache, name), _evil_bytes(marker))
    with pytest.raises(CacheError, match="checksum mismatch"):
        cache.tensors(name)
    # An attacker who also rewrites the checksums: still only parsed as safetensors, never unpickled.
    _rehash(run, version, name)
    with pytest.raises(CacheError, match="not a valid safetensors file"):
        cache.tensors(name)
    assert not marker.exists()


def _rehash(run: Path, version: str, name: str) -> None:
    """What an attacker who also rewrites checksums does: store the bad bytes under their own digest
    and point the manifest (and CURRENT) at them."""
    cache = FLCache(run / "cache")
    data = _blob(cache, name).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    cache.blob_path(digest).parent.mkdir(parents=True, exist_ok=True)
    cache.blob_path(digest).write_bytes(data)
    manifest_path = run / "cache" / version / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    stem = name.removesuffix(".safetensors")
    if stem in manifest["stacks"]:
        manifest["stacks"][stem]["delta"]["1" if manifest["stacks"][stem]["rows"] > 1 else "0"] = digest
    else:
        manifest["files"][name] = digest
    manifest_path.write_text(json.dumps(manifest))
    (run / "cache" / "CURRENT").write_text(
        json.dumps({"version": version, "manifest_sha256": sha256_file(manifest_path)})
    )


def test_malicious_pickle_in_the_cache_is_a_one_line_cli_error(run, restore, tmp_path, reference_run):
    cache = FLCache(run / "cache")
    version = cache.current()
    marker = tmp_path / "pwned"
    _replace(_blob(cache, "stage_2.safetensors"), _evil_bytes(marker))
    config = str(reference_run / "config.yaml")
    code, _, err = cli(["audit", "--config", config, "--ckpt_path", str(run)])
    _one_line_error(code, err, "stack stage_2", "checksum")
    _rehash(run, version, "stage_2.safetensors")
    code, _, err = cli(["unlearn", "--config", config, "--ckpt_path", str(run), "--clients", "[1]"])
    _one_line_error(code, err, "stack stage_2", "not a valid safetensors file")
    assert not marker.exists()


@pytest.mark.parametrize("where", ["header", "middle", "last"])
@pytest.mark.parametrize("name", TENSOR_FILES)
def test_a_flipped_byte_in_any_tensor_file_is_detected(run, restore, name, where):
    cache = FLCache(run / "cache")
    manifest = cache.manifest()
    assert {*manifest["files"], *(f"{s}.safetensors" for s in manifest["stacks"])} >= set(TENSOR_FILES)
    path = _blob(cache, name)
    data = bytearray(path.read_bytes())
    pos = {"header": 12, "middle": len(data) // 2, "last": len(data) - 1}[where]
    data[pos] ^= 0x01
    _replace(path, bytes(data))
    with pytest.raises(CacheError, match="checksum mismatch"):
        cache.tensors(name)
    with pytest.raises(CacheError, match=path.name):
        cache.verify()


def test_a_flipped_byte_fails_the_cli_with_one_line(run, restore, reference_run):
    cache = FLCache(run / "cache")
    path = _blob(cache, "stage_3.safetensors")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x80
    _replace(path, bytes(data))
    before = snapshot(run)
    code, _, err = cli(
        [
            "unlearn",
            "--config",
            str(reference_run / "config.yaml"),
            "--ckpt_path",
            str(run),
            "--clients",
            "[1]",
        ]
    )
    _one_line_error(code, err, "stack stage_3", "checksum mismatch")
    assert {p: b for p, b in snapshot(run).items() if p in before} == before


@pytest.mark.parametrize(
    ("damage", "command"),
    [
        pytest.param(lambda b: b"\x00\xffgarbage" * 10, "unlearn", id="garbage-unlearn"),
        pytest.param(lambda b: b[: len(b) // 2], "fit", id="truncated-fit"),
        pytest.param(lambda b: b"", "audit", id="empty-audit"),
        pytest.param(
            lambda b: b.replace(b'"unlearned": []', b'"unlearned": [1]'), "unlearn", id="edited-unlearn"
        ),
    ],
)
def test_a_damaged_manifest_is_a_one_line_cli_error(run, restore, reference_run, damage, command):
    cache = FLCache(run / "cache")
    path = run / "cache" / cache.current() / "manifest.json"
    new = damage(path.read_bytes())
    assert new != path.read_bytes()
    path.write_bytes(new)
    before = snapshot(run)
    extra = ["--clients", "[1]"] if command == "unlearn" else []
    code, _, err = cli(
        [command, "--config", str(reference_run / "config.yaml"), "--ckpt_path", str(run), *extra]
    )
    _one_line_error(code, err, "manifest.json")
    assert {p: b for p, b in snapshot(run).items() if p in before} == before


def test_names_from_current_and_manifest_must_stay_inside_the_cache(run, restore):
    cache = FLCache(run / "cache")
    version = cache.current()
    current = json.loads((run / "cache" / "CURRENT").read_text())
    (run / "cache" / "CURRENT").write_text(
        json.dumps({**current, "version": f"../../{run.name}/cache/{version}"})
    )
    with pytest.raises(CacheError, match="not a version folder"):
        cache.current()
    (run / "cache" / "CURRENT").write_text(json.dumps(current))
    manifest_path = run / "cache" / version / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    good = json.loads(manifest_path.read_text())
    manifest["files"]["../../../model.safetensors"] = manifest["files"].pop("theta0.safetensors")
    manifest_path.write_text(json.dumps(manifest))
    (run / "cache" / "CURRENT").write_text(
        json.dumps({**current, "manifest_sha256": sha256_file(manifest_path)})
    )
    with pytest.raises(CacheError, match="malformed file list"):
        cache.manifest()
    # Blob paths come from validated digests only; stack names are plain names too.
    for bad in (
        {"files": {**good["files"], "theta0.safetensors": "../../model.safetensors"}},
        {"stacks": {**good["stacks"], "../stage_3": good["stacks"]["stage_3"]}},
        {"stacks": {**good["stacks"], "stage_3": {**good["stacks"]["stage_3"], "snapshot": "../../x"}}},
        {
            "stacks": {
                **good["stacks"],
                "stage_3": {**good["stacks"]["stage_3"], "delta": {"0": "/etc/passwd"}},
            }
        },
        {"stacks": {**good["stacks"], "stage_3": {**good["stacks"]["stage_3"], "delta": {"7": "0" * 64}}}},
    ):
        manifest_path.write_text(json.dumps({**good, **bad}))
        (run / "cache" / "CURRENT").write_text(
            json.dumps({**current, "manifest_sha256": sha256_file(manifest_path)})
        )
        with pytest.raises(CacheError, match="malformed"):
            cache.manifest()


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any pickle-based load fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch.serialization, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def test_test_subcommand_reads_model_safetensors_without_unpickling(run, reference_run, no_unpickling):
    code, out, err = cli(["test", "--config", str(reference_run / "config.yaml"), "--ckpt_path", str(run)])
    assert code == 0, err
    metrics = json.loads((reference_run / "metrics.json").read_text())
    assert f"test_accuracy={metrics['test_accuracy']:.4f}" in out


def test_test_subcommand_with_a_model_file_never_unpickles(run, reference_run, no_unpickling):
    model = run / "model.safetensors"
    code, out, err = cli(["test", "--config", str(reference_run / "config.yaml"), "--ckpt_path", str(model)])
    assert code == 0, err
    assert "test_accuracy=" in out


def test_a_pickled_model_file_in_a_run_is_replaced_from_the_cache_by_test(
    run, restore, reference_run, tmp_path
):
    """`test RUN` evaluates the cache's model and repairs model.safetensors; the pickle never runs."""
    marker = tmp_path / "pwned"
    _replace(run / "model.safetensors", _evil_bytes(marker))
    code, out, _ = cli(["test", "--config", str(reference_run / "config.yaml"), "--ckpt_path", str(run)])
    assert code == 0 and "test_accuracy=" in out
    assert not marker.exists()
    assert load_file(str(run / "model.safetensors"))  # a valid safetensors file again


def test_a_pickled_model_file_given_as_ckpt_path_is_a_one_line_error(run, restore, reference_run, tmp_path):
    marker = tmp_path / "pwned"
    _replace(run / "model.safetensors", _evil_bytes(marker))
    try:
        code, _, err = cli(
            [
                "test",
                "--config",
                str(reference_run / "config.yaml"),
                "--ckpt_path",
                str(run / "model.safetensors"),
            ]
        )
    finally:
        assert not marker.exists(), "the payload ran"
    _one_line_error(code, err, "model.safetensors")


def test_safetensors_loader_refuses_pickles_directly(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "x.safetensors"
    path.write_bytes(_evil_bytes(marker))
    with pytest.raises(CacheError, match="not a valid safetensors file"):
        load_tensors(path)
    assert not marker.exists()
