"""The command line: subcommands, configs, run directories and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedshard_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--data.num_clients",
    "8",
    "--trainer.algorithm.t1",
    "2",
    "--trainer.algorithm.t0",
    "1",
    "--trainer.enable_progress_bar",
    "false",
]


def _run(args, capsys):
    code = 0
    try:
        main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "config",
    sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name != "compare"
    ),
)
def test_every_config_parses(config, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    base = (
        []
        if config == "configs/digits.yaml"
        or ("/" not in config.removeprefix("configs/") and not config.startswith("configs/fedavg"))
        else ["--config", "configs/digits.yaml"]
    )
    code, out, err = _run(["fit", *base, "--config", config, "--print_config"], capsys)
    assert code == 0, err
    assert "class_path" in out


def test_fit_test_unlearn_audit_end_to_end(run_root, capsys):
    code, out, err = _run(["fit", *TINY, "--trainer.default_root_dir", str(run_root)], capsys)
    assert code == 0, err
    run = run_root / "version_0"
    assert f"run directory: {run}" in out
    for name in (
        "model.safetensors",
        "config.yaml",
        "metrics.json",
        "tree.txt",
        "logs/metrics.csv",
        "cache/CURRENT",
    ):
        assert (run / name).is_file(), name
    metrics = json.loads((run / "metrics.json").read_text())
    assert {"test_accuracy", "test_loss", "client_steps", "seconds"} <= set(metrics)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["data"]["init_args"]["num_clients"] == 8

    code, _, _ = _run(["fit", *TINY, "--trainer.default_root_dir", str(run_root)], capsys)
    assert code == 0 and (run_root / "version_1").is_dir(), "a second fit gets a new folder"

    code, out, err = _run(["test", "--config", str(run / "config.yaml"), "--ckpt_path", str(run)], capsys)
    assert code == 0, err
    assert f"test_accuracy={metrics['test_accuracy']:.4f}" in out

    code, out, err = _run(
        ["unlearn", "--config", str(run / "config.yaml"), "--ckpt_path", str(run), "--clients", "[3, 5]"],
        capsys,
    )
    assert code == 0, err
    report = json.loads((run / "unlearn_report.json").read_text())
    assert report["clients"] == [3, 5]
    for key in (
        "client_steps",
        "retrain_client_steps",
        "predicted_client_steps",
        "seconds",
        "test_accuracy_before",
        "test_accuracy_after",
        "retrained_shards",
    ):
        assert key in report
    assert report["predicted_client_steps"] == report["client_steps"]

    code, out, err = _run(["audit", "--config", str(run / "config.yaml"), "--ckpt_path", str(run)], capsys)
    assert code == 0, err
    assert "audit PASSED" in out


def test_fit_without_config_uses_digits_defaults(capsys):
    code, out, _ = _run(["fit", "--print_config"], capsys)
    assert code == 0
    cfg = yaml.safe_load(out)
    assert cfg["data"]["class_path"].endswith("DigitsDataModule")
    assert cfg["trainer"]["algorithm"] is None or "FedShard" in str(cfg["trainer"]["algorithm"])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["fit", "--trainer.no_such_key", "1"], "no_such_key"),
        (["fit", "--data.num_clients", "5000"], "num_clients"),
        (["fit", "--data.rho", "0"], "rho"),
        (["fit", "--data.rho", "-1"], "rho"),
        (["fit", "--trainer.algorithm.merge_rate", "1"], "merge_rate"),
        (["fit", "--trainer.algorithm.t0", "9", "--trainer.algorithm.t1", "3"], "t0"),
        (["fit", "--trainer.algorithm.batch_size", "0"], "batch_size"),
        (["fit", "--model", "_models.CumulativeBNMLP"], "momentum=None"),
        (["fit", "--model", "_models.PlateauMLP"], "ReduceLROnPlateau"),
        (["fit", "--model", "_models.LBFGSMLP"], "LBFGS"),
        (["unlearn", "--ckpt_path", "/nonexistent/run", "--clients", "[1]"], "ckpt_path"),
    ],
)
def test_one_line_errors(args, needle, capsys, run_root):
    code, _, err = _run(
        [*args, "--trainer.default_root_dir", str(run_root)] if args[0] == "fit" else args, capsys
    )
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in err


def test_plain_lightning_module_by_class_path(run_root, capsys):
    """A plain LightningModule (not FederatedModule) trains, says its path, logs its self.log values."""
    args = ["fit", *TINY, "--model", "_models.PlainMLP", "--model.num_classes", "10"]
    code, out, err = _run([*args, "--trainer.default_root_dir", str(run_root)], capsys)
    assert code == 0, err
    assert sum(line.startswith("local training: ") for line in out.splitlines()) >= 1
    header = (run_root / "version_0" / "logs" / "metrics.csv").read_text().splitlines()[0]
    assert "train_loss_logged" in header
    code, out, err = _run(
        [
            "audit",
            "--config",
            str(run_root / "version_0" / "config.yaml"),
            "--ckpt_path",
            str(run_root / "version_0"),
        ],
        capsys,
    )
    assert code == 0, err
    assert "audit PASSED" in out
