"""Tamper matrix: change a finished run the way an unlucky or hostile user might, then run one command on it.

Two finished runs of the tiny digits config (8 clients, 3 stages) are the bases, each written once
without and once with ``FEDSHARD_MANIFEST_KEY`` set: ``fit`` (as fit left it) and ``unlearned``
(after ``unlearn --clients [2]``). Each kind copies a base, changes the copy, runs one command
in-process (``test``, ``unlearn --clients [5]``, ``audit``, ``cache verify --all`` or ``fit
--ckpt_path``) and sorts what happened into one of:

- ``refused``: exit 2, one ``error:`` line, no traceback, and no byte, mode or path under the
  case folder changed;
- ``detected``: ``audit`` recomputed the model and said FAILED (exit 1);
- ``repaired``: exit 0, the tampered path is back as it was, the deployed model has the bits of the
  same command on the untampered copy, and ``cache verify --all`` passes;
- ``unused``: exit 0, the change is still there, yet the deployed model has the bits of the same
  command on the untampered copy and ``cache verify --all`` passes;
- ``not caught``: exit 0 with other bits, or the change reached the deployed model. Allowed only for
  the kinds marked as a documented limit (a change with every checksum rewritten and no key set,
  or records removed together with a rollback); any other is a failure;
- anything else (a traceback, several lines, another status, a file changed by a refusal) fails.

Prints one line per kind and the tally; exit status 1 if any kind failed.

Usage::

    python scripts/tamper_matrix.py [--only SUBSTRING ...] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))

import torch
from _reliability_helpers import TINY, cli, copy_run, error_lines, tree_hash
from safetensors.torch import load, save

from fedshard_lightning.flcache.cache import FLCache
from fedshard_lightning.flcache.io import sha256_file
from fedshard_lightning.flcache.manifest_key import KEY_VARIABLE, pointer

KEY = "tamper-matrix key"

# -- what a kind may do to its copy -----------------------------------------------------------------

Damage = Callable[[Path, Path], None]  # (run, case folder)


def _cache(run: Path) -> FLCache:
    return FLCache(run / "cache")


def _manifest(run: Path, version: str | None = None) -> Path:
    return run / "cache" / (version or _cache(run).current()) / "manifest.json"


def _old_manifest(run: Path) -> Path:
    return _manifest(run, _cache(run).versions()[0])


def _current(run: Path) -> Path:
    return run / "cache" / "CURRENT"


def _rehash_current(run: Path, version: str) -> None:
    """CURRENT names ``version`` with its manifest's digest; a signature present is kept (no key)."""
    ptr = json.loads(_current(run).read_text())
    ptr.update(version=version, manifest_sha256=sha256_file(_manifest(run, version)))
    _current(run).write_text(json.dumps(ptr))


def _edit_manifest(edit: Callable[[dict], None]) -> Damage:
    """Edit the current manifest, then rewrite CURRENT's digest: the checksums stay valid."""

    def damage(run: Path, _: Path) -> None:
        version = _cache(run).current()
        path = _manifest(run, version)
        raw = json.loads(path.read_bytes())
        edit(raw)
        path.write_text(json.dumps(raw))
        _rehash_current(run, version)

    return damage


def _put_blob(run: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    path = _cache(run).blob_path(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def _final_row(run: Path) -> Path:
    cache = _cache(run)
    return cache.blob_path(cache.stack_digests(sorted(cache.manifest()["stacks"])[-1])[0])


def _scaled_row(stage: str | None, factor: float = 2.0) -> Damage:
    """Row 0 of a stack (default: the last stage's, the deployed model) scaled; blob, manifest, CURRENT rehashed."""

    def damage(run: Path, case: Path) -> None:
        cache = _cache(run)
        stack = stage or sorted(cache.manifest()["stacks"])[-1]
        old = load(cache.blob_path(cache.stack_digests(stack)[0]).read_bytes())
        digest = _put_blob(run, save({k: v * factor for k, v in old.items()}))
        _edit_manifest(lambda raw: raw["stacks"][stack]["delta"].__setitem__("0", digest))(run, case)

    return damage


def _file_blob(name: str) -> Callable[[Path], Path]:
    return lambda run: _cache(run).path_of(name)


def _stack_blob(stage: str, row: int) -> Callable[[Path], Path]:
    def pick(run: Path) -> Path:
        cache = _cache(run)
        return cache.blob_path(cache.stack_digests(stage)[row])

    return pick


def _snapshot_blob(run: Path) -> Path:
    cache = _cache(run)
    return cache.blob_path(cache.manifest()["stacks"]["stage_1"]["snapshot"])


def _requests_blob(run: Path) -> Path:
    raw = json.loads(_manifest(run).read_bytes())  # FLCache.manifest() gives the log's entries instead
    return _cache(run).blob_path(raw["requests"]["blobs"][0])


def _flip(pick: Callable[[Path], Path], offset: int = -5) -> Damage:
    def damage(run: Path, _: Path) -> None:
        path = pick(run)
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))

    return damage


