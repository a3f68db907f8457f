"""The per-dataset configs in configs/ and ResNetGN, the CIFAR-100 model they use.

Every config must parse; CIFAR-100 must train end to end on a tiny dataset in the real file
format; a missing dataset must be a one-line error; ResNetGN must train the same stacked under
vmap as in the per-client loop.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from torch.func import functional_call, grad, vmap

from fedshard_lightning.cli import main
from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.models import ResNetGN

sys.path.insert(0, str(Path(__file__).parent / "data"))  # the native-format writers
from native_formats import cifar_tar_bytes

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))

#: config -> (datamodule class, model class, K, rho): the paper's settings, one file per dataset.
DATASETS = {
    "mnist.yaml": ("MNISTDataModule", "FedAvgCNN", 512, 0.1),
    "fmnist.yaml": ("FashionMNISTDataModule", "FedAvgCNN", 512, 0.1),
    "emnist.yaml": ("EMNISTDataModule", "FedAvgCNN", 512, 0.1),
    "cifar10.yaml": ("CIFAR10DataModule", "FedAvgCNN", 512, 0.1),
    "cifar100.yaml": ("CIFAR100DataModule", "ResNetGN", 512, 0.1),
    "svhn.yaml": ("SVHNDataModule", "FedAvgCNN", 512, 0.1),
    "adult.yaml": ("AdultDataModule", "MLP", 512, 0.9),  # rho=0.1 has no valid partition (header)
    "purchase.yaml": ("Purchase100DataModule", "MLP", 512, 0.1),
}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy CI machine the OpenMP
    workers of two threads can make each small convolution 20x slower; restore afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(args, capsys):
    code = 0
    try:
        main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def _error_lines(err: str) -> list[str]:
    """stderr without Lightning's 'Seed set to 0' info line."""
    return [line for line in err.splitlines() if line.strip() and not line.startswith("Seed set")]


