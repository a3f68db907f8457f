"""The deployed model file of a model with tied weights: written, read back, unlearned exactly."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _tiny import tiny_data, tiny_trainer
from safetensors.torch import load_file
from torch import nn


class TiedAutoencoderHead(L.LightningModule):
    """A decoder that reuses its encoder's matrix (one parameter, two names in the state dict)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.enc = nn.Linear(10, 10, bias=False)
        self.dec = nn.Linear(10, 10, bias=False)
        self.dec.weight = self.enc.weight
        self.head = nn.Linear(10, 4)

    def forward(self, x):
        return self.head(torch.relu(self.dec(torch.relu(self.enc(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.5)


@pytest.mark.exactness
@pytest.mark.parametrize("vectorize", ["always", "never"])
def test_tied_weights_are_written_read_and_unlearned_bit_exact(tmp_path, vectorize):
    def fresh():
        torch.manual_seed(0)
        return TiedAutoencoderHead(), tiny_data()

    tr = tiny_trainer(tmp_path, vectorize=vectorize)
    tr.fit(*fresh())
    run = tr.run_dir
    written = load_file(str(run / "model.safetensors"))
    assert torch.equal(written["enc.weight"], written["dec.weight"])
    assert torch.equal(written["enc.weight"], tr.module.enc.weight.detach())
    before = tiny_trainer(tmp_path, vectorize=vectorize).test(*fresh(), str(run))
    assert before["test_accuracy"] == tr.evaluate(tr.algorithm.current_params())[0]
    tiny_trainer(tmp_path, vectorize=vectorize).unlearn(*fresh(), str(run), [3])
    after = load_file(str(run / "model.safetensors"))
    assert torch.equal(after["enc.weight"], after["dec.weight"])
    assert not torch.equal(after["enc.weight"], written["enc.weight"])
    res = tiny_trainer(tmp_path, vectorize=vectorize).audit(*fresh(), str(run), tolerance=0.0)
    assert res["max_abs_diff"] == 0.0