def _truncate(pick: Callable[[Path], Path], keep: float = 0.5) -> Damage:
    def damage(run: Path, _: Path) -> None:
        path = pick(run)
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep)])

    return damage


def _remove(pick: Callable[[Path], Path]) -> Damage:
    def damage(run: Path, _: Path) -> None:
        path = pick(run)
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()

    return damage


def _write(pick: Callable[[Path], Path], text: str) -> Damage:
    def damage(run: Path, _: Path) -> None:
        path = pick(run)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    return damage


def _replace_text(pick: Callable[[Path], Path], old: str, new: str, count: int = 1) -> Damage:
    def damage(run: Path, _: Path) -> None:
        path = pick(run)
        text = path.read_text()
        assert old in text, (old, path)
        path.write_text(text.replace(old, new, count))

    return damage


def _symlink(pick: Callable[[Path], Path], copy: bool = True) -> Damage:
    """Move ``pick(run)`` outside the run (a copy of it) and leave a symbolic link to it in its place."""

    def damage(run: Path, case: Path) -> None:
        path = pick(run)
        outside = case / "outside" / path.name
        outside.parent.mkdir(exist_ok=True)
        if copy and path.is_dir():
            shutil.copytree(path, outside)
        elif copy and path.is_file():
            shutil.copy2(path, outside)
        else:
            outside.mkdir()
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(outside, target_is_directory=outside.is_dir())

    return damage


def _model(run: Path) -> Path:
    return run / "model.safetensors"


def _ckpt(run: Path) -> Path:
    return run / "model.ckpt"


def _roll_back(run: Path, _: Path) -> None:
    """CURRENT pointed back to the version before the last request, with that manifest's correct digest."""
    _rehash_current(run, _cache(run).history()[1])


def _roll_back_signed(keep: Path) -> Damage:
    """CURRENT replaced by the signed CURRENT of the base's version before the request (a kept copy)."""

    def damage(run: Path, _: Path) -> None:
        shutil.copy2(keep, _current(run))

    return damage


def _then(*damages: Damage) -> Damage:
    def damage(run: Path, case: Path) -> None:
        for d in damages:
            d(run, case)

    return damage


def _journal(run: Path) -> Path:
    return run / "unlearning" / "journal.jsonl"


def _drop_journal_line(event: str) -> Damage:
    def damage(run: Path, _: Path) -> None:
        lines = _journal(run).read_text().splitlines(keepends=True)
        _journal(run).write_text("".join(ln for ln in lines if f'"event": "{event}"' not in ln))

    return damage


# -- the commands ----------------------------------------------------------------------------------


def test(run: Path) -> list[str]:
    """``test`` on the run directory."""
    return ["test", "--ckpt_path", str(run)]


def unlearn(run: Path) -> list[str]:
    """``unlearn --clients [5]`` (a client not unlearned yet)."""
    return ["unlearn", "--ckpt_path", str(run), "--clients", "[5]"]


def unlearn_same(run: Path) -> list[str]:
    """``unlearn --clients [2]`` (the client the unlearned base unlearned)."""
    return ["unlearn", "--ckpt_path", str(run), "--clients", "[2]"]


def audit(run: Path) -> list[str]:
    """``audit`` (recomputes the model from the cache)."""
    return ["audit", "--ckpt_path", str(run)]


