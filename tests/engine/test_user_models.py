"""Models as a Lightning user writes them: self.log, dropout, schedulers, plain LightningModule.

References: the per-client loop in float64 (stacked == loop <= 1e-10), a client trained alone
(neighbour independence, bit for bit in float32), and the audit's independent retraining
(tolerance 0.0 in float32).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _models import BNDropoutCNN, CumulativeBNMLP, DropoutCNN, FunctionalDropoutMLP, PlainMLP
from _tiny import tiny_data

from fedshard_lightning.data import SyntheticDataModule
from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, predict_logits, stack_params
from fedshard_lightning.engine.local import ClientBatch
from fedshard_lightning.engine.optim import RoundLR
from fedshard_lightning.engine.step_context import keyed_uniform, step_keys
from fedshard_lightning.errors import ContractError
from fedshard_lightning.models import ResNet18BN
from fedshard_lightning.module import bind_model
from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard

CASES = [(PlainMLP, (10,)), (DropoutCNN, (1, 8, 8)), (BNDropoutCNN, (1, 8, 8)), (ResNet18BN, (3, 16, 16))]
LOGGED = {
    PlainMLP: {"train_loss_logged"},
    DropoutCNN: {"train_acc", "logged_loss"},
    BNDropoutCNN: {"train_acc", "logged_loss"},
    ResNet18BN: set(),
}


def _data(shape):
    dm = tiny_data(shape)
    dm.setup()
    return dm


def _fresh(cls):
    torch.manual_seed(0)
    if cls is ResNet18BN:
        return cls(width=2, lr=0.05)  # tiny width keeps CPU time low
    return cls(lr=0.1) if issubclass(cls, DropoutCNN) else cls()


def _engine(cls, shape, mode, dtype=torch.float64):
    dm = _data(shape)
    m = _fresh(cls)
    bind_model(m, dm.input_shape, dm.num_classes)
    m = m.to(dtype)
    epochs = 1 if cls is ResNet18BN else 2
    return FederatedEngine(m, dm, LocalSchedule(batch_size=7, local_epochs=epochs), seed=1, vectorize=mode)


def _fit(eng):
    rounds = 2 if isinstance(eng.module, ResNet18BN) else 3
    groups = [Group(0, (0, 1, 2, 3), rounds), Group(1, (4, 5, 6, 7), rounds - 1)]
    return eng.train_groups(stack_params([eng.module_params()] * 2), groups, stage=1)


@pytest.mark.parametrize(("cls", "shape"), CASES)
def test_stacked_equals_loop_float64_with_logs(cls, shape):
    runs = {mode: _fit(_engine(cls, shape, mode)) for mode in ("always", "never")}
    a, b = runs["always"], runs["never"]
    assert max(float((a.params[k] - b.params[k]).abs().max()) for k in a.params) <= 1e-10
    for ha, hb in zip(a.history, b.history, strict=True):
        assert set(ha.metrics) == set(hb.metrics) == LOGGED[cls]
        for k in ha.metrics:
            assert abs(ha.metrics[k] - hb.metrics[k]) <= 1e-10


@pytest.mark.parametrize(("cls", "shape"), CASES)
def test_client_result_independent_of_chunk_neighbours(cls, shape):
    eng = _engine(cls, shape, "always", torch.float32)
    eng._mode = "stacked"
    start = stack_params([eng.module_params()])
    alone = eng._run_local(start, torch.zeros(1, dtype=torch.long), ClientBatch([1], [0], 1, 0))
    for cl in ([1, 2, 3, 7], [0, 5, 1, 6, 2, 3, 4], [7, 6, 5, 4, 3, 2, 0, 1]):
        res = eng._run_local(
            start, torch.zeros(len(cl), dtype=torch.long), ClientBatch(cl, [0] * len(cl), 1, 0)
        )
        i = cl.index(1)
        for k in alone.params:
            assert torch.equal(alone.params[k][0], res.params[k][i]), (cl, k)
        for k in alone.logs:
            assert torch.equal(alone.logs[k][0], res.logs[k][i]), (cl, k)


def test_dropout_masks_are_keyed_and_active():
    keys = step_keys(1, 2, [0, 0], 3, [4, 5], 2)
    assert len({int(k) for k in keys.ravel()}) == 4  # two clients x two steps, all distinct
    u = [keyed_uniform(torch.tensor(int(k)), 0, 4000, torch.float64) for k in keys.ravel()]
    assert all(0.45 < float(x.mean()) < 0.55 for x in u)
    assert not torch.equal(
        keyed_uniform(torch.tensor(7), 0, 50, torch.float64),
        keyed_uniform(torch.tensor(7), 1, 50, torch.float64),
    )
    with_dropout = _fit(_engine(DropoutCNN, (1, 8, 8), "always"))
    eng = _engine(DropoutCNN, (1, 8, 8), "always")
    for sub in eng.module.modules():
        if isinstance(sub, torch.nn.Dropout):
            sub.p = 0.0
    without = _fit(eng)
    assert max(float((with_dropout.params[k] - without.params[k]).abs().max()) for k in without.params) > 1e-4


def test_random_ops_outside_dropout_train_on_the_keyed_loop():
    dm = _data((10,))
    m = FunctionalDropoutMLP(hidden=(16,))
    bind_model(m, dm.input_shape, dm.num_classes)
    m = m.double()
    lines: list[str] = []
    results = []
    for _ in range(2):
        eng = FederatedEngine(m, dm, LocalSchedule(batch_size=5), seed=1, vectorize="always")
        eng.on_mode = lines.append
        state = torch.get_rng_state()
        results.append(_fit(eng))
        assert torch.equal(state, torch.get_rng_state())  # the user's generator is left alone
        assert eng.mode == "loop"
    assert "F.dropout" in lines[0] and lines[0].startswith("local training: per-client loop")
    for k in results[0].params:
        assert torch.equal(results[0].params[k], results[1].params[k])


def test_scheduler_is_stepped_once_per_round():
    eng = _engine(DropoutCNN, (1, 8, 8), "always")
    assert isinstance(eng.local.lr_at, RoundLR)
    assert [eng.local.lr_at(r)[0] for r in range(3)] == [0.1, 0.05, 0.025]
    assert eng.local.spec_at(2).groups[0][1]["lr"] == 0.025


def test_auto_says_which_path_and_why():
    eng = _engine(PlainMLP, (10,), "auto")
    lines: list[str] = []
    eng.on_mode = lines.append
    _fit(eng)
    assert len(lines) == 1 and "vectorize: auto; timed" in lines[0]
    assert ("vmap (a plain LightningModule)" in lines[0]) == (eng.mode == "stacked")


@pytest.mark.parametrize(("cls", "shape"), [(BNDropoutCNN, (1, 8, 8)), (ResNet18BN, (3, 16, 16))])
def test_batchnorm_statistics_are_per_client_averaged_and_used_in_eval(cls, shape):
    eng = _engine(cls, shape, "always")
    assert eng.buffer_names and all("running_" in n for n in eng.buffer_names)
    init = eng.module_params()
    res = eng.train_groups(
        stack_params([init]), [Group(0, (0, 1, 2, 3), 1)], stage=1, keep_client_params=True
    )
    info = res.history[-1]
    w = torch.as_tensor(eng.sizes[info.client_ids], dtype=torch.float64)
    for k in eng.buffer_names:
        client = info.client_params[k]
        assert not torch.equal(client[0], client[1])  # each client its own statistics
        want = (client * w.view(-1, *[1] * (client.ndim - 1))).sum(0) / w.sum()
        assert torch.allclose(res.params[k][0], want, rtol=0, atol=1e-12)  # FedAvg weights
        assert not torch.equal(res.params[k][0], init[k])
    # Evaluation uses the state's (aggregated) statistics, not the module's own buffers.
    x = eng.dm.gather(torch.arange(8).view(1, 8), eng.local.dtype)[0][0]
    model = {k: v[0] for k, v in res.params.items()}
    params_only = {k: v for k, v in model.items() if k in eng.names}
    assert not torch.allclose(
        predict_logits(eng.module, model, x), predict_logits(eng.module, params_only, x)
    )


def test_cumulative_batchnorm_refused_in_one_line():
    dm = _data((10,))
    with pytest.raises(ContractError, match=r"layer net\.2 \(BatchNorm1d\).*momentum=None") as err:
        bind_model(CumulativeBNMLP(), dm.input_shape, dm.num_classes)
    assert "\n" not in str(err.value)


def _trainer(root, vectorize):
    return FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=5),
        default_root_dir=str(root),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize=vectorize,
    )


# ResNet18BN on the per-client loop runs -m slow: BatchNorm on the loop is BNDropoutCNN's never
# case, ResNet18BN's layers are its stacked (always) case.
_EXACT = [
    pytest.param(
        cls,
        shape,
        vectorize,
        id=f"{cls.__name__}-{vectorize}",
        marks=pytest.mark.slow if cls is ResNet18BN and vectorize == "never" else (),
    )
    for cls, shape in CASES
    for vectorize in ("always", "never")
]


@pytest.mark.exactness
@pytest.mark.parametrize(("cls", "shape", "vectorize"), _EXACT)
def test_fit_unlearn_audit_bit_exact_float32(tmp_path, cls, shape, vectorize):
    def data():
        return tiny_data(shape)

    tr = _trainer(tmp_path, vectorize)
    tr.fit(_fresh(cls), data())
    assert LOGGED[cls] <= set(tr.history[0])  # the step's self.log values are round metrics
    run = str(tr.run_dir)
    _trainer(tmp_path, vectorize).unlearn(_fresh(cls), data(), run, [3])
    res = _trainer(tmp_path, vectorize).audit(_fresh(cls), data(), run, tolerance=0.0, reference=False)
    assert res["passed"] and res["max_abs_diff"] == 0.0


def test_readme_own_model_example_runs_as_written(tmp_path, monkeypatch):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)
    assert code, "README 'Your own model' has no python example"
    monkeypatch.chdir(tmp_path)
    exec(compile(code[0], "README.md", "exec"), {"__name__": "readme_example"})
    assert list(tmp_path.glob("lightning_logs/version_0/model.safetensors"))


def test_engines_over_one_module_share_its_step_context():
    """A second engine (e.g. an algorithm's calibration engine) must not unhook the first one's keys."""
    first = _engine(DropoutCNN, (1, 8, 8), "always")
    FederatedEngine(first.module, first.dm, LocalSchedule(batch_size=5), seed=1, vectorize="always")
    res = _fit(first)
    assert first.mode == "stacked"  # dropout still keyed under vmap, no fallback to the loop
    assert set(res.history[0].metrics) == LOGGED[DropoutCNN]


@pytest.mark.parametrize("vectorize", ["never", "always", "auto"])
def test_one_sample_batchnorm_batch_is_a_one_line_error(vectorize):
    """``auto``'s probe and ``always``'s check meet the one-sample batch first (they had raised torch's ValueError)."""
    dm = SyntheticDataModule(
        num_clients=2, partition="iid", num_samples=11, num_test=4, shape=(10,), num_classes_=4
    )
    dm.setup()

    class BN1d(PlainMLP):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(10, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4)
            )

    m = BN1d()
    bind_model(m, dm.input_shape, dm.num_classes)
    eng = FederatedEngine(m, dm, LocalSchedule(batch_size=5), seed=1, vectorize=vectorize)
    with pytest.raises(ContractError, match=r"one-sample batch \(stage 0, round 0.*nn\.GroupNorm"):
        eng.train_groups(stack_params([eng.module_params()]), [Group(0, (0, 1), 1)])
