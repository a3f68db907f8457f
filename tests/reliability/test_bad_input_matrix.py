"""The bad-input and tamper matrix: every case is one line on stderr, a non-zero exit, and the run untouched.

One finished tiny run (the session's ``reference_run``) is copied per case; the case damages its
copy (or not), runs one command in-process through ``cli.main``, and checks: no traceback,
exactly one non-empty stderr line (besides Lightning's 'Seed set to' line and a DDP note) that
names the offending field, path or client, the expected non-zero exit status, and the tree hash
(SHA-256 over every path, mode and byte, symbolic links by their target) of the case folder
unchanged. Damage that keeps checksums valid (a tensor swapped for one of another shape or dtype
with the manifest and CURRENT updated) must be refused too. ``test_bad_inputs.py`` holds the
older table (data directories, config values), checked the same way; both together are counted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from _reliability_helpers import TINY, cli, copy_run, error_lines, tree_hash
from safetensors.torch import load, load_file, save, save_file
from test_bad_inputs import CASES as OLD_CASES

from fedshard_lightning.flcache import FLCache, sha256_file
from fedshard_lightning.flcache.schema import schema_of

# -- damage: each takes the case's run copy (and the case folder) -------------------------------


def _cache(run: Path) -> FLCache:
    return FLCache(run / "cache")


def _manifest_path(run: Path, version: str | None = None) -> Path:
    return run / "cache" / (version or _cache(run).current()) / "manifest.json"


def _rewrite_manifest(run: Path, edit: Callable[[dict], None]) -> None:
    """Edit the current manifest, then update CURRENT's checksum: the checksums stay valid."""
    cache = _cache(run)
    version = cache.current()
    path = _manifest_path(run, version)
    raw = json.loads(path.read_bytes())
    edit(raw)
    path.write_text(json.dumps(raw))
    (run / "cache" / "CURRENT").write_text(
        json.dumps({"version": version, "manifest_sha256": sha256_file(path)})
    )


def _put_blob(run: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    path = _cache(run).blob_path(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def _swap_file(name: str, make: Callable[[dict], dict], schema: bool = False) -> Callable[[Path, Path], None]:
    """Replace file ``name`` of the current version by ``make(old tensors)``; checksums updated."""

    def damage(run: Path, _: Path) -> None:
        old = _cache(run).tensors(name)
        new = make(old)
        digest = _put_blob(run, save(new))

        def edit(raw: dict) -> None:
            raw["files"][name] = digest
            if schema:
                raw["schemas"]["files"][name] = schema_of(new)

        _rewrite_manifest(run, edit)

    return damage


def _swap_row(stack: str, row: int, make: Callable[[dict], dict], schema: bool = False):
    """Replace row ``row`` of a stack by ``make(old row)``; the manifest's delta and CURRENT updated."""

    def damage(run: Path, _: Path) -> None:
        cache = _cache(run)
        digest = cache.stack_digests(stack)[row]
        new = make(load(cache.blob_path(digest).read_bytes()))
        fresh = _put_blob(run, save(new))

        def edit(raw: dict) -> None:
            raw["stacks"][stack]["delta"][str(row)] = fresh
            if schema:
                raw["schemas"]["stacks"][stack] = schema_of(new)

        _rewrite_manifest(run, edit)

    return damage


def _first_row_blob(run: Path) -> Path:
    cache = _cache(run)
    return cache.blob_path(cache.stack_digests("stage_2")[0])


def _theta0_blob(run: Path) -> Path:
    return _cache(run).path_of("theta0.safetensors")


def _flip(pick: Callable[[Path], Path], offset: int = -5) -> Callable[[Path, Path], None]:
    def damage(run: Path, _: Path) -> None:
        path = pick(run)
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))

    return damage


def _truncate(pick: Callable[[Path], Path], keep: float = 0.5) -> Callable[[Path, Path], None]:
    def damage(run: Path, _: Path) -> None:
        path = pick(run)
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep)])

    return damage


def _truncate_inside(pick: Callable[[Path], Path], marker: bytes) -> Callable[[Path, Path], None]:
    """Cut the file just after ``marker``'s first occurrence, wherever the file's paths put it."""

    def damage(run: Path, _: Path) -> None:
        path = pick(run)
        data = path.read_bytes()
        path.write_bytes(data[: data.index(marker) + len(marker)])

    return damage


def _remove(pick: Callable[[Path], Path]) -> Callable[[Path, Path], None]:
    def damage(run: Path, _: Path) -> None:
        path = pick(run)
        shutil.rmtree(path) if path.is_dir() else path.unlink()

    return damage