def verify(run: Path) -> list[str]:
    """``cache verify --all``."""
    return ["cache", "verify", "--all", "--ckpt_path", str(run)]


def resume(run: Path) -> list[str]:
    """``fit --ckpt_path RUN`` with no flags, as a user resumes."""
    return ["fit", "--ckpt_path", str(run)]


def test_model_file(run: Path) -> list[str]:
    """``test`` on ``RUN/model.safetensors`` itself."""
    return ["test", "--ckpt_path", str(run / "model.safetensors")]


# -- the kinds --------------------------------------------------------------------------------------


@dataclass
class Kind:
    """One way to tamper with a run, the command that meets it, and the base it starts from."""

    name: str
    damage: Damage
    command: Callable[[Path], list[str]]
    base: str = "fit"  # "fit" or "unlearned"
    key: bool = False  # written and read with FEDSHARD_MANIFEST_KEY set
    tampered: Callable[[Path], Path] | None = None  # the path whose repair is checked
    limit: str = ""  # a documented limit: 'not caught' is expected, and why


def kinds(signed_parent: Path) -> list[Kind]:
    """The matrix; ``signed_parent`` is the kept signed CURRENT of the version before the request."""
    K = Kind
    man, cur = _manifest, _current
    ks = [
        # -- the history of requests against CURRENT (a silent rollback of unlearning)
        K("rollback CURRENT, test", _roll_back, test, "unlearned"),
        K("rollback CURRENT, unlearn", _roll_back, unlearn, "unlearned"),
        K("rollback CURRENT, unlearn the same client", _roll_back, unlearn_same, "unlearned"),
        K("rollback CURRENT, audit", _roll_back, audit, "unlearned"),
        K("rollback CURRENT, verify --all", _roll_back, verify, "unlearned"),
        K("rollback CURRENT, resume fit", _roll_back, resume, "unlearned"),
        K(
            "rollback to a kept signed CURRENT, test",
            _roll_back_signed(signed_parent),
            test,
            "unlearned",
            True,
        ),
        K(
            "rollback CURRENT, journal removed",
            _then(_roll_back, _remove(_journal)),
            test,
            "unlearned",
        ),
        K(
            "rollback CURRENT, request reports removed",
            _then(_roll_back, _remove(lambda r: r / "unlearning" / "0001")),
            test,
            "unlearned",
        ),
        K(
            "rollback to a kept signed CURRENT, unlearning/ and reports removed",
            _then(
                _roll_back_signed(signed_parent),
                _remove(lambda r: r / "unlearning"),
                _remove(lambda r: r / "unlearn_report.json"),
            ),
            test,
            "unlearned",
            True,
            limit="a rollback that also removes every record of the request looks like a run never unlearned",
        ),
        K(
            "unlearned [2] -> [] rehashed, test",
            _edit_manifest(lambda m: m.update(unlearned=[])),
            test,
            "unlearned",
        ),
        K(
            "unlearned [2] -> [] rehashed, unlearn [2] again",
            _edit_manifest(lambda m: m.update(unlearned=[])),
            unlearn_same,
            "unlearned",
        ),
        K(
            "unlearned [2] -> [] rehashed, signed run",
            _edit_manifest(lambda m: m.update(unlearned=[])),
            test,
            "unlearned",
            True,
        ),
        K(
            "request log emptied rehashed, audit",
            _edit_manifest(lambda m: m.update(unlearned=[], requests={"blobs": []})),
            audit,
            "unlearned",
        ),
        # -- the deployed model changed with every checksum rewritten
        K(
            "final blob x2 rehashed, no key, test",
            _scaled_row(None),
            test,
            limit="without the key checksums find accidents, not intent: test deploys it, audit recomputes",
        ),
        K("final blob x2 rehashed, no key, audit", _scaled_row(None), audit),
        K("final blob x2 rehashed, key, test", _scaled_row(None), test, key=True),
        K("final blob x2 rehashed, key, unlearn", _scaled_row(None), unlearn, key=True),
        K("final blob x2 rehashed, key, verify --all", _scaled_row(None), verify, key=True),
        K("stage-1 row x2 rehashed, key, audit", _scaled_row("stage_1"), audit, key=True),
        K(
            "final blob x2, manifest and signature rewritten with another key",
            _then(_scaled_row(None), _resign("another key")),
            test,
            key=True,
        ),
        K("signature removed, key set", _edit_json(cur, lambda p: p.pop("hmac")), test, key=True),
        K("signature of another version, key set", _swap_signature, test, "unlearned", True),
        K("unsigned run read with the key set", _unsign, test, key=True),
        # -- symbolic links where the commands write
        K("logs/ symlinked, test", _symlink(lambda r: r / "logs"), test),
        K("logs/ symlinked, unlearn", _symlink(lambda r: r / "logs"), unlearn),
        K("logs/ symlinked, audit", _symlink(lambda r: r / "logs"), audit),
        K("logs/test-1 symlinked, test", _symlink(lambda r: r / "logs" / "test-1", copy=False), test),
        K("cache/ symlinked, unlearn", _symlink(lambda r: r / "cache"), unlearn),
        K("cache/blobs/ symlinked, unlearn", _symlink(lambda r: r / "cache" / "blobs"), unlearn),
        K("cache/blobs/ symlinked, test", _symlink(lambda r: r / "cache" / "blobs"), test),
        K("a blob fan-out folder symlinked, unlearn", _symlink(lambda r: _final_row(r).parent), unlearn),
        K("unlearning/ symlinked, unlearn", _symlink(lambda r: r / "unlearning"), unlearn, "unlearned"),
        K("unlearning/journal.jsonl symlinked, unlearn", _symlink(_journal), unlearn, "unlearned"),
        K("model.safetensors symlinked, test", _symlink(_model), test, tampered=_model),
        K("model.safetensors symlinked, unlearn", _symlink(_model), unlearn, tampered=_model),
        K("model.ckpt symlinked, test", _symlink(_ckpt), test, tampered=_ckpt),
        K("model.ckpt symlinked, unlearn", _symlink(_ckpt), unlearn, tampered=_ckpt),
        K(
            "unlearn_report.json symlinked, unlearn",
            _symlink(lambda r: r / "unlearn_report.json"),
            unlearn,
            "unlearned",
        ),
        K("metrics.json symlinked, resume fit", _symlink(lambda r: r / "metrics.json"), resume),
        K("tensorboard/ symlinked, test", _symlink(lambda r: r / "tensorboard", copy=False), test),
        K("wandb_files/ symlinked, audit", _symlink(lambda r: r / "wandb_files", copy=False), audit),
        K("a version folder symlinked, verify --all", _symlink(lambda r: man(r).parent), verify),
        # -- one flipped byte in each kind of blob and record
        K("flip theta0 blob, unlearn", _flip(_file_blob("theta0.safetensors")), unlearn),
        K("flip structure blob, unlearn", _flip(_file_blob("structure_2.safetensors")), unlearn),
        K("flip client_sizes blob, unlearn", _flip(_file_blob("client_sizes.safetensors")), unlearn),
        K("flip client_sizes blob, test", _flip(_file_blob("client_sizes.safetensors")), test),
        K("flip stage-1 snapshot blob, unlearn", _flip(_snapshot_blob), unlearn),
        K("flip stage-2 row blob, audit", _flip(_stack_blob("stage_2", 0)), audit),
        K("flip final row blob, test", _flip(_final_row), test),
        K("flip request log blob, test", _flip(_requests_blob), test, "unlearned"),
        K("flip current manifest, unlearn", _flip(man, offset=40), unlearn),
        K("flip old manifest, verify --all", _flip(_old_manifest, offset=60), verify),
        K("flip CURRENT, test", _flip(cur, offset=-4), test),
        K("flip FINGERPRINT, resume fit", _flip(lambda r: r / "cache" / "FINGERPRINT", offset=10), resume),
        K(
            "flip model.safetensors, test",
            _flip(lambda r: r / "model.safetensors"),
            test,
            tampered=lambda r: r / "model.safetensors",
        ),
        K("flip model.safetensors, test the file", _flip(lambda r: r / "model.safetensors"), test_model_file),
        K(
            "flip model.ckpt, test",
            _flip(lambda r: r / "model.ckpt"),
            test,
            tampered=lambda r: r / "model.ckpt",
        ),
        # -- truncated files
        K("truncate theta0 blob, unlearn", _truncate(_file_blob("theta0.safetensors")), unlearn),
        K("truncate final row blob, test", _truncate(_final_row), test),
        K("truncate current manifest, audit", _truncate(man), audit),
        K("truncate CURRENT, unlearn", _truncate(cur), unlearn),
        K("truncate FINGERPRINT, resume fit", _truncate(lambda r: r / "cache" / "FINGERPRINT"), resume),
        K("truncate config.yaml, unlearn", _truncate_config, unlearn),
        K("truncate journal.jsonl, test", _truncate(_journal, keep=0.7), test, "unlearned"),
        K(
            "truncate request report, test",
            _truncate(lambda r: r / "unlearning" / "0001" / "report.json"),
            test,
            "unlearned",
        ),
        K(
            "truncate model.safetensors, test",
            _truncate(lambda r: r / "model.safetensors"),
            test,
            tampered=lambda r: r / "model.safetensors",
        ),
        K("truncate model.ckpt, unlearn", _truncate(lambda r: r / "model.ckpt"), unlearn),
        # -- missing files
        K("missing old manifest, verify --all", _remove(_old_manifest), verify),
        K("missing old manifest, unlearn", _remove(_old_manifest), unlearn),
        K("missing old manifest, test", _remove(_old_manifest), test),
        K("missing current manifest, test", _remove(man), test),
        K("missing final row blob, test", _remove(_final_row), test),
        K("missing CURRENT, unlearn", _remove(cur), unlearn),
        K("missing FINGERPRINT, unlearn", _remove(lambda r: r / "cache" / "FINGERPRINT"), unlearn),
        K("missing config.yaml, unlearn", _remove(lambda r: r / "config.yaml"), unlearn),
        K("missing journal.jsonl, test", _remove(_journal), test, "unlearned"),
        K("missing request report, test", _remove(lambda r: r / "unlearning" / "0001"), test, "unlearned"),
        K(
            "missing model.safetensors, test",
            _remove(lambda r: r / "model.safetensors"),
            test,
            tampered=lambda r: r / "model.safetensors",
        ),
        K(
            "missing model.ckpt, test",
            _remove(lambda r: r / "model.ckpt"),
            test,
            tampered=lambda r: r / "model.ckpt",
        ),
        # -- journal and report edits
        K(
            "journal clients [2] -> [5] (both lines), test",
            _replace_text(_journal, '"clients": [2]', '"clients": [5]', count=-1),
            test,
            "unlearned",
        ),
        K(
            "journal started line clients [2] -> [5], test",
            _replace_text(_journal, '"clients": [2]', '"clients": [5]'),
            test,
            "unlearned",
        ),
        K("journal committed line removed, test", _drop_journal_line("committed"), test, "unlearned"),
        K("journal started line removed, test", _drop_journal_line("started"), test, "unlearned"),
        K(
            "journal: a second request recorded, test",
            _append_journal({"event": "committed", "request": 2, "clients": [6]}),
            test,
            "unlearned",
        ),
        K(
            "request report clients [2] -> [6], test",
            _replace_text(
                lambda r: r / "unlearning" / "0001" / "report.json", "[\n    2\n  ]", "[\n    6\n  ]"
            ),
            test,
            "unlearned",
        ),
        K(
            "a forged request report, test",
            _copy_report("0002"),
            test,
            "unlearned",
        ),
        # -- fingerprint edits
        K("FINGERPRINT edited, resume fit", _edit_fingerprint, resume),
        K("FINGERPRINT edited, unlearn", _edit_fingerprint, unlearn),
        K(
            "manifest fingerprint edited rehashed, unlearn",
            _edit_manifest(lambda m: m.update(fingerprint="0" * 32)),
            unlearn,
        ),
        # -- config.yaml edits
        K("config.yaml lr changed, unlearn", _config_edit("lr: 0.05", "lr: 0.5"), unlearn),
        K(
            "config.yaml seed changed, unlearn",
            _config_edit("seed_everything: 0", "seed_everything: 7"),
            unlearn,
        ),
        K("config.yaml num_clients changed, test", _config_edit("num_clients: 8", "num_clients: 9"), test),
        K("config.yaml lr changed, resume fit", _config_edit("lr: 0.05", "lr: 0.5"), resume),
        K("config.yaml class_path to a run-folder module, test", _config_module, test),
        K("config.yaml unknown key, test", _append_config("bogus_key: 1\n"), test),
        K("config.yaml comment added, unlearn", _append_config("# a comment\n"), unlearn),
        # -- extra files
        K("extra file in the run folder, unlearn", _write(lambda r: r / "notes.txt", "hello\n"), unlearn),
        K("extra file in cache/, unlearn", _write(lambda r: r / "cache" / "notes.txt", "hello\n"), unlearn),
        K("extra blob in cache/blobs/, verify --all", _extra_blob, verify),
        K(
            "leftover temporary version folder, unlearn",
            _write(lambda r: r / "cache" / ".0009-unlearn-0009.tmp-999999" / "manifest.json", "{"),
            unlearn,
        ),
        K("extra version folder (not on the history), test", _extra_version, test),
        K("extra version folder (not on the history), verify --all", _extra_version, verify),
        K(
            "extra file in unlearning/, unlearn",
            _write(lambda r: r / "unlearning" / "notes.txt", "x\n"),
            unlearn,
            "unlearned",
        ),
        K("extra module beside config.yaml, test", _write(lambda r: r / "evilmod.py", _EVIL), test),
    ]
    return ks


