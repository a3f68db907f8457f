"""Fabric DDP on CPU (gloo, 2 processes): shards of a stage split across ranks, same model."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

# rounds: auto as shipped (calibration under DDP is under test), capped at 3 rounds a shard: the
# default cap of 30 made every stage of these 8-client fits train 30 rounds.
TINY = [
    "--data.num_clients",
    "8",
    "--trainer.algorithm.max_rounds",
    "3",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.vectorize",
    "always",
]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "fedshard_lightning", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_ddp_two_processes_equals_single_process(tmp_path: Path, monkeypatch):
    # M_p's replay split across ranks, under the shipped client-step budget; the seconds budget is
    # lifted, as a loaded machine's slower fit would skip the replay for the load
    monkeypatch.setenv("FEDSHARD_REPLAY_BUDGET_S", "86400")
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2"]
    out = {}
    for name, extra in (("single", []), ("ddp", ddp)):
        root = tmp_path / name
        r = _cli("fit", *TINY, *extra, "--trainer.default_root_dir", str(root))
        assert r.returncode == 0, r.stderr[-2000:]
        runs = list(root.iterdir())
        assert len(runs) == 1, "one run directory, created by rank zero only"
        run = runs[0]
        assert r.stdout.count("fit done") == 1, "printing happens once"
        u = _cli(
            "unlearn",
            "--config",
            str(run / "config.yaml"),
            "--ckpt_path",
            str(run),
            "--clients",
            "[2, 5]",
            *extra,
        )
        assert u.returncode == 0, u.stderr[-2000:]
        out[name] = run
    rounds = {name: _round_rows(run) for name, run in out.items()}
    assert len(rounds["single"]) == len(rounds["ddp"]) > 0, "one row per round of the whole stage"
    for one, two in zip(rounds["single"], rounds["ddp"]):  # all ranks' groups, not rank zero's
        for key in ("stage", "round", "participants", "client_steps", "global_round"):
            assert one[key] == two[key], (key, one, two)
        for key in ("train_loss", "test_accuracy", "test_loss"):
            assert math.isclose(float(one[key]), float(two[key]), rel_tol=1e-5, abs_tol=1e-6), (key, one, two)
    a = load_file(str(out["single"] / "model.safetensors"))
    b = load_file(str(out["ddp"] / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6  # float32; observed 0.0
    ra = json.loads((out["single"] / "unlearn_report.json").read_text())
    rb = json.loads((out["ddp"] / "unlearn_report.json").read_text())
    assert ra["client_steps"] == rb["client_steps"] == rb["predicted_client_steps"]
    # The fairness evaluation (probe, predicted costs, the M_p replay's retraining split across ranks) agrees.
    fair = {name: _fairness_rows(run) for name, run in out.items()}
    assert len(fair["single"]) == len(fair["ddp"]) == 2, "after fit and after the request"
    for one, two in zip(fair["single"], fair["ddp"]):
        assert one["fairness/num_clients"] == two["fairness/num_clients"]
        for key in ("fairness/M_e_steps", "fairness/M_p", "fairness/Z_steps_mean"):
            assert math.isclose(float(one[key]), float(two[key]), rel_tol=1e-5), (key, one[key], two[key])
    versions = sorted(p.name for p in (out["ddp"] / "cache").iterdir() if p.is_dir())
    assert len(versions) == len(set(versions)) and all(not v.startswith(".") for v in versions)


def _fairness_rows(run: Path) -> list[dict[str, str]]:
    """The fairness rows of the fit's and the requests' CSV files, in that order."""
    rows = []
    for path in [run / "logs" / "metrics.csv", *sorted(run.glob("logs/unlearn-*/metrics.csv"))]:
        with open(path, newline="") as f:
            rows += [r for r in csv.DictReader(f) if r.get("fairness/M_e_steps")]
    return rows


def _round_rows(run: Path) -> list[dict[str, str]]:
    with open(run / "logs" / "metrics.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("round")]