# -- configs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS)
def test_config_parses_alone(config, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = _run(["fit", "--config", f"configs/{config}", "--print_config"], capsys)
    assert code == 0, err
    assert "class_path" in out


def test_every_dataset_has_a_config():
    assert set(DATASETS) <= set(CONFIGS)


@pytest.mark.parametrize("config", sorted(DATASETS))
def test_dataset_config_is_complete(config, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = _run(["fit", "--config", f"configs/{config}", "--print_config"], capsys)
    assert code == 0, err
    cfg = yaml.safe_load(out)
    data_cls, model_cls, k, rho = DATASETS[config]
    assert cfg["data"]["class_path"] == f"fedshard_lightning.data.{data_cls}"
    assert cfg["model"]["class_path"] == f"fedshard_lightning.models.{model_cls}"
    data = cfg["data"]["init_args"]
    assert (data["num_clients"], data["partition"], data["rho"]) == (k, "dirichlet", rho)
    assert data["data_dir"] == "data"
    assert data["download"] is True  # Purchase-100 reads a hand-placed archive; fetching needs archive_sha256
    algo = cfg["trainer"]["algorithm"]
    assert algo["class_path"] == "fedshard_lightning.unlearning.FedShard"
    assert algo["init_args"]["merge_rate"] == 2
    assert (algo["init_args"]["merge"], algo["init_args"]["rounds"]) == ("a1", "auto")  # the paper's FedShard
    header = (ROOT / "configs" / config).read_text().split("\nseed_everything")[0]
    assert f"--config configs/{config}" in header, "the header gives the command"
    assert "Expected test accuracy" in header


# -- CLI runs on native-format files -------------------------------------------------------------
def test_cifar100_config_fits_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    data_dir = tmp_path / "datasets"
    archive = data_dir / "cifar100" / "cifar-100-python.tar.gz"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(cifar_tar_bytes("cifar100", n_per_batch=40)[0])  # 200 train, 40 test
    runs = tmp_path / "runs"
    args = [
        "fit",
        "--config",
        "configs/cifar100.yaml",
        "--data.data_dir",
        str(data_dir),
        "--data.download",
        "false",
        "--data.num_clients",
        "4",
        "--data.min_client_size",
        "1",
        "--model.depth",
        "8",
        "--model.width",
        "4",
        "--model.groups",
        "2",
        "--trainer.algorithm.max_rounds",
        "1",
        "--trainer.algorithm.batch_size",
        "8",
        "--trainer.accelerator",
        "cpu",
        "--trainer.default_root_dir",
        str(runs),
        "--trainer.enable_progress_bar",
        "false",
    ]
    code, _, err = _run(args, capsys)
    assert code == 0, err
    run = runs / "version_0"
    assert (run / "model.safetensors").is_file()
    metrics = json.loads((run / "metrics.json").read_text())
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["class_path"].endswith("ResNetGN")


@pytest.mark.parametrize(
    ("config", "dataset", "folder"),
    [("cifar100.yaml", "CIFAR-100", "cifar100"), ("mnist.yaml", "MNIST", "mnist")],
)
def test_missing_dataset_is_one_line_error(config, dataset, folder, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [
        "fit",
        "--config",
        f"configs/{config}",
        "--data.data_dir",
        str(empty),
        "--data.download",
        "false",
        "--trainer.accelerator",
        "cpu",
        "--trainer.default_root_dir",
        str(tmp_path / "runs"),
        "--trainer.enable_progress_bar",
        "false",
    ]
    code, _, err = _run(args, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    lines = _error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert dataset in lines[0] and str(empty / folder) in lines[0]


# -- ResNetGN --------------------------------------------------------------------------------------
def _resnet(shape=(3, 32, 32), classes=100, **kw) -> ResNetGN:
    torch.manual_seed(0)
    m = ResNetGN(**kw)
    m.bind_data(shape, classes)
    return m


@pytest.mark.parametrize(
    ("depth", "width", "expected"),
    [(8, 16, 83_892), (20, 16, 278_324), (8, 32, 320_260), (20, 32, 1_096_196)],
)
def test_resnet_parameter_count_as_documented(depth, width, expected):
    m = _resnet(depth=depth, width=width)
    assert sum(p.numel() for p in m.parameters()) == expected
    assert f"{expected:,}" in ResNetGN.__doc__


def test_resnet_keeps_no_statistics_and_no_dropout():
    m = _resnet(depth=14)
    assert list(m.buffers()) == []
    assert not any(isinstance(x, (nn.modules.batchnorm._BatchNorm, nn.Dropout)) for x in m.modules())
    assert sum(isinstance(x, nn.GroupNorm) for x in m.modules()) == 1 + 2 * 6 + 2  # stem, blocks, 2 shortcuts
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 100)
    assert _resnet((1, 28, 28), 10)(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_resnet_vmap_over_stacked_parameters_matches_loop():
    m = _resnet((3, 16, 16), 7, depth=8, width=8, groups=4, zero_init_residual=False)
    base = {k: v.detach() for k, v in m.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    clients = [{k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()} for _ in range(3)]
    stacked = stack_params(clients)
    x = torch.randn(3, 5, 3, 16, 16, generator=gen)
    y = torch.randint(0, 7, (3, 5), generator=gen)

    def loss(params, xb, yb):
        return nn.functional.cross_entropy(functional_call(m, params, (xb,)), yb)

    logits = vmap(lambda p, xb: functional_call(m, p, (xb,)))(stacked, x)
    grads = vmap(grad(loss))(stacked, x, y)
    for c in range(3):
        torch.testing.assert_close(logits[c], functional_call(m, clients[c], (x[c],)), rtol=1e-4, atol=1e-5)
        ref = grad(loss)(clients[c], x[c], y[c])
        for k in ref:
            torch.testing.assert_close(grads[k][c], ref[k], rtol=1e-4, atol=1e-5)


def test_resnet_engine_stacked_equals_loop_float32():
    dm = SyntheticDataModule(
        num_clients=3,
        partition="dirichlet",
        rho=0.5,
        min_client_size=5,
        num_samples=60,
        num_test=20,
        shape=(3, 8, 8),
        num_classes_=4,
    )
    dm.setup()
    m = _resnet((3, 8, 8), 4, depth=8, width=4, groups=2, lr=0.05, momentum=0.5)
    sched = LocalSchedule(batch_size=6, local_epochs=1)

    def train(mode):
        eng = FederatedEngine(m, dm, sched, seed=1, vectorize=mode)
        init = stack_params([eng.module_params()])
        return eng.train_groups(init, [Group(0, (0, 1, 2), 2)], stage=1)

    a, b = train("always"), train("never")
    assert a.client_steps == b.client_steps > 0
    diff = max(float((a.params[k] - b.params[k]).abs().max()) for k in a.params)
    assert diff <= 1e-5  # float32: only the summation order of batched kernels differs
    moved = max(float((a.params[k][0] - v).abs().max()) for k, v in m.state_dict().items())
    assert moved > 1e-3  # it trained


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(depth=9), r"6n \+ 2"),
        (dict(depth=2), r"6n \+ 2"),
        (dict(width=0), "width"),
        (dict(width=6, groups=4), "divides"),
    ],
)
def test_resnet_rejects_bad_settings(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        ResNetGN(**kwargs)


def test_resnet_refuses_vector_inputs():
    with pytest.raises(ConfigError, match="MLP"):
        ResNetGN(input_shape=(104,), num_classes=2)