_EVIL = (
    'from pathlib import Path\nPath(__file__).with_name("EXECUTED").write_text("ran")\nclass Net:\n    pass\n'
)


def _edit_json(pick: Callable[[Path], Path], edit: Callable[[dict], None]) -> Damage:
    def damage(run: Path, _: Path) -> None:
        raw = json.loads(pick(run).read_text())
        edit(raw)
        pick(run).write_text(json.dumps(raw))

    return damage


def _resign(key: str) -> Damage:
    """Sign CURRENT with another key (the tamperer's own)."""

    def damage(run: Path, _: Path) -> None:
        ptr = json.loads(_current(run).read_text())
        with _key(key):
            _current(run).write_text(json.dumps(pointer(ptr["version"], ptr["manifest_sha256"])))

    return damage


def _swap_signature(run: Path, _: Path) -> None:
    """CURRENT names the version before the request with the signature of the current one."""
    ptr = json.loads(_current(run).read_text())
    parent = _cache(run).history()[1]
    ptr.update(version=parent, manifest_sha256=sha256_file(_manifest(run, parent)))
    _current(run).write_text(json.dumps(ptr))


def _unsign(run: Path, _: Path) -> None:
    ptr = json.loads(_current(run).read_text())
    ptr.pop("hmac", None)
    _current(run).write_text(json.dumps(ptr))


