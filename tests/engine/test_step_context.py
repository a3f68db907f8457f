"""What StepContext installs on a user's module: routed while the engine runs, plain everywhere else.

A deep copy (the evaluator's eval-mode copy) and a pickle (``torch.save(model)`` in a notebook)
must hold the class's own methods, not closures over the original module and its context.
"""

from __future__ import annotations

import copy
import io
import pickle

import lightning as L
import torch
import torch.nn.functional as F
from _tiny import tiny_data
from torch import nn

from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard


class BufferedDropoutNet(L.LightningModule):
    """Dropout and a constant buffer: the buffer check installs the context before the evaluator copies."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("client_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, model: L.LightningModule) -> tuple[FederatedTrainer, dict]:
    trainer = FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=5),
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize="never",
    )
    return trainer, trainer.fit(model, tiny_data((10,), partition="iid"))


def _by_hand(state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Eval-mode accuracy and loss of a fresh module holding ``state``: no dropout at all."""
    fresh = BufferedDropoutNet()
    fresh.load_state_dict(state)
    with torch.no_grad():
        out = fresh.eval()(x).double()
    return float((out.argmax(1) == y).double().mean()), float(F.cross_entropy(out, y))


def test_evaluation_of_a_dropout_model_drops_nothing(tmp_path):
    torch.manual_seed(0)
    trainer, metrics = _fit(tmp_path, BufferedDropoutNet())
    x, y = trainer._test_data
    acc, loss = _by_hand(trainer.module.state_dict(), x, y)
    assert metrics["test_accuracy"] == acc and abs(metrics["test_loss"] - loss) < 1e-6
    params = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    assert trainer.evaluate(params) == trainer.evaluate(params)  # deterministic: eval mode


def test_module_pickles_and_copies_as_plain_after_fit(tmp_path):
    torch.manual_seed(0)
    model = BufferedDropoutNet()
    _fit(tmp_path, model)
    buf = io.BytesIO()
    torch.save(model, buf)
    for other in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        dropout = other.net[2]
        assert dropout.forward.__self__ is dropout and other.log.__self__ is other  # not the original's
        x = torch.randn(5, 10)
        assert torch.equal(other.eval()(x), model.eval()(x))
        assert torch.equal(dropout.train()(torch.ones(1000)).eq(0).any(), torch.tensor(True))