def _symlink(pick: Callable[[Path], Path], target_is_dir: bool = False) -> Callable[[Path, Path], None]:
    """Make ``pick(run)`` a symbolic link to a file (or folder) outside the run."""

    def damage(run: Path, case: Path) -> None:
        path = pick(run)
        outside = case / ("outside_dir" if target_is_dir else "outside.txt")
        if target_is_dir:
            outside.mkdir()
            (outside / "keep.txt").write_text("outside\n")
        else:
            outside.write_text("a file outside the run\n")
        if path.exists():
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(outside, target_is_directory=target_is_dir)

    return damage


def _model_file(make: Callable[[dict], dict]) -> Callable[[Path, Path], None]:
    def damage(run: Path, _: Path) -> None:
        path = run / "model.safetensors"
        save_file(make(load_file(str(path))), str(path))

    return damage


def _before_first_commit(run: Path, _: Path) -> None:
    """What a fit killed after recording its fingerprint, before its first commit, leaves."""
    for p in (run / "cache").iterdir():
        if p.name != "FINGERPRINT":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for name in ("model.safetensors", "metrics.json", "numerics.json", "tree.txt"):
        (run / name).unlink(missing_ok=True)


def _damaged_fingerprint(run: Path, case: Path) -> None:
    _before_first_commit(run, case)
    (run / "cache" / "FINGERPRINT").write_text("{")


def _only_model(run: Path, _: Path) -> None:
    """A folder that holds a model.safetensors and nothing else of a run."""
    for p in list(run.iterdir()):
        if p.name != "model.safetensors":
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _nothing_recorded(*cache_files: str) -> Callable[[Path, Path], None]:
    """What a fit killed before it recorded its settings leaves: ``cache/`` (with cut-short writes), ``logs/``."""

    def damage(run: Path, _: Path) -> None:
        for p in list(run.iterdir()):
            if p.name != "logs":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        (run / "cache").mkdir()
        for name in cache_files:
            (run / "cache" / name).write_text('{"finger')

    return damage


def _roll_back(run: Path, _: Path) -> None:
    """Point CURRENT at the version before the last request, with that manifest's correct checksum."""
    parent = _cache(run).history()[1]
    (run / "cache" / "CURRENT").write_text(
        json.dumps({"version": parent, "manifest_sha256": sha256_file(_manifest_path(run, parent))})
    )


def _then(*damages: Callable[[Path, Path], None]) -> Callable[[Path, Path], None]:
    def damage(run: Path, case: Path) -> None:
        for d in damages:
            d(run, case)

    return damage


def _touch(name: str) -> Callable[[Path, Path], None]:
    def damage(run: Path, _: Path) -> None:
        (run / name).write_text("a file where a folder belongs\n")

    return damage


def _forget_unlearned(run: Path, _: Path) -> None:
    """Edit the current manifest's ``unlearned`` list from [2] to [] (CURRENT rehashed)."""
    _rewrite_manifest(run, lambda raw: raw.update(unlearned=[]))


def _forget_request_log(run: Path, _: Path) -> None:
    _rewrite_manifest(run, lambda raw: raw.update(unlearned=[], requests={"blobs": []}))


def _journal_other_clients(run: Path, _: Path) -> None:
    path = run / "unlearning" / "journal.jsonl"
    path.write_text(path.read_text().replace('"clients": [2]', '"clients": [5]'))


def _old_version(run: Path) -> Path:
    return _manifest_path(run, _cache(run).versions()[0])


def _fill_tmpfs(run: Path, case: Path) -> None:
    """Fill the tmpfs the case lives on (the run is already copied there)."""
    with open(case / "filler", "wb") as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * (1 << 16))
            f.flush()


def _dtype(to: torch.dtype) -> Callable[[dict], dict]:
    return lambda t: {k: v.to(to) for k, v in t.items()}


def _reshape(t: dict) -> dict:
    k = sorted(t)[0]
    return {**t, k: t[k].reshape(-1)[:-1].clone()}


def _extra(t: dict) -> dict:
    return {**t, "intruder": torch.zeros(3)}


# -- the cases ---------------------------------------------------------------------------------


@dataclass
class Case:
    """One bad input: the command (argv builder), damage done first, what the line names, the exit status."""

    argv: Callable[[Path, Path], list[str]]
    needle: str | Callable[[Path, Path], str]
    damage: Callable[[Path, Path], None] | None = None
    code: int = 2
    patch: tuple[str, int] | None = None  # (operation, errno): make that write fail
    tmpfs: bool = False
    unlearned: bool = False  # start from the run after `unlearn --clients [2]`
    marks: list = field(default_factory=list)


def on(command: str, *extra: str, target: Callable[[Path], Path] | None = None):
    def argv(run: Path, _: Path) -> list[str]:
        path = target(run) if target else run
        return [command, "--config", str(run / "config.yaml"), "--ckpt_path", str(path), *extra]

    return argv


