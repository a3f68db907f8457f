"""The stackable configs of ``callbacks/``: each parses, stacks with configs/digits.yaml and runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from _cli import cli

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "callbacks").glob("*.yaml"))
# Small enough for a test: 8 clients, at most 2 rounds a shard (rounds: auto's cap; the configs
# under test are unchanged).
TINY = ["--data.num_clients", "8", "--trainer.algorithm.max_rounds", "2"]


def test_there_are_at_least_the_three_documented_configs():
    assert {"wandb.yaml", "fairness_replay.yaml", "quiet.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_config_has_a_header_and_stacks_with_digits_under_print_config(path, tmp_path):
    text = path.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert text.startswith("# ") and len(header) >= 2, "a header comment says what it adds"
    assert f"--config callbacks/{path.name}" in text, "the header shows how to stack it"
    settings = yaml.safe_load(text)
    assert set(settings) == {"trainer"}, "it only adds trainer settings, so it stacks with any config"
    code, out, err = cli(
        ["fit", "--config", str(REPO / "configs" / "digits.yaml"), "--config", str(path), "--print_config"]
    )
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed["data"]["class_path"] == "fedshard_lightning.data.DigitsDataModule"
    for key, value in settings["trainer"].items():
        if key == "callbacks":
            assert [c["class_path"] for c in printed["trainer"]["callbacks"]] == [
                c["class_path"] for c in value
            ]
        else:
            assert printed["trainer"][key] == value, key


def _fit(tmp_path: Path, name: str) -> tuple[Path, str]:
    root = tmp_path / "runs"
    code, out, err = cli(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "digits.yaml"),
            "--config",
            str(REPO / "callbacks" / name),
            *TINY,
            "--trainer.default_root_dir",
            str(root),
        ]
    )
    assert code == 0, err
    (run,) = root.iterdir()
    return run, out


def _fairness_row(run: Path) -> dict[str, str]:
    with open(run / "logs" / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("fairness/M_e_steps")][-1]


def test_wandb_config_runs_and_logs_fairness_to_an_offline_wandb_run(tmp_path, monkeypatch):
    from callbacks.test_fairness_logger import _wandb_run

    # M_p's replay under the shipped client-step budget; the seconds budget is lifted, as a loaded
    # machine's slower fit would skip the replay for the load (tests/callbacks/test_fairness_logger.py)
    monkeypatch.setenv("FEDSHARD_REPLAY_BUDGET_S", "86400")

    run, _ = _fit(tmp_path, "wandb.yaml")
    summary, history, _ = _wandb_run(run)
    assert summary["fairness/M_e_steps"] == pytest.approx(float(_fairness_row(run)["fairness/M_e_steps"]))
    assert any("fairness/M_p" in h for h in history)


def test_fairness_replay_config_runs_and_writes_its_report_and_plots(tmp_path):
    run, _ = _fit(tmp_path, "fairness_replay.yaml")
    summary = json.loads((run / "fairness" / "summary.json").read_text())
    assert summary["mode"] == "measured" and summary["clients_unlearned"] == 8  # sample 16 > 8 clients
    assert summary["M_p"] is not None and summary["mia_f1_before"] is not None
    for name in ("cost_distribution.png", "round_accuracy.png", "clients.csv"):
        assert (run / "fairness" / name).stat().st_size > 0, name
    assert (run / "merges.jsonl").read_text().count("\n") == 3  # 8 clients, merge rate 2: 3 stages


def test_quiet_config_runs_without_progress_and_skips_the_replay_in_one_line(tmp_path):
    run, out = _fit(tmp_path, "quiet.yaml")
    assert "fit: stage" not in out and "round" not in out
    assert [line for line in out.splitlines() if line.startswith("fairness:")] == [
        line for line in out.splitlines() if "M_p skipped" in line
    ]
    row = _fairness_row(run)
    assert row["fairness/M_p_skipped"] == "1.0" and float(row["fairness/M_e_steps"]) >= 0


def test_checkpoint_config_runs_and_keeps_the_models_of_two_versions(tmp_path):
    run, _ = _fit(tmp_path, "checkpoint.yaml")
    versions = sorted(p.name for p in (run / "cache").iterdir() if (p / "manifest.json").is_file())
    pruned = json.loads((run / "cache" / "PRUNED").read_text())["versions"]
    assert len(versions) == 3 and sorted(pruned) == versions[:-2]  # 8 clients: 3 stages
