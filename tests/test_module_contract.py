"""What ``bind_model`` accepts from a user's LightningModule, and what it refuses in one line.

Refused before training: training-loop hooks the engine never calls, manual optimization, a
buffer the training step changes (other than BatchNorm's statistics), fewer outputs than classes.
Supported as Lightning supports them: layers built in ``setup(stage)``, ``training_step(batch)``
without ``batch_idx`` (fit, unlearn and audit bit-exact in float32 on both paths; stacked equals
the loop in float64).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _tiny import tiny_data, tiny_trainer
from torch import nn

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, stack_params
from fedshard_lightning.errors import ContractError
from fedshard_lightning.module import bind_model


class Plain(L.LightningModule):
    """A plain LightningModule as a user writes it."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Hooked(Plain):
    def on_train_epoch_start(self) -> None:
        pass

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")


class Manual(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class RunningMean(Plain):
    """Updates a running input mean in the step: shared by all clients, so it would leak."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("xmean", torch.zeros(10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            self.xmean.mul_(0.9).add_(0.1 * x.mean(0))
        return F.cross_entropy(self(x - self.xmean), y)


class ConstantBufferBN(Plain):
    """A constant buffer and BatchNorm statistics: accepted, and left as they were by the check."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.full((10,), 0.5))
        self.net = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - self.shift)


class ThreeOutputs(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(10, 3)


class LazySetup(Plain):
    """Builds its layers in ``setup(stage)`` (Lightning calls it before ``configure_model``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = None
        self.setup_calls = 0

    def setup(self, stage: str) -> None:
        self.setup_calls += 1
        self.net = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 4))


class NoBatchIdx(Plain):
    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y)


def _refusal(model: L.LightningModule) -> str:
    dm = tiny_data()
    dm.setup()
    with pytest.raises(ContractError) as err:
        bind_model(model, dm.input_shape, dm.num_classes)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_training_loop_hooks_refused_in_one_line():
    assert _refusal(Hooked()) == (
        "Hooked overrides on_train_epoch_start, which federated local "
        "training never calls (it calls training_step and configure_optimizers only); move this "
        "logic into training_step"
    )


def test_manual_optimization_refused_in_one_line():
    assert _refusal(Manual()) == (
        "Manual sets automatic_optimization=False (manual optimization), which federated local "
        "training does not support: it steps the optimizer of configure_optimizers itself; return "
        "the loss from training_step and leave automatic_optimization True"
    )


def test_buffer_changed_by_training_step_refused_in_one_line():
    assert _refusal(RunningMean()) == (
        "RunningMean.training_step changes buffer xmean, which all clients share (only BatchNorm "
        "running statistics are kept per client); keep it constant during training, e.g. compute "
        "it from the data before fit"
    )
    dm = tiny_data()
    dm.setup()
    torch.manual_seed(0)
    model = ConstantBufferBN()
    bind_model(model, dm.input_shape, dm.num_classes)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    bind_model(model, dm.input_shape, dm.num_classes)  # the dry step moves nothing
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_fewer_outputs_than_classes_refused_in_one_line():
    assert _refusal(ThreeOutputs()) == (
        "ThreeOutputs.forward returns 3 outputs per sample but the datamodule has 4 classes; "
        "make the last layer 4 wide"
    )


def _fit_unlearn_audit(tmp_path, cls: type, vectorize: str) -> None:
    def fresh() -> L.LightningModule:
        torch.manual_seed(0)
        return cls()

    tr = tiny_trainer(tmp_path, vectorize=vectorize)
    model = fresh()
    tr.fit(model, tiny_data())
    if isinstance(model, LazySetup):
        assert model.setup_calls == 1
    run = str(tr.run_dir)
    tiny_trainer(tmp_path, vectorize=vectorize).unlearn(fresh(), tiny_data(), run, [3])
    res = tiny_trainer(tmp_path, vectorize=vectorize).audit(fresh(), tiny_data(), run, tolerance=0.0)
    assert res["passed"] and res["max_abs_diff"] == 0.0


def _stacked_minus_loop_float64(cls: type) -> float:
    out = {}
    for mode in ("always", "never"):
        dm = tiny_data()
        dm.setup()
        torch.manual_seed(0)
        model = cls()
        bind_model(model, dm.input_shape, dm.num_classes)
        eng = FederatedEngine(
            model.double(), dm, LocalSchedule(batch_size=7, local_epochs=2), seed=1, vectorize=mode
        )
        groups = [Group(0, (0, 1, 2, 3), 2), Group(1, (4, 5, 6, 7), 1)]
        out[mode] = eng.train_groups(stack_params([eng.module_params()] * 2), groups, stage=1).params
    return max(float((out["always"][k] - out["never"][k]).abs().max()) for k in out["always"])


@pytest.mark.exactness
@pytest.mark.parametrize("vectorize", ["always", "never"])
def test_model_built_in_setup_trains_and_unlearns_exactly(tmp_path, vectorize):
    _fit_unlearn_audit(tmp_path, LazySetup, vectorize)
    if vectorize == "always":
        assert _stacked_minus_loop_float64(LazySetup) <= 1e-10


@pytest.mark.exactness
@pytest.mark.parametrize("vectorize", ["always", "never"])
def test_training_step_without_batch_idx_trains_and_unlearns_exactly(tmp_path, vectorize):
    _fit_unlearn_audit(tmp_path, NoBatchIdx, vectorize)
    if vectorize == "always":
        assert _stacked_minus_loop_float64(NoBatchIdx) <= 1e-10


def test_the_module_docstring_example_trains(run_root):
    """``fedshard_lightning/module.py``'s subclass example, as written: it had read ``self.net`` before setting it."""
    import textwrap

    import fedshard_lightning.module as module

    doc = module.__doc__
    code = textwrap.dedent(doc.split("Subclass example (a new model is a class plus a config entry)::")[1])
    scope = {"FederatedModule": module.FederatedModule, "nn": nn}
    exec(compile(code, "module-docstring", "exec"), scope)
    metrics = tiny_trainer(run_root).fit(scope["TinyNet"](), tiny_data((4, 4)))
    assert metrics["client_steps"] > 0 and 0.0 <= metrics["test_accuracy"] <= 1.0