def bare(command: str, *extra: str, target: Callable[[Path, Path], Path]):
    """A command whose ``--ckpt_path`` has no config.yaml beside it (the tiny config is given instead)."""
    return lambda run, case: [command, *TINY, "--ckpt_path", str(target(run, case)), *extra]


def fit_new(*extra: str):
    return lambda run, case: ["fit", *TINY, "--trainer.default_root_dir", str(case / "runs"), *extra]


def unlearn(clients: str, *extra: str):
    return on("unlearn", "--clients", clients, *extra)


def cache_cmd(*extra: str):
    return lambda run, _: ["cache", *extra, "--ckpt_path", str(run)]


def fit_config(text: str, *extra: str):
    """A new fit with ``--config`` a file of ``text`` (written into the case folder)."""

    def argv(run: Path, case: Path) -> list[str]:
        path = case / "bad.yaml"
        path.write_text(text)
        return ["fit", *TINY, "--config", str(path), "--trainer.default_root_dir", str(case / "runs"), *extra]

    return argv


def _run_config(text: str) -> Callable[[Path, Path], None]:
    def damage(run: Path, _: Path) -> None:
        path = run / "config.yaml"
        path.write_text(path.read_text() + text)

    return damage


_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(9)
)
_DEEP = "model:\n  init_args:\n    hidden: " + "[" * 5000 + "]" * 5000 + "\n"

U = unlearn("[1]")
STACK_ROW = "row 0 of stack stage_2"

