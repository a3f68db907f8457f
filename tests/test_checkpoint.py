"""The trained model used from Python: ``load_model(RUN)`` and ``YourModule.load_from_checkpoint(RUN/model.ckpt)``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from _cli import cli
from _tiny import tiny_data, tiny_trainer
from safetensors.torch import load_file

import fedshard_lightning
from fedshard_lightning.cli import FederatedCLI
from fedshard_lightning.data import DigitsDataModule
from fedshard_lightning.models import MLP

ROOT = Path(__file__).resolve().parent.parent
# configs/digits.yaml at 8 clients and at most 3 rounds a shard (rounds: auto's cap)
SMALL = ("--data.num_clients", "8", "--trainer.algorithm.max_rounds", "3")


def _fit_digits(root: Path, *extra: str) -> Path:
    code, out, err = cli(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "digits.yaml"),
            "--trainer.default_root_dir",
            str(root),
            "--trainer.enable_progress_bar",
            "false",
            *extra,
        ]
    )
    assert code == 0, err
    return Path(re.search(r"run directory: (\S+)", out).group(1))


def _accuracy(model: torch.nn.Module, config: dict) -> float:
    """Test accuracy by a plain forward of the loaded model on the run's data (no trainer code)."""
    data = DigitsDataModule(**config["data"]["init_args"])
    data.setup("fit")
    x, y = data.test_data(torch.float32)
    with torch.no_grad():
        return (model(x).argmax(-1) == y).double().mean().item()


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """What these tests load and refit does not depend on the size (as shipped: about 30 s a fit)."""
    return _fit_digits(tmp_path_factory.mktemp("ckpt"), *SMALL)


def test_both_ways_give_the_deployed_model_and_test_accuracy(digits_run):
    run = digits_run
    raw = torch.load(run / "model.ckpt", weights_only=True)  # no pickled objects
    assert raw["hyper_parameters"]["num_classes"] == 10
    assert raw["hyper_parameters"]["input_shape"] == [1, 8, 8]
    by_config = fedshard_lightning.load_model(run)
    by_ckpt = MLP.load_from_checkpoint(run / "model.ckpt", weights_only=True)
    assert type(by_config) is MLP and not by_config.training
    deployed = load_file(str(run / "model.safetensors"))
    a, b = by_config.state_dict(), by_ckpt.state_dict()
    assert a.keys() == b.keys() == deployed.keys()
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], deployed[k]) for k in a)
    code, out, err = cli(["test", "--ckpt_path", str(run)])
    assert code == 0, err
    printed = float(re.search(r"test_accuracy=(\d\.\d+)", out).group(1))
    config = yaml.safe_load((run / "config.yaml").read_text())
    acc = _accuracy(by_config, config)
    assert acc == pytest.approx(printed, abs=5e-5)
    assert _accuracy(by_ckpt.eval(), config) == acc


def test_config_yaml_records_the_resolved_shapes(digits_run):
    config = yaml.safe_load((digits_run / "config.yaml").read_text())
    assert config["model"]["init_args"]["num_classes"] == 10
    assert config["model"]["init_args"]["input_shape"] == [1, 8, 8]
    model = FederatedCLI(args=["--config", str(digits_run / "config.yaml")], run=False).model
    model.configure_model()  # builds from the config alone, no data needed
    assert sum(p.numel() for p in model.parameters()) == 64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10


def test_a_fit_from_the_runs_config_reproduces_its_model(digits_run, tmp_path):
    again = _fit_digits(tmp_path, "--config", str(digits_run / "config.yaml"))
    first, second = (
        load_file(str(digits_run / "model.safetensors")),
        load_file(str(again / "model.safetensors")),
    )
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_unlearn_and_repair_rewrite_model_ckpt(tmp_path):
    run = _fit_digits(tmp_path, *SMALL)
    before = torch.load(run / "model.ckpt", weights_only=True)["state_dict"]
    code, _, err = cli(["unlearn", "--ckpt_path", str(run), "--clients", "[2]"])
    assert code == 0, err
    after = torch.load(run / "model.ckpt", weights_only=True)["state_dict"]
    deployed = load_file(str(run / "model.safetensors"))
    assert all(torch.equal(after[k], deployed[k]) for k in deployed)
    assert not all(torch.equal(after[k], before[k]) for k in before)
    (run / "model.ckpt").unlink()
    code, out, err = cli(["test", "--ckpt_path", str(run)])
    assert code == 0 and "model.ckpt differed from the cache or was missing" in out, err
    repaired = torch.load(run / "model.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(repaired[k], after[k]) for k in after)
    assert not list(run.glob(".model.ckpt*"))  # written atomically: no temporary left


def test_float64_weights_load_as_float64(tmp_path):
    torch.manual_seed(0)
    tr = tiny_trainer(tmp_path, precision="64-true")
    tr.fit(MLP(hidden=(16,), lr=0.1), tiny_data())
    model = MLP.load_from_checkpoint(tr.run_dir / "model.ckpt")
    ckpt = torch.load(tr.run_dir / "model.ckpt", weights_only=True)["state_dict"]
    assert all(v.dtype == torch.float64 and torch.equal(v, ckpt[k]) for k, v in model.state_dict().items())


def test_a_run_without_config_names_the_checkpoint(tmp_path):
    torch.manual_seed(0)
    tr = tiny_trainer(tmp_path)
    tr.fit(MLP(hidden=(16,), lr=0.1), tiny_data())
    with pytest.raises(Exception, match=r"no config\.yaml .*load_from_checkpoint"):
        fedshard_lightning.load_model(tr.run_dir)


def test_readme_snippets_load_the_run(digits_run):
    text = (ROOT / "README.md").read_text().split("## Using the trained model", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) == 2 and all(len(b.strip().splitlines()) <= 3 for b in blocks)
    loaded = []
    for block in blocks:
        namespace: dict = {}
        exec(block.replace("runs/version_0", str(digits_run)), namespace)
        loaded.append(namespace["model"])
    a, b = (m.state_dict() for m in loaded)
    assert all(torch.equal(a[k], b[k]) for k in a) and not loaded[1].training


def test_recorded_shapes_keep_the_fingerprint_of_open_ones():
    from fedshard_lightning.module import bind_model
    from fedshard_lightning.run.fingerprint import fingerprint
    from fedshard_lightning.unlearning import FedShard

    data = tiny_data()

    def fp(**shapes):
        model = MLP(hidden=(16,), **shapes)
        bind_model(model, data.input_shape, data.num_classes)
        return fingerprint(model, data, FedShard(), 0)

    assert fp() == fp(num_classes=4, input_shape=[10]) == fp(num_classes=4)
    assert fp() != fp(num_classes=5)  # a wider head is another model


def test_a_config_without_shapes_takes_them_from_its_data(digits_run, tmp_path):
    run = tmp_path / "older"
    shutil.copytree(digits_run, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    for key in ("num_classes", "input_shape"):
        del config["model"]["init_args"][key]
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    a, b = (
        fedshard_lightning.load_model(run).state_dict(),
        fedshard_lightning.load_model(digits_run).state_dict(),
    )
    assert all(torch.equal(a[k], b[k]) for k in b)
