"""The side-by-side comparison writes the Table-2 analogue for every method."""

from __future__ import annotations

import csv
import json

import pytest

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.experiments.compare import COLUMNS, compare
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedAvg, FedShard


def _setting():
    data = SyntheticDataModule(
        num_clients=8, partition="iid", num_samples=96, num_test=40, shape=(6,), num_classes_=3
    )
    return MLP(hidden=(8,), lr=0.1), data


def test_compare_two_methods(tmp_path):
    model, data = _setting()
    res = compare(
        output_dir=str(tmp_path),
        algorithms=[FedShard(rounds="fixed", fixed_rounds=1, batch_size=5), FedAvg(rounds=2, batch_size=5)],
        model=model,
        data=data,
        clients=[1, 6],
        mia=False,
    )
    assert [r["method"] for r in res["rows"]] == ["fedshard", "fedavg"]
    rows = list(csv.DictReader((tmp_path / "compare.csv").read_text().splitlines()))
    assert [r["method"] for r in rows] == ["fedshard", "fedavg"]
    for r in res["rows"]:
        assert r["client_steps"] > 0 and r["t"] >= 0 and r["M_p"] is not None and r["M_e"] is not None
    fedshard, fedavg = res["rows"]
    assert fedshard["client_steps"] < fedavg["client_steps"]  # retraining only the affected shards
    md = (tmp_path / "compare.md").read_text()
    assert all(c in md for c in COLUMNS) and "[1, 6]" in md
    assert json.loads((tmp_path / "compare.json").read_text())["clients"] == [1, 6]


def test_compare_rejects_unknown_clients(tmp_path):
    model, data = _setting()
    with pytest.raises(ConfigError, match="unknown client ids"):
        compare(output_dir=str(tmp_path), algorithms=[FedAvg(rounds=1)], model=model, data=data, clients=[99])


def test_compare_config_parses(capsys):
    from pathlib import Path

    from fedshard_lightning.experiments.compare import main

    config = Path(__file__).resolve().parents[2] / "configs" / "compare" / "digits.yaml"
    with pytest.raises(SystemExit) as e:
        main(["--config", str(config), "--print_config"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("FedShard", "FedAvg", "FATS", "FedEraser", "RapidRetrain", "FedRecover"):
        assert f"fedshard_lightning.unlearning.{name}" in out