CASES: dict[str, Case] = {
    # -- numeric ranges (refused at parse or construction time)
    "memory_budget_negative": Case(fit_new("--trainer.memory_budget_mb", "-1"), "memory_budget_mb"),
    "memory_budget_zero": Case(fit_new("--trainer.memory_budget_mb", "0"), "memory_budget_mb"),
    "memory_budget_inf": Case(fit_new("--trainer.memory_budget_mb", "inf"), "memory_budget_mb"),
    "max_chunk_zero": Case(fit_new("--trainer.max_chunk_clients", "0"), "max_chunk_clients"),
    "max_chunk_negative": Case(fit_new("--trainer.max_chunk_clients", "-3"), "max_chunk_clients"),
    "num_threads_zero": Case(fit_new("--trainer.num_threads", "0"), "num_threads"),
    "num_threads_negative_unlearn": Case(unlearn("[1]", "--trainer.num_threads", "-1"), "num_threads"),
    "test_fraction_above_1": Case(fit_new("--data.test_fraction", "1.5"), "test_fraction"),
    "test_fraction_zero": Case(fit_new("--data.test_fraction", "0"), "test_fraction"),
    "eval_every_negative": Case(fit_new("--trainer.eval_every_n_rounds", "-1"), "eval_every_n_rounds"),
    "tolerance_negative": Case(on("audit", "--tolerance", "-1"), "tolerance"),
    "tolerance_nan": Case(on("audit", "--tolerance", "nan"), "tolerance"),
    "tolerance_inf": Case(on("audit", "--tolerance", "inf"), "tolerance"),
    "gc_keep_zero": Case(cache_cmd("gc", "--keep", "0"), "--keep"),
    "gc_keep_negative": Case(cache_cmd("gc", "--keep", "-2"), "--keep"),
    "num_clients_negative": Case(fit_new("--data.num_clients", "-4"), "num_clients"),
    "mixed_precision": Case(fit_new("--trainer.precision", "16-mixed"), "precision"),
    # -- bounded inputs: YAML expansion, nesting, duplicate keys; devices, threads, numbers in range
    "yaml_billion_laughs": Case(fit_config(_LAUGHS), "billion laughs"),
    "yaml_nested_5000": Case(fit_config(_DEEP), "nested deeper"),
    "yaml_nested_mappings": Case(
        fit_config("model:\n" + "".join("  " * i + "k:\n" for i in range(1, 90))), "nested deeper"
    ),
    "yaml_duplicate_key": Case(fit_config("model:\n  init_args:\n    lr: 0.1\n    lr: 0.5\n"), "'lr'"),
    "yaml_duplicate_top_key": Case(fit_config("seed_everything: 1\nseed_everything: 2\n"), "seed_everything"),
    "yaml_recursive_alias": Case(fit_config("model: &m {init_args: {hidden: [*m]}}\n"), "alias"),
    "run_config_duplicate_key": Case(U, "seed_everything", _run_config("seed_everything: 3\n")),
    "run_config_billion_laughs": Case(U, "billion laughs", _run_config(_LAUGHS)),
    "flag_value_nested_5000": Case(fit_new("--model.init_args.hidden", "[" * 5000 + "]" * 5000), "nested"),
    "devices_1000": Case(fit_new("--trainer.devices", "1000"), "devices"),
    "devices_1000_string": Case(fit_new("--trainer.devices", "'1000'"), "devices"),
    "devices_1000_unlearn": Case(unlearn("[1]", "--trainer.devices", "1000"), "devices"),
    "num_threads_100000": Case(fit_new("--trainer.num_threads", "100000"), "num_threads"),
    "num_threads_100000_audit": Case(on("audit", "--trainer.num_threads", "100000"), "num_threads"),
    "lr_1e300": Case(fit_new("--model.lr", "1e300"), "model.lr"),
    "lr_1e400": Case(fit_new("--model.lr", "1e400"), "model.lr"),
    "lr_minus_inf": Case(fit_new("--model.lr", "-inf"), "model.lr"),
    "lr_minus_small": Case(fit_new("--model.lr", "-1e-3"), "model.lr"),
    "lr_1e300_unlearn": Case(unlearn("[1]", "--model.lr", "1e300"), "model.lr"),
    "momentum_2": Case(fit_new("--model.momentum", "2"), "model.momentum"),
    "momentum_1": Case(fit_new("--model.momentum", "1"), "model.momentum"),
    "weight_decay_1e39": Case(fit_new("--model.weight_decay", "1e39"), "weight_decay"),
    "rho_1e300": Case(fit_new("--data.rho", "1e300"), "rho"),
    "memory_budget_1e300": Case(fit_new("--trainer.memory_budget_mb", "1e300"), "memory_budget_mb"),
    "clients_quoted_digit": Case(unlearn('["1"]'), "clients"),
    "clients_arabic_indic_digit": Case(unlearn("[\u0661]"), "clients"),
    "clients_arabic_indic_scalar": Case(unlearn("\u0661"), "clients"),
    "clients_fullwidth_digit": Case(unlearn("[\uff11]"), "clients"),
    "clients_hex": Case(unlearn("[0x1]"), "clients"),
    "clients_anchor": Case(unlearn("[&a 1, *a]"), "clients"),
    # non-finite numbers of every float field kind, named
    "lr_nan": Case(fit_new("--model.lr", "nan"), "model.lr"),
    "lr_plus_inf": Case(fit_new("--model.lr", "+inf"), "model.lr"),
    "momentum_nan": Case(fit_new("--model.momentum", "nan"), "model.momentum"),
    "momentum_negative": Case(fit_new("--model.momentum", "-0.1"), "model.momentum"),
    "weight_decay_nan": Case(fit_new("--model.weight_decay", "nan"), "weight_decay"),
    "weight_decay_minus_inf": Case(fit_new("--model.weight_decay", "-inf"), "weight_decay"),
    "rho_nan": Case(fit_new("--data.rho", "nan"), "data.rho"),
    "rho_inf": Case(fit_new("--data.rho", "inf"), "data.rho"),
    "client_fraction_nan": Case(fit_new("--trainer.algorithm.client_fraction", "nan"), "client_fraction"),
    "algorithm_tolerance_nan": Case(fit_new("--trainer.algorithm.tolerance", "nan"), "algorithm.tolerance"),
    "test_fraction_nan": Case(fit_new("--data.test_fraction", "nan"), "test_fraction"),
    # client ids: plain ASCII integers only (YAML would read 010 as octal 8, 1e0 or true otherwise)
    "clients_leading_zero_octal": Case(unlearn("[010]"), "leading zeros"),
    "clients_leading_zero": Case(unlearn("[01]"), "leading zeros"),
    "clients_plus_sign": Case(unlearn("[+1]"), "clients"),
    "clients_true": Case(unlearn("[true]"), "clients"),
    "clients_exponent": Case(unlearn("[1e0]"), "clients"),
    "clients_underscore": Case(unlearn("[1_0]"), "clients"),
    "clients_superscript": Case(unlearn("[\u00b9]"), "clients"),
    "clients_devanagari_scalar": Case(unlearn("\u0967"), "clients"),
    "clients_octal_prefix": Case(unlearn("[0o1]"), "clients"),
    "clients_binary_prefix": Case(unlearn("[0b1]"), "clients"),
    "clients_inf": Case(unlearn("[.inf]"), "clients"),
    "clients_nan": Case(unlearn("[.nan]"), "clients"),
    "clients_mapping": Case(unlearn("{1: 2}"), "clients"),
    # control characters in run names
    "run_name_delete": Case(fit_new("--trainer.run_name", "a\x7fb"), "run_name"),
    "run_name_carriage_return": Case(fit_new("--trainer.run_name", "a\rb"), "run_name"),
    "run_name_next_line": Case(fit_new("--trainer.run_name", "a\u0085b"), "run_name"),
    "run_name_newline": Case(fit_new("--trainer.run_name", "a\nb"), "run_name"),
    "run_name_tab": Case(fit_new("--trainer.run_name", "a\tb"), "run_name"),
    "run_name_escape": Case(fit_new("--trainer.run_name", "\x1b[31mred"), "run_name"),
    "run_name_line_separator": Case(fit_new("--trainer.run_name", "a\u2028b"), "run_name"),
    # -- run_name escapes
    "run_name_parent": Case(fit_new("--trainer.run_name", "../escape"), "run_name"),
    "run_name_nested": Case(fit_new("--trainer.run_name", "a/b"), "run_name"),
    "run_name_dotdot": Case(fit_new("--trainer.run_name", ".."), "run_name"),
    "run_name_dot": Case(fit_new("--trainer.run_name", "."), "run_name"),
    "run_name_absolute": Case(fit_new("--trainer.run_name", "/tmp/fedshard-escape"), "run_name"),
    # -- bad paths and wrong --ckpt_path targets
    "fit_ckpt_missing": Case(bare("fit", target=lambda r, c: c / "nope"), "nope"),
    "fit_ckpt_only_a_model": Case(bare("fit", target=lambda r, c: r), "not a run directory", _only_model),
    "fit_ckpt_model_file": Case(on("fit", target=lambda r: r / "model.safetensors"), "model.safetensors"),
    "fit_ckpt_cache_folder": Case(bare("fit", target=lambda r, c: r / "cache"), "cache"),
    "fit_ckpt_version_folder": Case(
        bare("fit", target=lambda r, c: r / "cache" / _cache(r).current()), "not a run directory"
    ),
    "unlearn_ckpt_cache_folder": Case(
        bare("unlearn", "--clients", "[1]", target=lambda r, c: r / "cache"), "cache"
    ),
    "unlearn_ckpt_model_file": Case(
        on("unlearn", "--clients", "[1]", target=lambda r: r / "model.safetensors"), "model.safetensors"
    ),
    "audit_ckpt_parent_folder": Case(bare("audit", target=lambda r, c: r.parent), "run directory"),
    "test_ckpt_current_file": Case(bare("test", target=lambda r, c: r / "cache" / "CURRENT"), "CURRENT"),
    "test_ckpt_missing_file": Case(bare("test", target=lambda r, c: r / "nope.safetensors"), "nope"),
    "verify_ckpt_missing": Case(lambda r, c: ["cache", "verify", "--ckpt_path", str(c / "nope")], "nope"),
    "root_dir_under_a_file": Case(
        lambda r, c: ["fit", *TINY, "--trainer.default_root_dir", str(r / "metrics.json" / "sub")],
        "default_root_dir",
    ),
    # -- fit --ckpt_path with another config: refused before training, also before the first commit
    "resume_other_clients": Case(on("fit", "--data.num_clients", "16"), "another config"),
    "resume_other_seed": Case(on("fit", "--seed_everything", "7"), "another config"),
    "resume_precommit_other_clients": Case(
        on("fit", "--data.num_clients", "16"), "num_clients", _before_first_commit
    ),
    "resume_precommit_other_seed": Case(on("fit", "--seed_everything", "7"), "seed", _before_first_commit),
    "resume_precommit_other_lr": Case(on("fit", "--model.lr", "0.5"), "lr", _before_first_commit),
    "resume_fingerprint_damaged": Case(on("fit"), "FINGERPRINT", _damaged_fingerprint),
    # -- fit --ckpt_path on a folder whose fit recorded no settings: refused, never trained with defaults
    "resume_nothing_recorded": Case(bare("fit", target=lambda r, c: r), "rm -r", _nothing_recorded()),
    "resume_nothing_recorded_no_flags": Case(
        lambda r, c: ["fit", "--ckpt_path", str(r)], "no config.yaml", _nothing_recorded()
    ),
    "resume_fingerprint_tmp_only": Case(
        bare("fit", target=lambda r, c: r), "rm -r", _nothing_recorded(".FINGERPRINT.tmp-999999999")
    ),
    # -- the request history and CURRENT disagree (a rollback): refused before anything is written
    **{
        f"rollback_{name}": Case(argv, "rolled back", _roll_back, unlearned=True)
        for name, argv in {
            "test": on("test"),
            "unlearn": unlearn("[3]"),
            "unlearn_same_client": U,
            "audit": on("audit"),
            "verify": cache_cmd("verify"),
            "verify_all": cache_cmd("verify", "--all"),
            "gc": cache_cmd("gc", "--keep", "1"),
        }.items()
    },
    "rollback_without_journal": Case(
        on("test"),
        "report.json",
        _then(_roll_back, _remove(lambda r: r / "unlearning" / "journal.jsonl")),
        unlearned=True,
    ),
    "rollback_without_reports": Case(
        on("test"),
        "journal.jsonl",
        _then(_roll_back, _remove(lambda r: r / "unlearning" / "0001")),
        unlearned=True,
    ),
    "unlearned_list_edited_unlearn_again": Case(unlearn("[2]"), "edited", _forget_unlearned, unlearned=True),
    "unlearned_list_edited_test": Case(on("test"), "edited", _forget_unlearned, unlearned=True),
    "unlearned_list_edited_verify": Case(cache_cmd("verify"), "edited", _forget_unlearned, unlearned=True),
    "request_log_emptied": Case(on("audit"), "request 1", _forget_request_log, unlearned=True),
    "journal_names_other_clients": Case(on("test"), "[5]", _journal_other_clients, unlearned=True),
    # -- symbolic links planted in the run
    "journal_symlink": Case(U, "journal.jsonl", _symlink(lambda r: r / "unlearning" / "journal.jsonl")),
    "unlearning_dir_symlink": Case(U, "unlearning", _symlink(lambda r: r / "unlearning", target_is_dir=True)),
    "cache_dir_symlink": Case(U, "symbolic link", _symlink(lambda r: r / "cache", target_is_dir=True)),
    "cache_dir_symlink_fit": Case(
        on("fit"), "symbolic link", _symlink(lambda r: r / "cache", target_is_dir=True)
    ),
    "blob_symlink": Case(on("audit"), "theta0", _symlink(_theta0_blob)),
    **{
        f"logs_symlink_{name}": Case(argv, "logs", _symlink(lambda r: r / "logs", target_is_dir=True))
        for name, argv in {
            "test": on("test"),
            "unlearn": U,
            "audit": on("audit"),
            "test_model_file": on("test", target=lambda r: r / "model.safetensors"),
        }.items()
    },
    "logs_entry_symlink_test": Case(
        on("test"), "test-1", _symlink(lambda r: r / "logs" / "test-1", target_is_dir=True)
    ),
    "logs_is_a_file_test": Case(
        on("test"), "not a folder", _then(_remove(lambda r: r / "logs"), _touch("logs"))
    ),
    "blobs_symlink_unlearn": Case(U, "blobs", _symlink(lambda r: r / "cache" / "blobs", target_is_dir=True)),
    "blobs_symlink_gc": Case(
        cache_cmd("gc", "--keep", "1"), "blobs", _symlink(lambda r: r / "cache" / "blobs", target_is_dir=True)
    ),
    "blobs_fanout_symlink_unlearn": Case(
        U, "zz", _symlink(lambda r: r / "cache" / "blobs" / "zz", target_is_dir=True)
    ),
    "tensorboard_symlink_test": Case(
        on("test"), "tensorboard", _symlink(lambda r: r / "tensorboard", target_is_dir=True)
    ),
    "wandb_symlink_audit": Case(
        on("audit"), "wandb_files", _symlink(lambda r: r / "wandb_files", target_is_dir=True)
    ),
    "manifest_symlink": Case(U, "manifest.json", _symlink(_manifest_path)),
    "current_symlink": Case(U, "CURRENT", _symlink(lambda r: r / "cache" / "CURRENT")),
    # -- tensors swapped for others, checksums updated
    "theta0_wrong_shape": Case(U, "theta0", _swap_file("theta0.safetensors", _reshape)),
    "theta0_wrong_dtype": Case(U, "theta0", _swap_file("theta0.safetensors", _dtype(torch.float64))),
    "theta0_extra_tensor": Case(U, "intruder", _swap_file("theta0.safetensors", _extra)),
    "theta0_wrong_shape_schema_too": Case(
        U, "theta0", _swap_file("theta0.safetensors", _reshape, schema=True)
    ),
    "theta0_wrong_dtype_schema_too": Case(
        on("audit"), "theta0", _swap_file("theta0.safetensors", _dtype(torch.float16), schema=True)
    ),
    "structure_wrong_dtype": Case(
        U, "structure_1", _swap_file("structure_1.safetensors", _dtype(torch.float32))
    ),
    "structure_wrong_shape": Case(
        U,
        "structure_2",
        _swap_file("structure_2.safetensors", lambda t: {**t, "offsets": t["offsets"][:-1].clone()}),
    ),
    "stack_row_wrong_dtype": Case(U, "stage_2", _swap_row("stage_2", 0, _dtype(torch.float64))),
    "stack_row_wrong_shape": Case(on("audit"), "stage_2", _swap_row("stage_2", 0, _reshape)),
    "stack_row_extra_tensor": Case(U, "stage_2", _swap_row("stage_2", 0, _extra)),
    "stack_row_wrong_dtype_schema_too": Case(
        U, "stage_2", _swap_row("stage_2", 0, _dtype(torch.float64), schema=True)
    ),
    "stack_row_wrong_shape_schema_too": Case(
        on("test"), "stage_2", _swap_row("stage_2", 0, _reshape, schema=True)
    ),
    "model_file_wrong_shape": Case(
        on("test", target=lambda r: r / "model.safetensors"), "model.safetensors", _model_file(_reshape)
    ),
    "model_file_wrong_dtype": Case(
        on("test", target=lambda r: r / "model.safetensors"), "float64", _model_file(_dtype(torch.float64))
    ),
    "model_file_extra_tensor": Case(
        on("test", target=lambda r: r / "model.safetensors"), "intruder", _model_file(_extra)
    ),
    # -- one flipped byte
    "flip_model_file": Case(
        on("test", target=lambda r: r / "model.safetensors"),
        "modified",
        _flip(lambda r: r / "model.safetensors"),
    ),
    "flip_theta0_blob": Case(U, "checksum", _flip(_theta0_blob)),
    "flip_stack_row_blob": Case(on("audit"), "checksum", _flip(_first_row_blob)),
    "flip_stack_row_blob_test": Case(on("test"), "checksum", _flip(_first_row_blob)),
    "flip_current_manifest": Case(U, "manifest.json", _flip(_manifest_path, offset=40)),
    "flip_current": Case(U, "CURRENT", _flip(lambda r: r / "cache" / "CURRENT", offset=-4)),
    "flip_old_manifest_verify_all": Case(
        cache_cmd("verify", "--all"), "manifest.json", _flip(_old_version, offset=60)
    ),
    "flip_old_blob_verify_all": Case(
        cache_cmd("verify", "--all"),
        "corrupted",
        _flip(
            lambda r: _cache(r).blob_path(
                _cache(r).manifest(_cache(r).versions()[0])["stacks"]["stage_1"]["snapshot"]
            )
        ),
    ),
    "flip_unread_blob_test": Case(
        on("test"), "client_sizes", _flip(lambda r: _cache(r).path_of("client_sizes.safetensors"))
    ),
    "flip_unread_blob_unlearn": Case(
        U, "client_sizes", _flip(lambda r: _cache(r).path_of("client_sizes.safetensors"))
    ),
    "flip_theta0_verify": Case(cache_cmd("verify"), "corrupted", _flip(_theta0_blob)),
    # -- truncated files
    "truncate_current": Case(U, "CURRENT", _truncate(lambda r: r / "cache" / "CURRENT")),
    "truncate_current_manifest": Case(on("audit"), "manifest.json", _truncate(_manifest_path)),
    "truncate_theta0_blob": Case(U, "theta0", _truncate(_theta0_blob)),
    "truncate_stack_row_blob": Case(on("test"), "stage_2", _truncate(_first_row_blob)),
    "truncate_model_file": Case(
        on("test", target=lambda r: r / "model.safetensors"),
        "model.safetensors",
        _truncate(lambda r: r / "model.safetensors"),
    ),
    "truncate_config_yaml": Case(
        lambda r, c: ["unlearn", "--ckpt_path", str(r), "--clients", "[1]"],
        "config",
        # inside a quoted value: a YAML error, not another field's (a fraction of the length moved
        # with the temporary path's length, into "precision: 32-tru")
        _truncate_inside(lambda r: r / "config.yaml", b"local_bn: 'o"),
    ),
    "empty_current": Case(U, "CURRENT", _truncate(lambda r: r / "cache" / "CURRENT", keep=0)),
    # -- missing files
    "missing_theta0_blob": Case(U, "theta0", _remove(_theta0_blob)),
    "missing_stack_row_blob": Case(on("audit"), "stage_2", _remove(_first_row_blob)),
    "missing_current_manifest": Case(U, "CURRENT", _remove(_manifest_path)),
    "missing_old_manifest_verify_all": Case(
        cache_cmd("verify", "--all"), "0001-stage-1", _remove(_old_version)
    ),
    "missing_old_manifest_gc": Case(cache_cmd("gc", "--keep", "1"), "0001-stage-1", _remove(_old_version)),
    "missing_blobs_folder": Case(on("test"), "missing", _remove(lambda r: r / "cache" / "blobs")),
    "missing_structure_blob": Case(
        U, "structure_1", _remove(lambda r: _cache(r).path_of("structure_1.safetensors"))
    ),
    "missing_config_yaml": Case(
        lambda r, c: ["unlearn", "--ckpt_path", str(r), "--clients", "[1]"],
        "another config",
        _remove(lambda r: r / "config.yaml"),
    ),
    "missing_model_file_explicit": Case(
        on("test", target=lambda r: r / "model.safetensors"),
        "model.safetensors",
        _remove(lambda r: r / "model.safetensors"),
    ),
    "missing_cache_folder_audit": Case(on("audit"), "CURRENT", _remove(lambda r: r / "cache")),
    # -- unknown, duplicate and malformed client ids
    "clients_one_past_the_end": Case(unlearn("[8]"), "8"),
    "clients_huge": Case(unlearn("[100000000000000000000]"), "clients"),
    "clients_duplicate_among_others": Case(unlearn("[2, 3, 2]"), "duplicate"),
    "clients_float": Case(unlearn("[1.5]"), "clients"),
    "clients_string_id": Case(unlearn('["two"]'), "clients"),
    "clients_null_id": Case(unlearn("[null]"), "clients"),
    "clients_malformed": Case(unlearn("[1, 2"), "clients"),
    "clients_nested": Case(unlearn("[[1]]"), "clients"),
    # -- write faults (the first write fails; nothing was written before it)
    "unlearn_enospc": Case(U, "No space left", code=3, patch=("open", errno.ENOSPC)),
    "unlearn_erofs": Case(U, "Read-only", code=4, patch=("open", errno.EROFS)),
    "unlearn_efbig": Case(U, "too large", code=5, patch=("open", errno.EFBIG)),
    "unlearn_eacces": Case(U, "Permission denied", code=6, patch=("open", errno.EACCES)),
    "unlearn_eio": Case(U, "Input/output", code=7, patch=("open", errno.EIO)),
    "fit_enospc": Case(fit_new(), "No space left", code=3, patch=("open", errno.ENOSPC)),
    "fit_erofs": Case(fit_new(), "Read-only", code=4, patch=("open", errno.EROFS)),
    "fit_root_mkdir_erofs": Case(fit_new(), "Read-only", code=4, patch=("mkdir", errno.EROFS)),
    "gc_enospc": Case(cache_cmd("gc", "--keep", "1"), "No space left", code=3, patch=("open", errno.ENOSPC)),
    # -- a full disk for real: a small tmpfs (skipped where mounting one is not allowed)
    "tmpfs_full_unlearn": Case(U, "No space left", _fill_tmpfs, code=3, tmpfs=True),
    "tmpfs_full_fit": Case(fit_new(), "No space left", _fill_tmpfs, code=3, tmpfs=True),
}


