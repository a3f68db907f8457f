"""One seed for every DDP process: ``seed_everything: true`` is drawn once, by the launcher.

Before, Fabric's launcher re-ran the command line in the worker, which drew a seed of its own:
rank 1 trained its groups from another seed than the one rank zero committed and recorded, so
the model equalled no one-process fit and its audit FAILED (max|diff| 0.245 on digits).
Reference: a one-process fit with the seed that the DDP run recorded (its model's tensor bytes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file
from test_multiprocess import TINY

from fedshard_lightning.cli import FederatedCLI, launcher_seed

ROOT = Path(__file__).resolve().parents[1]
DDP = ["--trainer.strategy", "ddp", "--trainer.devices", "2"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PL_GLOBAL_SEED", "LOCAL_RANK", "RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def test_a_launched_worker_takes_the_launchers_seed(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "123456")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launcher_seed() is None  # the launcher itself draws
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launcher_seed() == 123456
    cli = FederatedCLI(args=["--seed_everything", "true", *TINY], run=False)
    assert cli.config["seed_everything"] == 123456
    monkeypatch.setenv("PL_GLOBAL_SEED", "not a seed")
    assert launcher_seed() is None


@pytest.mark.slow
def test_ddp_fit_with_a_drawn_seed_equals_one_process_with_that_seed(tmp_path: Path):
    runs, drawn = {}, 0
    for name, extra in (("ddp", [*DDP, "--seed_everything", "true"]), ("one", None)):
        if extra is None:  # the one-process reference uses the seed the DDP run recorded
            extra = [
                "--seed_everything",
                str(yaml.safe_load((runs["ddp"] / "config.yaml").read_text())["seed_everything"]),
            ]
        root = tmp_path / name
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "fedshard_lightning",
                "fit",
                *TINY,
                *extra,
                "--trainer.default_root_dir",
                str(root),
            ],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=ROOT,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        if name == "ddp":
            drawn = r.stderr.count("drew seed")
        (runs[name],) = root.iterdir()
    a, b = (load_file(str(runs[n] / "model.safetensors")) for n in ("ddp", "one"))
    assert all(a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a)
    assert drawn == 1, "the launcher draws; the worker takes its seed"


@pytest.mark.slow
def test_ddp_processes_with_different_seeds_are_refused(tmp_path: Path):
    script = tmp_path / "two_seeds.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
            from _tiny import tiny_data, tiny_model
            from fedshard_lightning import FederatedTrainer
            from fedshard_lightning.errors import ConfigError
            from fedshard_lightning.models import MLP
            from fedshard_lightning.unlearning import FedShard
            rank = int(os.environ.get("LOCAL_RANK", "0"))
            tr = FederatedTrainer(FedShard(rounds="a2", t0=1, t1=1), strategy="ddp", devices=2, seed=7 + rank,
                                  default_root_dir={str(tmp_path / "runs")!r}, enable_progress_bar=False)
            try:
                tr.fit(tiny_model(MLP), tiny_data((6,), per_client=12, classes=3, partition="iid"))
            except ConfigError as e:
                print("refused:", e)
                sys.exit(2)
            """
        )
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr[-2000:]
    assert "have different seeds [7, 8]" in r.stdout
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing created