def _append_journal(entry: dict) -> Damage:
    def damage(run: Path, _: Path) -> None:
        with open(_journal(run), "a") as f:
            f.write(json.dumps(entry) + "\n")

    return damage


def _copy_report(number: str) -> Damage:
    def damage(run: Path, _: Path) -> None:
        src = run / "unlearning" / "0001"
        dst = run / "unlearning" / number
        shutil.copytree(src, dst)
        path = dst / "report.json"
        raw = json.loads(path.read_text())
        raw["request"] = int(number)
        path.write_text(json.dumps(raw, indent=2))

    return damage


def _edit_fingerprint(run: Path, _: Path) -> None:
    """Another setting (local_steps 2 -> 3) recorded in cache/FINGERPRINT."""
    path = run / "cache" / "FINGERPRINT"
    text = path.read_text()
    assert '"local_steps": 2' in text
    path.write_text(text.replace('"local_steps": 2', '"local_steps": 3', 1))


def _config_edit(old: str, new: str) -> Damage:
    return _replace_text(lambda r: r / "config.yaml", old, new)


def _append_config(text: str) -> Damage:
    def damage(run: Path, _: Path) -> None:
        path = run / "config.yaml"
        path.write_text(path.read_text() + text)

    return damage


def _truncate_config(run: Path, _: Path) -> None:
    path = run / "config.yaml"
    data = path.read_bytes()
    marker = b"local_bn: 'o"  # inside a quoted value: a YAML error, whatever the paths' lengths
    path.write_bytes(data[: data.index(marker) + len(marker)])