# -- running a case ------------------------------------------------------------------------------

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _patched(monkeypatch, case_dir: Path, op: str, err: int) -> None:
    """Make writes under ``case_dir`` fail with ``err`` (at the os level: os.open, open, mkdir)."""
    real_os_open, real_open, real_mkdir = os.open, open, os.mkdir
    inside = str(case_dir)

    def under(path) -> bool:
        return str(os.fspath(path)).startswith(inside) if isinstance(path, (str, os.PathLike)) else False

    def fail(path) -> OSError:
        return OSError(err, os.strerror(err), str(os.fspath(path)))

    if op == "open":

        def os_open(path, flags, *args, **kwargs):
            if flags & _WRITE_FLAGS and under(path):
                raise fail(path)
            return real_os_open(path, flags, *args, **kwargs)

        def builtin_open(file, mode="r", *args, **kwargs):
            if any(m in mode for m in "wax+") and under(file):
                raise fail(file)
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr("builtins.open", builtin_open)
    else:

        def mkdir(path, *args, **kwargs):
            if under(path):
                raise fail(path)
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)


def _tmpfs(folder: Path) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], capture_output=True)
    return r.returncode == 0


def _params():
    for case_id, case in CASES.items():
        yield pytest.param(case, id=case_id, marks=case.marks)


