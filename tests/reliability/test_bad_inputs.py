"""A table of malformed inputs through ``cli.main`` in-process: one line, exit 2, nothing modified.

Each case asserts the exit status, exactly one non-empty stderr line (besides Lightning's
'Seed set to' line) that starts with ``error: `` and names the offending field or path, no
traceback, and that every file that existed under the fixture folder (run directories, data
directories, configs) is byte-identical afterwards, and the folder's tree hash (every path, mode
and byte) unchanged. ``test_bad_input_matrix.py`` holds the tamper matrix; both count together. Config values, unlearning client lists, data
directories in the MNIST IDX format and run directories are covered; ``tests/test_cli.py`` and
``tests/unlearning/test_fedshard.py`` hold the cases not repeated here.
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from _reliability_helpers import TINY, changed_files, cli, copy_run, error_lines, snapshot, tree_hash

from fedshard_lightning.flcache import FLCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from native_formats import digit_arrays, write_idx, write_mnist_files


@dataclass
class Env:
    """The fixture folder: a finished run, damaged copies, data directories, config files."""

    root: Path
    runs: Path  # default_root_dir of the fit cases (new files only)
    run: Path
    cfg: str


def _damage_runs(env: Env) -> None:
    version = FLCache(env.run / "cache").current()
    no_current = copy_run(env.run, env.root / "no_current")
    (no_current / "cache" / "CURRENT").unlink()
    dangling = copy_run(env.run, env.root / "dangling")
    shutil.rmtree(dangling / "cache" / version)
    incomplete = copy_run(env.run, env.root / "incomplete")
    FLCache(incomplete / "cache").set_current("0001-stage-1")
    no_stage = copy_run(env.run, env.root / "no_stage")
    no_stage_cache = FLCache(no_stage / "cache")
    no_stage_cache.blob_path(no_stage_cache.stack_digests("stage_2", version)[0]).unlink()
    no_model = copy_run(env.run, env.root / "no_model")
    (no_model / "model.safetensors").unlink()
    (env.root / "empty").mkdir()
    (env.root / "model.pt").write_bytes(b"\x80\x04not a checkpoint at all")
    (env.root / "a_file").write_text("not a folder\n")
    (env.root / "malformed.yaml").write_text("data: [1, 2\n  model: {\n")
    (env.root / "list.yaml").write_text("- fit\n- 2\n")


def _gunzip_edit(path: Path, edit: Callable[[bytes], bytes]) -> None:
    path.write_bytes(gzip.compress(edit(gzip.decompress(path.read_bytes())), mtime=0))


def _mnist_dirs(env: Env) -> None:
    images, labels = digit_arrays(40)
    damages: dict[str, Callable[[Path], object]] = {
        "mnist_empty": lambda m: None,
        "mnist_gz_truncated": lambda m: (m / "train-images-idx3-ubyte.gz").write_bytes(
            (m / "train-images-idx3-ubyte.gz").read_bytes()[:300]
        ),
        "mnist_data_truncated": lambda m: _gunzip_edit(m / "train-images-idx3-ubyte.gz", lambda b: b[:5000]),
        "mnist_wrong_magic": lambda m: write_idx(m / "train-images-idx3-ubyte.gz", images, magic=2049),
        "mnist_count_mismatch": lambda m: write_idx(m / "train-labels-idx1-ubyte.gz", labels[:30]),
        "mnist_empty_file": lambda m: (m / "t10k-labels-idx1-ubyte.gz").write_bytes(b""),
        "mnist_bad_labels": lambda m: write_idx(m / "train-labels-idx1-ubyte.gz", labels + 100),
    }
    for name, damage in damages.items():
        folder = env.root / name / "mnist"
        if name != "mnist_empty":
            write_mnist_files(folder, n_train=40, n_test=20)
            damage(folder)
        else:
            folder.mkdir(parents=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory, reference_run) -> Env:
    root = tmp_path_factory.mktemp("bad_inputs")
    run = copy_run(reference_run, root / "run")
    runs = tmp_path_factory.mktemp("bad_inputs_runs")
    e = Env(root, runs, run, str(run / "config.yaml"))
    _damage_runs(e)
    _mnist_dirs(e)
    return e


def fit(*args: str) -> Callable[[Env], list[str]]:
    return lambda e: ["fit", *TINY, "--trainer.default_root_dir", str(e.runs), *args]


def unlearn(clients: str | None, run: str = "run", *extra: str) -> Callable[[Env], list[str]]:
    tail = [] if clients is None else ["--clients", clients]
    return lambda e: ["unlearn", "--config", e.cfg, "--ckpt_path", str(e.root / run), *tail, *extra]


def on_run(command: str, run: str, *extra: str) -> Callable[[Env], list[str]]:
    return lambda e: [command, "--config", e.cfg, "--ckpt_path", str(e.root / run), *extra]


def mnist(folder: str) -> Callable[[Env], list[str]]:
    return fit(
        "--data",
        "fedshard_lightning.data.MNISTDataModule",
        "--data.data_dir",
        folder,
        "--data.download",
        "false",
        "--data.num_clients",
        "4",
        "--data.min_client_size",
        "2",
    )


def _mnist_case(folder: str, file: str = "", needle: str | None = None):
    """Fit on an MNIST folder; the error must name the file (``folder/mnist/file``) or ``needle``."""
    return (
        lambda e: mnist(str(e.root / folder))(e),
        needle or (f"{folder}/mnist/{file}" if file else folder),
    )


# id: (args builder, text the error line must contain: a string, or a builder of one; [marks])
CASES: dict[str, tuple] = {
    # -- config values: types and ranges
    "merge_rate_0": (fit("--trainer.algorithm.merge_rate", "0"), "merge_rate"),
    "num_clients_1": (fit("--data.num_clients", "1"), "num_clients"),
    "num_clients_0": (fit("--data.num_clients", "0"), "num_clients"),
    "num_clients_string": (fit("--data.num_clients", "eight"), "num_clients"),
    "rho_negative": (fit("--data.rho", "-0.5"), "rho"),
    "t0_above_t1": (fit("--trainer.algorithm.t0", "3", "--trainer.algorithm.t1", "2"), "t0"),
    "t1_negative": (fit("--trainer.algorithm.t1", "-1"), "t1"),
    "t1_absurd": (fit("--trainer.algorithm.t1", str(10**21)), "algorithm.t1=1000000000000000000000"),
    "local_epochs_absurd": (
        fit("--trainer.algorithm.local_steps", "null", "--trainer.algorithm.local_epochs", "1e9"),
        "local_epochs",
    ),
    "fixed_rounds_negative": (
        fit("--trainer.algorithm.rounds", "fixed", "--trainer.algorithm.fixed_rounds", "-1"),
        "fixed_rounds",
    ),
    "batch_size_negative": (fit("--trainer.algorithm.batch_size", "-5"), "batch_size"),
    "local_epochs_0": (
        fit("--trainer.algorithm.local_steps", "null", "--trainer.algorithm.local_epochs", "0"),
        "local_epochs",
    ),
    "local_steps_0": (fit("--trainer.algorithm.local_steps", "0"), "local_steps"),
    "client_fraction_0": (fit("--trainer.algorithm.client_fraction", "0"), "client_fraction"),
    "client_fraction_1.5": (fit("--trainer.algorithm.client_fraction", "1.5"), "client_fraction"),
    "partition_unknown": (fit("--data.partition", "shards"), "partition"),
    "merge_unknown": (fit("--trainer.algorithm.merge", "zigzag"), "merge"),
    "rounds_unknown": (fit("--trainer.algorithm.rounds", "sometimes"), "rounds"),
    "holdout_fraction_1": (fit("--data.holdout_fraction", "1.0"), "holdout_fraction"),
    "lr_negative": (fit("--model.lr", "-1"), "lr"),
    "seed_string": (fit("--seed_everything", "abc"), "seed_everything"),
    "vectorize_unknown": (fit("--trainer.vectorize", "sometimes"), "vectorize"),
    "model_class_unknown": (fit("--model", "no_such.Model"), "no_such.Model"),
    "config_missing": (
        lambda e: fit("--config", str(e.root / "nope.yaml"))(e),
        lambda e: str(e.root / "nope.yaml"),
    ),
    "config_malformed": (
        lambda e: fit("--config", str(e.root / "malformed.yaml"))(e),
        "malformed.yaml",
    ),
    "config_not_a_mapping": (
        lambda e: fit("--config", str(e.root / "list.yaml"))(e),
        "list.yaml",
    ),
    "run_name_exists": (
        lambda e: ["fit", *TINY, "--trainer.default_root_dir", str(e.root), "--trainer.run_name", "run"],
        "run_name",
    ),
    "precision_unknown": (fit("--trainer.precision", "13-true"), "precision"),
    "accelerator_unknown": (fit("--trainer.accelerator", "tpu9"), "accelerator"),
    "devices_0": (fit("--trainer.devices", "0"), "devices"),
    "root_dir_is_a_file": (
        lambda e: ["fit", *TINY, "--trainer.default_root_dir", str(e.root / "a_file")],
        "a_file",
    ),
    # -- unlearning client lists
    "clients_unknown": (unlearn("[99]"), "99"),
    "clients_negative": (unlearn("[-1]"), "-1"),
    "clients_duplicate": (unlearn("[1, 1]"), "duplicate"),
    "clients_empty": (unlearn("[]"), "clients"),
    "clients_strings": (unlearn('["a"]'), "clients"),
    "clients_bool": (unlearn("[true]"), "clients"),
    "clients_not_a_list": (unlearn("3.5"), "clients='3.5': give plain integers"),
    "clients_comma_string": (unlearn("'1,2'"), "clients"),
    "clients_missing": (unlearn(None), "clients"),
    "clients_everyone": (unlearn("[0, 1, 2, 3, 4, 5, 6, 7]"), "clients"),
    # -- data directories (MNIST IDX files, no download)
    "data_dir_missing": _mnist_case("no_such_dir"),
    "data_dir_empty": _mnist_case("mnist_empty"),
    "data_gz_truncated": _mnist_case("mnist_gz_truncated", "train-images-idx3-ubyte.gz"),
    "data_idx_truncated": _mnist_case("mnist_data_truncated", "train-images-idx3-ubyte.gz"),
    "data_wrong_magic": _mnist_case("mnist_wrong_magic", "train-images-idx3-ubyte.gz"),
    "data_count_mismatch": _mnist_case("mnist_count_mismatch", needle="30 labels"),
    "data_empty_file": _mnist_case("mnist_empty_file", "t10k-labels-idx1-ubyte.gz"),
    "data_labels_out_of_range": _mnist_case("mnist_bad_labels", "train-labels-idx1-ubyte.gz"),
    # -- run directories
    "run_missing": (unlearn("[1]", "no_such_run"), "no_such_run"),
    "run_empty_folder_unlearn": (unlearn("[1]", "empty"), "empty"),
    "run_empty_folder_fit": (on_run("fit", "empty"), "empty"),
    "run_foreign_seed": (unlearn("[1]", "run", "--seed_everything", "1"), "another config"),
    "run_foreign_data": (unlearn("[1]", "run", "--data.seed", "5"), "another config"),
    "run_foreign_algorithm": (
        unlearn("[1]", "run", "--trainer.algorithm", "fedshard_lightning.unlearning.FedAvg"),
        "fedshard",
    ),
    "run_without_current": (unlearn("[1]", "no_current"), "cache/CURRENT"),
    "run_current_dangling": (unlearn("[1]", "dangling"), "CURRENT"),
    "run_current_dangling_resume": (on_run("fit", "dangling"), "CURRENT"),
    "run_fit_unfinished": (unlearn("[1]", "incomplete"), "stage 1 of 3"),
    "run_stage_file_missing": (on_run("audit", "no_stage"), "stack stage_2"),
    "ckpt_path_is_a_file_test": (on_run("test", "model.pt"), "model.pt"),
    "ckpt_path_is_a_file_unlearn": (unlearn("[1]", "model.pt"), "model.pt"),
}


def _params():
    for case_id, (args, needle, *marks) in CASES.items():
        yield pytest.param(args, needle, id=case_id, marks=marks[0] if marks else ())


@pytest.mark.parametrize(("args", "needle"), list(_params()))
def test_bad_input_is_one_line_and_changes_nothing(env, args, needle):
    argv = args(env)
    needle = needle(env) if callable(needle) else needle
    before, tree = snapshot(env.root), tree_hash(env.root)
    code, _, err = cli(argv)
    lines = error_lines(err)
    assert "Traceback" not in err, err
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), lines[0]
    assert needle in lines[0], (needle, lines[0])
    assert changed_files(before) == []
    assert tree_hash(env.root) == tree, "a path was added, removed or changed its mode"


def test_the_table_is_large_enough():
    assert len(CASES) >= 30


def test_the_fixture_run_and_data_are_valid(env, tmp_path):
    """The damaged copies are damaged on purpose; the originals they come from load fine."""
    from fedshard_lightning.data import MNISTDataModule

    write_mnist_files(tmp_path / "mnist", n_train=40, n_test=20)
    dm = MNISTDataModule(data_dir=str(tmp_path), num_clients=4, min_client_size=2)
    dm.setup()
    assert sum(dm.client_sizes) == 40
    assert FLCache(env.run / "cache").manifest()["complete"]
    assert os.path.isfile(env.cfg)