def _config_module(run: Path, case: Path) -> None:
    import yaml

    path = run / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["model"] = {"class_path": "evilmod.Net"}
    path.write_text(yaml.safe_dump(config))
    (run / "evilmod.py").write_text(_EVIL)


def _extra_blob(run: Path, _: Path) -> None:
    _put_blob(run, b"an unreferenced blob\n")


def _extra_version(run: Path, _: Path) -> None:
    """A committed-looking version folder that no CURRENT and no parent names (a copy of the current one)."""
    cache = _cache(run)
    src = _manifest(run)
    dst = run / "cache" / "0009-stage-9" / "manifest.json"
    dst.parent.mkdir()
    shutil.copy2(src, dst)
    assert "0009-stage-9" in cache.versions()


# -- running ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _key(value: str | None) -> Iterator[None]:
    old = os.environ.get(KEY_VARIABLE)
    if value is None:
        os.environ.pop(KEY_VARIABLE, None)
    else:
        os.environ[KEY_VARIABLE] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(KEY_VARIABLE, None)
        else:
            os.environ[KEY_VARIABLE] = old


def _must(args: list[str]) -> None:
    code, _, err = cli(args)
    if code != 0:
        raise SystemExit(f"{' '.join(args[:1])} failed while building the bases:\n{err}")


