"""The experiments' shared setting: ``seed`` seeds the data split of a configured datamodule too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.experiments.common import ExperimentSetting
from fedshard_lightning.init_args import init_args


def _data(seed: int = 0, **kw) -> SyntheticDataModule:
    return SyntheticDataModule(
        num_clients=8,
        partition="label_split",
        num_samples=128,
        num_test=40,
        shape=(6,),
        num_classes_=4,
        seed=seed,
        **kw,
    )


def _split(dm) -> list[list[int]]:
    dm.setup("fit")
    return [p.tolist() for p in dm.client_indices]


def test_seed_sets_the_configured_datamodule_split(tmp_path):
    # Reference: the datamodule built with that seed directly.
    given = _data(0)
    setting = ExperimentSetting.build(tmp_path, None, None, given, 8, 0.75, seed=1)
    assert setting.datamodule.seed == 1
    assert _split(setting.datamodule) == _split(_data(1))
    assert _split(_data(0)) != _split(_data(1))
    assert given.seed == 0  # the caller's template is not changed
    assert init_args(setting.datamodule)["init_args"]["seed"] == 1  # what the run records
    ready = _data(0)
    ready.setup("fit")
    again = ExperimentSetting.build(tmp_path, None, None, ready, 8, 0.75, seed=1).datamodule
    assert _split(again) == _split(_data(1))


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True])
def test_bad_seed_is_a_config_error(tmp_path, seed):
    with pytest.raises(ConfigError, match="seed"):
        ExperimentSetting.build(tmp_path, None, None, _data(), 8, 0.75, seed=seed)


def test_compare_records_the_seed_each_run_used(tmp_path):
    # compare repeats over seeds; each run's cache/FINGERPRINT must name the data seed it used.
    from fedshard_lightning.experiments.compare import compare
    from fedshard_lightning.models import MLP
    from fedshard_lightning.unlearning import FedShard

    data = SyntheticDataModule(
        num_clients=4, partition="iid", num_samples=32, num_test=16, shape=(4,), num_classes_=2
    )
    res = compare(
        output_dir=str(tmp_path),
        algorithms=[FedShard(rounds="fixed", fixed_rounds=1, batch_size=8)],
        model=MLP(hidden=(4,), lr=0.1),
        data=data,
        clients=[1],
        seeds=[3],
        mia=False,
    )
    fingerprint = json.loads((Path(res["rows"][0]["run_dir"]) / "cache" / "FINGERPRINT").read_text())
    assert fingerprint["body"]["data_settings"]["init_args"]["seed"] == 3


def test_holdout_needs_held_out_samples(tmp_path):
    # holdout: true on data without held-out samples had given NaN drops: nobody poisoned, no
    # cascade, whatever happened.
    with pytest.raises(ConfigError, match="holdout_fraction"):
        ExperimentSetting.build(tmp_path, None, None, _data(), 8, 0.75, seed=0, holdout=True)
    held = _data(holdout_fraction=0.25)
    assert ExperimentSetting.build(tmp_path, None, None, held, 8, 0.75, seed=0, holdout=True).holdout
