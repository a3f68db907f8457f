"""``FEDSHARD_MANIFEST_KEY``: a signed run refuses a blob changed with every checksum rewritten.

The checksums alone cannot tell such a change from the real thing (only ``audit`` recomputes the
model); the signature of ``CURRENT`` can, and only the key's holder can make a new one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from _reliability_helpers import TINY, cli, copy_run, error_lines, tree_hash
from safetensors.torch import load, save

from fedshard_lightning.flcache import FLCache, sha256_file
from fedshard_lightning.flcache.manifest_key import KEY_VARIABLE

KEY = "correct horse battery staple"


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory) -> Path:
    """The tiny fit written with the key set; never modify it, copy it."""
    root = tmp_path_factory.mktemp("signed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_VARIABLE, KEY)
        code, _, err = cli(["fit", *TINY, "--trainer.default_root_dir", str(root), "--trainer.run_name", "r"])
    assert code == 0, err
    return root / "r"


def _scale_final_model(run: Path) -> None:
    """The last stage's first shard model scaled by 2; its blob, the manifest and CURRENT rehashed."""
    cache = FLCache(run / "cache")
    version = cache.current()
    stack = sorted(cache.manifest()["stacks"])[-1]
    old = load(cache.blob_path(cache.stack_digests(stack)[0]).read_bytes())
    data = save({k: v * 2 for k, v in old.items()})
    digest = hashlib.sha256(data).hexdigest()
    cache.blob_path(digest).parent.mkdir(parents=True, exist_ok=True)
    cache.blob_path(digest).write_bytes(data)
    path = run / "cache" / version / "manifest.json"
    raw = json.loads(path.read_bytes())
    raw["stacks"][stack]["delta"]["0"] = digest
    path.write_text(json.dumps(raw))
    current = json.loads((run / "cache" / "CURRENT").read_text())
    current["manifest_sha256"] = sha256_file(path)  # its hmac stays: the tamperer has no key
    (run / "cache" / "CURRENT").write_text(json.dumps(current))


def _refused(argv: list[str], needle: str, watched: Path) -> None:
    before = tree_hash(watched)
    code, _, err = cli(argv)
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert tree_hash(watched) == before


def test_a_signed_run_reads_with_its_key(signed_run, tmp_path, monkeypatch):
    run = copy_run(signed_run, tmp_path / "r")
    assert "hmac" in json.loads((run / "cache" / "CURRENT").read_text())
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    for argv in (["test", "--ckpt_path", str(run)], ["cache", "verify", "--all", "--ckpt_path", str(run)]):
        code, _, err = cli(argv)
        assert code == 0, err
    code, _, err = cli(["unlearn", "--ckpt_path", str(run), "--clients", "[2]"])  # the new CURRENT is signed
    assert code == 0, err
    assert "hmac" in json.loads((run / "cache" / "CURRENT").read_text())
    code, _, err = cli(["test", "--ckpt_path", str(run)])
    assert code == 0, err


@pytest.mark.parametrize("command", ["test", "unlearn", "audit", "verify"])
def test_a_rehashed_blob_is_refused_with_the_key(command, signed_run, tmp_path, monkeypatch):
    run = copy_run(signed_run, tmp_path / "r")
    _scale_final_model(run)
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    argv = {
        "test": ["test", "--ckpt_path", str(run)],
        "unlearn": ["unlearn", "--ckpt_path", str(run), "--clients", "[1]"],
        "audit": ["audit", "--ckpt_path", str(run)],
        "verify": ["cache", "verify", "--ckpt_path", str(run)],
    }[command]
    _refused(argv, "signature does not match", run)


def test_without_the_key_the_same_change_is_not_found(signed_run, tmp_path, monkeypatch):
    """What the checksums alone cannot do (the reason for the key): the changed model is read."""
    run = copy_run(signed_run, tmp_path / "r")
    _scale_final_model(run)
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    code, _, err = cli(["cache", "verify", "--ckpt_path", str(run)])
    assert code == 0, err


def test_a_wrong_key_and_an_unsigned_run_are_refused(signed_run, reference_run, tmp_path, monkeypatch):
    run = copy_run(signed_run, tmp_path / "signed")
    monkeypatch.setenv(KEY_VARIABLE, "another key")
    _refused(["test", "--ckpt_path", str(run)], "signature does not match", run)
    unsigned = copy_run(reference_run, tmp_path / "unsigned")
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    _refused(["test", "--ckpt_path", str(unsigned)], "not signed", unsigned)
    current = json.loads((run / "cache" / "CURRENT").read_text())
    del current["hmac"]  # the signature stripped
    (run / "cache" / "CURRENT").write_text(json.dumps(current))
    _refused(["audit", "--ckpt_path", str(run)], "not signed", run)