@dataclass
class Bases:
    """The base runs (keyed by (base, signed)) and the kept signed CURRENT before the request."""

    runs: dict[tuple[str, bool], Path]
    signed_parent: Path


def build_bases(root: Path) -> Bases:
    """The tiny fit and its ``unlearn --clients [2]``, each without and with the key."""
    runs = {}
    for signed in (False, True):
        with _key(KEY if signed else None):
            name = "signed" if signed else "plain"
            _must(["fit", *TINY, "--trainer.default_root_dir", str(root), "--trainer.run_name", name])
            runs["fit", signed] = root / name
            unlearned = copy_run(root / name, root / f"{name}_unlearned")
            if signed:
                keep = root / "signed_CURRENT_before_the_request"
                shutil.copy2(_current(unlearned), keep)
            _must(["unlearn", "--ckpt_path", str(unlearned), "--clients", "[2]"])
            runs["unlearned", signed] = unlearned
    return Bases(runs, keep)


@dataclass
class Result:
    """What one kind came to."""

    kind: Kind
    outcome: str  # refused | detected | repaired | unused | not caught | FAILED
    detail: str
    seconds: float

    @property
    def ok(self) -> bool:
        """Refused, detected, repaired or unused (a documented limit may also be not caught)."""
        if self.kind.limit:
            return self.outcome in ("refused", "detected", "repaired", "unused", "not caught")
        return self.outcome in ("refused", "detected", "repaired", "unused")


_REFERENCE: dict[tuple[str, bool, str], tuple[int, bytes]] = {}


def _deployed(run: Path) -> bytes:
    path = run / "model.safetensors"
    return path.read_bytes() if path.is_file() and not path.is_symlink() else b""


def _reference(bases: Bases, kind: Kind, work: Path) -> tuple[int, bytes]:
    """The same command on an untampered copy: its exit status and deployed model."""
    key = (kind.base, kind.key, kind.command.__name__)
    if key not in _REFERENCE:
        run = copy_run(bases.runs[kind.base, kind.key], work / f"reference-{len(_REFERENCE)}")
        code, _, _ = cli(kind.command(run))
        _REFERENCE[key] = (code, _deployed(run))
        shutil.rmtree(run)
    return _REFERENCE[key]


def _state(path: Path) -> bytes | None:
    if path.is_symlink():
        return b"link:" + os.readlink(path).encode()
    return path.read_bytes() if path.is_file() else None


