"""The paper's Table 2 configs and the claims table's configs parse, as they ship."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "compare"


@pytest.mark.parametrize("name", ["mnist", "fmnist", "cifar10", "cifar100"])
def test_table2_config_parses(name, capsys):
    from fedshard_lightning.experiments.compare import main

    with pytest.raises(SystemExit) as e:
        main(["--config", str(CONFIGS / f"{name}.yaml"), "--print_config"])
    assert e.value.code == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["accelerator"] == "auto"  # a GPU when there is one, unchanged
    assert out["data"]["init_args"]["num_clients"] == 512
    assert out["data"]["init_args"]["rho"] == 0.1
    assert out["mia_attack"] == "calibrated"
    methods = [a["class_path"].rsplit(".", 1)[1] for a in out["algorithms"]]
    assert methods == ["FedShard", "FedAvg", "FedEraser", "RapidRetrain", "FATS", "FedRecover"]
    fs = out["algorithms"][0]["init_args"]
    assert (fs["merge_rate"], fs["merge"], fs["rounds"]) == (2, "a1", "auto")  # the paper's FedShard


@pytest.mark.parametrize("name", ["digits_claims", "digits_claims_ablation"])
def test_claims_compare_configs_parse(name, capsys):
    from fedshard_lightning.experiments.compare import main

    with pytest.raises(SystemExit) as e:
        main(["--config", str(CONFIGS / f"{name}.yaml"), "--print_config"])
    assert e.value.code == 0


def test_claims_cascade_config_parses():
    from fedshard_lightning.experiments.cascade import main

    with pytest.raises(SystemExit) as e:
        main(["--config", str(CONFIGS / "digits_claims_cascade.yaml"), "--print_config"])
    assert e.value.code == 0