@pytest.fixture(scope="module")
def base(tmp_path_factory, reference_run) -> Path:
    """The reference run (read only: every case copies it)."""
    return reference_run


@pytest.mark.parametrize("case", list(_params()))
def test_matrix_case_is_one_line_and_changes_nothing(
    case: Case, base: Path, tmp_path: Path, monkeypatch, request
):
    case_dir = tmp_path / "case"
    mounted = False
    if case.tmpfs:
        if not _tmpfs(case_dir):
            pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
        mounted = True
    else:
        case_dir.mkdir()
    try:
        run = copy_run(request.getfixturevalue("unlearned_run") if case.unlearned else base, case_dir / "run")
        (case_dir / "runs").mkdir()
        if case.damage is not None:
            case.damage(run, case_dir)
        argv = case.argv(run, case_dir)
        needle = case.needle(run, case_dir) if callable(case.needle) else case.needle
        watched = run if case.tmpfs else case_dir
        before = tree_hash(watched)
        if case.patch is not None:
            _patched(monkeypatch, case_dir, *case.patch)
        code, _, err = cli(argv)
        monkeypatch.undo()
        lines = [ln for ln in error_lines(err) if not ln.startswith("note: ")]
        assert "Traceback" not in err, err
        assert code == case.code, (code, err)
        assert len(lines) == 1, err
        assert lines[0].startswith("error: "), lines[0]
        assert needle in lines[0], (needle, lines[0])
        assert tree_hash(watched) == before, "the case changed files on disk"
    finally:
        if mounted:
            subprocess.run(["umount", str(case_dir)], capture_output=True)


def test_the_matrix_is_large_enough():
    """This matrix plus the older table of test_bad_inputs.py (checked with the same tree hash)."""
    assert len(CASES) >= 160
    assert sum(case.code == 2 for case in CASES.values()) + len(OLD_CASES) >= 220  # bad inputs, not OS faults
