"""The trainer's options from Python: a bad value is a ConfigError naming the field, before any run starts."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from _tiny import tiny_data, tiny_model

from fedshard_lightning.errors import ConfigError
from fedshard_lightning.trainer import FederatedTrainer


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("seed", "a"),
        ("seed", -1),
        ("seed", 2**40),
        ("seed", 1.5),
        ("memory_budget_mb", "1"),
        ("max_chunk_clients", 2.5),
        ("num_threads", 2.5),
        ("eval_every_n_rounds", 1.5),
        ("eval_every_n_rounds", True),
        ("loggers", [object()]),
    ],
)
def test_bad_option_names_its_field_at_construction(tmp_path, option, value):
    with pytest.raises(ConfigError, match=rf"^trainer\.{option}"):
        FederatedTrainer(default_root_dir=str(tmp_path), **{option: value})
    assert list(tmp_path.iterdir()) == []


def test_numpy_integers_are_integers(tmp_path):
    trainer = FederatedTrainer(seed=np.int64(3), num_threads=np.int32(1), max_chunk_clients=np.int64(4))
    assert (trainer.seed, trainer.num_threads, trainer.max_chunk_clients) == (3, 1, 4)
    assert all(type(v) is int for v in (trainer.seed, trainer.num_threads, trainer.max_chunk_clients))


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed")
def test_accelerator_without_its_package_is_a_config_error(tmp_path):
    trainer = FederatedTrainer(accelerator="tpu", default_root_dir=str(tmp_path), enable_progress_bar=False)
    with pytest.raises(ConfigError, match=r"trainer\.accelerator='tpu'.*torch_xla"):
        trainer.fit(tiny_model(), tiny_data())
    assert list(tmp_path.iterdir()) == []
