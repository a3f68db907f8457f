"""``--trainer.fast_dev_run true``: one round of one stage on a few clients, one line, nothing saved."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
from _cli import cli
from _models import ExplodingMLP
from _tiny import tiny_data

from fedshard_lightning.errors import NonFiniteLossError
from fedshard_lightning.models import MLP
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.trainer.dev_run import DEV_CLIENTS
from fedshard_lightning.unlearning import FedShard

ROOT = Path(__file__).resolve().parent.parent


def _leftovers() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("fedshard-fast-dev-run-*"))


def test_cli_dev_run_prints_one_line_and_saves_nothing(tmp_path):
    before = _leftovers()
    root = tmp_path / "runs"
    args = ["fit", "--config", str(ROOT / "configs" / "digits.yaml"), "--trainer.default_root_dir", str(root)]
    code, out, err = cli([*args, "--trainer.fast_dev_run", "true"])
    assert code == 0, err
    dev = [line for line in out.splitlines() if line.startswith("fast_dev_run:")]
    assert (
        len(dev) == 1
        and "a dev run, nothing saved" in dev[0]
        and "1 round of 1 stage on clients [0, 1, 2, 3]" in dev[0]
    )
    assert "run directory" not in out
    assert not root.exists() and _leftovers() == before


def test_dev_run_trains_one_round_of_the_first_clients(tmp_path):
    data = tiny_data()
    torch.manual_seed(0)
    model = MLP(hidden=(16,), lr=0.1)
    algorithm = FedShard(rounds="fixed", fixed_rounds=3, batch_size=5, local_epochs=2)
    trainer = FederatedTrainer(
        algorithm=algorithm, default_root_dir=str(tmp_path / "runs"), fast_dev_run=True
    )
    result = trainer.fit(model, data)
    sizes = data.client_sizes[:DEV_CLIENTS]
    assert result["clients"] == list(range(DEV_CLIENTS))
    assert result["client_steps"] == sum(
        2 * math.ceil(n / 5) for n in sizes
    )  # one round, two epochs of batch 5
    assert math.isfinite(result["train_loss"]) and 0 <= result["test_accuracy"] <= 1
    assert not (tmp_path / "runs").exists()


def test_a_failing_step_fails_the_dev_run_and_leaves_nothing(tmp_path):
    before = _leftovers()
    torch.manual_seed(0)
    trainer = FederatedTrainer(
        default_root_dir=str(tmp_path / "runs"), fast_dev_run=True, enable_progress_bar=False
    )
    with pytest.raises(NonFiniteLossError):
        trainer.fit(ExplodingMLP(hidden=(8,)), tiny_data(classes=4, k=4))
    assert not (tmp_path / "runs").exists() and _leftovers() == before


def test_dev_run_with_ckpt_path_is_one_line_exit_2(tmp_path):
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "digits.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    code, _, err = cli([*args, "--trainer.fast_dev_run", "true", "--ckpt_path", str(tmp_path)])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "leave out --ckpt_path" in err, err
