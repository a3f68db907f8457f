"""Integrity beyond one version: the manifest chain, tensor schemas, the deployed model's hash, DDP configs."""

from __future__ import annotations

import json

import yaml
from _reliability_helpers import cli, copy_run, error_lines
from safetensors import safe_open

from fedshard_lightning.flcache import FLCache
from fedshard_lightning.flcache.schema import tensors_sha256
from fedshard_lightning.run.deployed import HASH_KEY


def _unlearned(reference_run, tmp_path):
    run = copy_run(reference_run, tmp_path / "run")
    code, _, err = cli(
        ["unlearn", "--config", str(run / "config.yaml"), "--ckpt_path", str(run), "--clients", "[2]"]
    )
    assert code == 0, err
    return run


def test_verify_all_finds_a_byte_flipped_in_an_old_version_only(reference_run, tmp_path):
    run = _unlearned(reference_run, tmp_path)
    cache = FLCache(run / "cache")
    old, new = cache.versions()[-2], cache.current()
    old_rows = set(cache.stack_digests("stage_1", old))
    only_old = sorted(old_rows - set(cache.stack_digests("stage_1", new)))
    assert only_old, "the unlearning retrained a stage-1 shard: its old model is in the old version only"
    blob = cache.blob_path(only_old[0])
    data = bytearray(blob.read_bytes())
    data[-3] ^= 0x10
    blob.write_bytes(bytes(data))
    code, out, err = cli(["cache", "verify", "--ckpt_path", str(run)])
    assert code == 0 and "1 version intact" in out, err  # the current version is intact
    code, _, err = cli(["cache", "verify", "--all", "--ckpt_path", str(run)])
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and str(blob) in lines[0], err


def test_every_manifest_names_its_parent_and_verify_all_walks_the_chain(reference_run, tmp_path):
    run = _unlearned(reference_run, tmp_path)
    cache = FLCache(run / "cache")
    assert cache.history() == list(reversed(cache.versions()))
    code, out, err = cli(["cache", "verify", "--all", "--ckpt_path", str(run)])
    assert code == 0 and f"{len(cache.versions())} versions intact" in out, err
    first = run / "cache" / cache.versions()[0] / "manifest.json"
    raw = json.loads(first.read_bytes())
    raw["client_steps"] += 1  # valid JSON, plausible content: only the chain can tell
    first.write_text(json.dumps(raw))
    code, _, err = cli(["cache", "verify", "--all", "--ckpt_path", str(run)])
    assert code == 2 and str(first) in error_lines(err)[0], err


def test_schemas_are_recorded_and_match_the_model(reference_run):
    cache = FLCache(reference_run / "cache")
    manifest = cache.manifest()
    model = json.loads((reference_run / "cache" / "FINGERPRINT").read_text())["body"]["params"]
    theta0 = manifest["schemas"]["files"]["theta0.safetensors"]
    assert {k: v[1] for k, v in theta0.items() if k in model} == model
    for name in manifest["stacks"]:
        assert manifest["schemas"]["stacks"][name] == theta0  # each row is a model


def test_deployed_model_carries_its_hash_and_a_drifted_one_is_rewritten_with_a_note(reference_run, tmp_path):
    run = copy_run(reference_run, tmp_path / "run")
    path = run / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        assert f.metadata()[HASH_KEY] == tensors_sha256(tensors)
    good = path.read_bytes()
    data = bytearray(good)
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))
    code, out, err = cli(["audit", "--config", str(run / "config.yaml"), "--ckpt_path", str(run)])
    assert code == 0 and "note:" in out and "rewrote it from the cache" in out, err
    assert path.read_bytes() == good


def test_a_ddp_config_does_not_start_two_processes_for_audit(reference_run, tmp_path):
    run = copy_run(reference_run, tmp_path / "run")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["trainer"].update(devices=2, strategy="ddp")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    code, out, err = cli(["audit", "--ckpt_path", str(run)])  # two processes would re-launch this test
    notes = [line for line in error_lines(err) if line.startswith("note:")]
    assert code == 0 and "audit PASSED" in out, err
    assert len(notes) == 1 and "devices=2" in notes[0] and "one process" in notes[0], err