def run_kind(kind: Kind, bases: Bases, work: Path) -> Result:
    """Copy the base, tamper, run the command, sort the outcome."""
    t = time.monotonic()
    case = work / "case"
    shutil.rmtree(case, ignore_errors=True)
    case.mkdir(parents=True)
    with _key(KEY if kind.key else None):
        ref_code, ref_model = _reference(bases, kind, work)
        run = copy_run(bases.runs[kind.base, kind.key], case / "run")
        original = _state(kind.tampered(run)) if kind.tampered else None
        kind.damage(run, case)
        before = tree_hash(case)
        try:
            code, out, err = cli(kind.command(run))
        except Exception as e:  # what the CLI would print as a traceback
            return Result(kind, "FAILED", f"traceback: {type(e).__name__}: {e}", time.monotonic() - t)
        lines = [ln for ln in error_lines(err) if not ln.startswith("note: ")]
        if "Traceback" in err:
            return Result(kind, "FAILED", f"traceback: {lines[-1] if lines else ''}", time.monotonic() - t)
        if (run / "EXECUTED").exists():
            return Result(kind, "FAILED", "a module of the run folder ran", time.monotonic() - t)
        if kind.command is audit and code == 1 and "FAILED" in out:
            return Result(
                kind, "detected", "audit: FAILED (exit 1), the recomputed model differs", time.monotonic() - t
            )
        if code != 0:
            if code == 2 and len(lines) == 1 and lines[0].startswith("error: "):
                if tree_hash(case) != before:
                    return Result(
                        kind, "FAILED", f"refused but changed files: {lines[0]}", time.monotonic() - t
                    )
                return Result(kind, "refused", _short(lines[0], run), time.monotonic() - t)
            return Result(kind, "FAILED", f"exit {code}: {' | '.join(lines)[:300]}", time.monotonic() - t)
        model = _deployed(run)
        vcode, _, verr = cli(verify(run))
        same = code == ref_code and model == ref_model
        if not same or vcode != 0:
            what = (
                "other bits than the untampered run"
                if not same
                else f"then verify --all: {verr.strip()[-200:]}"
            )
            return Result(kind, "not caught", what, time.monotonic() - t)
        if kind.tampered and _state(kind.tampered(run)) == original:
            return Result(kind, "repaired", "same bits as the untampered run", time.monotonic() - t)
        return Result(kind, "unused", "same bits as the untampered run", time.monotonic() - t)


def _short(line: str, run: Path) -> str:
    line = line.replace(str(run), "RUN").replace(str(run.parent), "CASE")
    return line if len(line) <= 160 else line[:157] + "..."


def main(argv: list[str] | None = None) -> int:
    """Run the matrix (or the kinds whose name contains one of ``--only``) and print the tally."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="*", default=None, help="run the kinds whose name contains one of these"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="folder for the runs (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    sys.argv = sys.argv[:1]  # the commands run in-process: LightningCLI must not see this script's flags
    logging.getLogger("lightning.fabric.utilities.seed").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="tamper-matrix-"))
    root.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    bases = build_bases(root / "bases")
    selected = [k for k in kinds(bases.signed_parent) if not args.only or any(s in k.name for s in args.only)]
    results = []
    for kind in selected:
        r = run_kind(kind, bases, root / "work")
        results.append(r)
        mark = " (documented limit)" if kind.limit and r.outcome == "not caught" else ""
        print(f"{r.outcome:10s} {r.seconds:5.1f}s  {kind.name:62s}  {r.detail}{mark}", flush=True)
    tally = collections.Counter(r.outcome for r in results)
    limits = [r for r in results if r.kind.limit]
    counted = [r for r in results if not r.kind.limit]
    print("\ntally")
    for outcome, n in sorted(tally.items()):
        print(f"  {n:3d}  {outcome}")
    for r in limits:
        print(f"  limit: {r.kind.name}: {r.outcome} ({r.kind.limit})")
    good = sum(r.ok for r in counted)
    print(
        f"figures: tamper kinds {len(counted)} (+{len(limits)} documented limits), refused, repaired or unused "
        f"{good}/{len(counted)}, failed {sum(not r.ok for r in results)}; wall time {time.monotonic() - t:.0f}s"
    )
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
