"""The engine and exact unlearning on a CUDA device (marked ``cuda``; skipped without a GPU).

Run where a GPU is lent with ``python -m pytest -m cuda tests/engine/test_cuda.py``
(``benchmarks/device_check.sh`` does). The references are the per-client loop on the same device
(float64), a client trained alone (float32, bit for bit) and the CPU (cache round trip).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.models import MLP, FedAvgCNN
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

CUDA = "cuda"


@pytest.fixture(autouse=True, scope="module")
def _process_settings():
    """What the trainer applies at launch (deterministic cuDNN algorithms)."""
    from fedshard_lightning.engine.allocator import configure_process

    configure_process(CUDA)


def _data(k=8, shape=(10,), per_client=20, device=CUDA):
    dm = SyntheticDataModule(
        num_clients=k,
        partition="dirichlet",
        rho=0.5,
        min_client_size=5,
        num_samples=k * per_client,
        num_test=40,
        shape=shape,
        num_classes_=4,
        as_uint8=len(shape) == 3,
    )
    dm.setup()
    return dm.to(device)


def _model(dm, cls, dtype, device=CUDA):
    torch.manual_seed(0)
    m = cls(hidden=(16,), lr=0.1, momentum=0.5) if cls is MLP else cls(lr=0.05)
    m.bind_data(dm.input_shape, dm.num_classes)
    return m.to(device=device, dtype=dtype)


def _train(m, dm, mode, rounds=2):
    eng = FederatedEngine(m, dm, LocalSchedule(batch_size=5), seed=1, vectorize=mode)
    k = len(dm.client_indices)
    groups = [Group(0, tuple(range(k // 2)), rounds), Group(1, tuple(range(k // 2, k)), rounds - 1)]
    init = stack_params([eng.module_params()] * 2)
    return eng, eng.train_groups(init, groups, stage=1)


@pytest.mark.parametrize("cls", [MLP, FedAvgCNN])
def test_stacked_equals_loop_float64(cls):
    dm = _data(shape=(10,) if cls is MLP else (1, 28, 28))
    _, stacked = _train(_model(dm, cls, torch.float64), dm, "always")
    _, loop = _train(_model(dm, cls, torch.float64), dm, "never")
    assert stacked.params[next(iter(stacked.params))].device.type == "cuda"
    diff = max(float((stacked.params[k] - loop.params[k]).abs().max()) for k in stacked.params)
    assert diff <= 1e-10
    assert stacked.client_steps == loop.client_steps


@pytest.mark.parametrize("cls", [MLP, FedAvgCNN])
def test_client_result_independent_of_chunk_neighbours_float32(cls):
    """Client 1 trained alone and beside others gives the same float32 bits (fixed-shape calls)."""
    from fedshard_lightning.engine.local import ClientBatch

    dm = _data(shape=(10,) if cls is MLP else (1, 28, 28))
    eng = FederatedEngine(
        _model(dm, cls, torch.float32), dm, LocalSchedule(batch_size=5), seed=1, vectorize="always"
    )
    eng.set_mode("stacked")
    assert eng.invariant_block() == 64
    start = stack_params([eng.module_params()])
    alone = eng._run_local(start, torch.zeros(1, dtype=torch.long, device=CUDA), ClientBatch([1], [0], 1, 0))
    for cl in ([1, 2, 3, 7, 4, 5], [0, 5, 5, 1, 6, 2, 3, 4], [7, 6, 5, 4, 3, 2, 0, 1]):
        rows = torch.zeros(len(cl), dtype=torch.long, device=CUDA)
        res = eng._run_local(start, rows, ClientBatch(cl, [0] * len(cl), 1, 0))
        for k in alone.params:
            assert torch.equal(alone.params[k][0], res.params[k][cl.index(1)]), (cl, k)


def _trainer(root, accelerator=CUDA, vectorize="always", tf32=None):
    return FederatedTrainer(
        tf32=tf32,
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=5),
        accelerator=accelerator,
        default_root_dir=str(root),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize=vectorize,
    )


def _fresh(cls, shape, k=8):
    dm = SyntheticDataModule(
        num_clients=k,
        partition="dirichlet",
        rho=0.5,
        min_client_size=5,
        num_samples=k * 20,
        num_test=40,
        shape=shape,
        num_classes_=4,
        as_uint8=len(shape) == 3,
    )
    torch.manual_seed(0)
    return (MLP(hidden=(16,), lr=0.1, momentum=0.5) if cls is MLP else cls(lr=0.05)), dm


@pytest.mark.parametrize("vectorize", ["always", "never"])
@pytest.mark.parametrize("cls", [MLP, FedAvgCNN])
def test_float32_unlearning_audits_bit_exact(tmp_path, cls, vectorize):
    shape = (10,) if cls is MLP else (1, 28, 28)
    tr = _trainer(tmp_path, vectorize=vectorize)
    tr.fit(*_fresh(cls, shape))
    run = str(tr.run_dir)
    _trainer(tmp_path, vectorize=vectorize).unlearn(*_fresh(cls, shape), run, [3])
    res = _trainer(tmp_path, vectorize=vectorize).audit(*_fresh(cls, shape), run, tolerance=0.0)
    assert res["max_abs_diff"] == 0.0
    _trainer(tmp_path, vectorize=vectorize).unlearn(*_fresh(cls, shape), run, [0, 6])
    res = _trainer(tmp_path, vectorize=vectorize).audit(*_fresh(cls, shape), run, tolerance=0.0)
    assert res["max_abs_diff"] == 0.0


def test_cache_round_trip_cuda_cpu_cuda(tmp_path):
    """A CUDA run is read, unlearned and committed on the CPU, then read back on CUDA unchanged."""
    tr = _trainer(tmp_path)
    tr.fit(*_fresh(MLP, (10,)))
    run = tr.run_dir
    cuda_model = load_file(str(run / "model.safetensors"))
    cpu_metrics = _trainer(tmp_path, accelerator="cpu").test(*_fresh(MLP, (10,)), str(run))
    cuda_metrics = _trainer(tmp_path).test(*_fresh(MLP, (10,)), str(run))
    assert cpu_metrics["test_accuracy"] == pytest.approx(cuda_metrics["test_accuracy"], abs=1e-6)
    _trainer(tmp_path, accelerator="cpu").unlearn(*_fresh(MLP, (10,)), str(run), [2])
    cpu_model = load_file(str(run / "model.safetensors"))
    assert any(not torch.equal(cuda_model[k], cpu_model[k]) for k in cuda_model)
    after = _trainer(tmp_path).test(*_fresh(MLP, (10,)), str(run))
    again = _trainer(tmp_path, accelerator="cpu").test(*_fresh(MLP, (10,)), str(run))
    assert after["test_accuracy"] == pytest.approx(again["test_accuracy"], abs=1e-6)


def test_compiled_step_equals_eager_float64():
    dm = _data()
    out = {}
    for compiled in (False, True):
        eng = FederatedEngine(
            _model(dm, MLP, torch.float64),
            dm,
            LocalSchedule(batch_size=5),
            seed=1,
            vectorize="always",
            compile=compiled,
        )
        k = len(dm.client_indices)
        groups = [Group(0, tuple(range(k // 2)), 2), Group(1, tuple(range(k // 2, k)), 1)]
        out[compiled] = eng.train_groups(stack_params([eng.module_params()] * 2), groups, stage=1).params
    assert max(float((out[True][k] - out[False][k]).abs().max()) for k in out[True]) <= 1e-10


def test_tf32_false_gives_ieee_convolutions_and_matmuls():
    """torch runs cuDNN convolutions in TF32 by default; ``tf32=False`` holds them to IEEE.

    TF32 keeps 10 mantissa bits: its relative error on these sums is ~3e-4; IEEE float32's ~1e-6.
    """
    from fedshard_lightning.engine.allocator import configure_process
    from fedshard_lightning.engine.kernels.fx import stacked_conv2d

    configure_process(CUDA, tf32=False)

    gen = torch.Generator().manual_seed(0)
    c, b = 8, 10
    x = torch.randn(c * b, 32, 16, 16, generator=gen)
    w = torch.randn(c, 64, 32, 5, 5, generator=gen) * 0.1
    a, m = torch.randn(c, 64, 512, generator=gen), torch.randn(c, 512, 64, generator=gen)

    def rel(got, want):
        return float((got.double() - want).abs().max() / want.abs().max())

    want_conv = stacked_conv2d(x.double(), w.double(), None, 1, 2, 1)
    got_conv = stacked_conv2d(x.to(CUDA), w.to(CUDA), None, 1, 2, 1).cpu()
    g = torch.randn(c * b, 64, 16, 16, generator=gen)

    def weight_grad(cast):  # the gradient of one client's 5x5 convolution weight, padding 2
        args = (cast(g), cast(x), cast(w[0]), None, [1, 1], [2, 2], [1, 1], False, [0, 0], 1)
        return torch.ops.aten.convolution_backward(*args, [False, True, False])[1].cpu()

    want_gw = weight_grad(torch.Tensor.double)
    got_gw = weight_grad(lambda t: t.to(CUDA))
    assert rel(got_conv, want_conv) < 2e-5
    assert rel(got_gw, want_gw) < 2e-5
    assert rel(torch.bmm(a.to(CUDA), m.to(CUDA)).cpu(), torch.bmm(a.double(), m.double())) < 2e-5
    configure_process(CUDA)


def test_tf32_run_is_recorded_reproduced_and_audits_bit_exact(tmp_path):
    """``trainer.tf32``: fit records it; unlearn and audit without it reuse it, and stay bit-exact."""
    import json

    from fedshard_lightning.engine.allocator import configure_process

    try:
        tr = _trainer(tmp_path, tf32=True)
        tr.fit(*_fresh(FedAvgCNN, (1, 28, 28)))
        run = str(tr.run_dir)
        assert json.loads((tr.run_dir / "numerics.json").read_text())["tf32"] == [True, True]
        configure_process(CUDA)
        un = _trainer(tmp_path)
        un.unlearn(*_fresh(FedAvgCNN, (1, 28, 28)), run, [3])
        assert any(
            n.startswith("tf32 (convolutions, matmuls): fit ran with [True, True]") for n in un.numerics_notes
        )
        assert torch.backends.cuda.matmul.allow_tf32
        configure_process(CUDA)
        res = _trainer(tmp_path).audit(*_fresh(FedAvgCNN, (1, 28, 28)), run, tolerance=0.0)
        assert res["max_abs_diff"] == 0.0
    finally:
        configure_process(CUDA)
