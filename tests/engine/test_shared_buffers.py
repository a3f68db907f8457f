"""The saved model's bytes do not depend on how many stacked calls a process happened to make.

BatchNorm counts its forward passes in ``num_batches_tracked`` (a shared, unstacked buffer). The
stacked step used to add to the user's module's own counter, once per call and per kernel probe,
so two fits of the same seed wrote different ``model.safetensors`` (the first process of a
machine also probes the path; a resumed fit counts only its own calls), while the per-client
loop trains a copy and leaves the module's counter alone. Reference: a freshly built
``nn.BatchNorm2d`` (counter 0), and the bytes of a fit that repeats the same seed.
"""

from __future__ import annotations

import torch
from _models import BNDropoutCNN
from _tiny import tiny_data
from safetensors.torch import load_file

from fedshard_lightning.trainer import FederatedTrainer
from fedshard_lightning.unlearning import FedShard


def _fit(root, name):
    torch.manual_seed(0)
    tr = FederatedTrainer(
        algorithm=FedShard(rounds="fixed", fixed_rounds=2, batch_size=5),
        default_root_dir=str(root),
        run_name=name,
        enable_progress_bar=False,
        eval_every_n_rounds=0,
        vectorize="always",
    )
    model = BNDropoutCNN(lr=0.1)
    tr.fit(model, tiny_data((1, 8, 8)))
    return model, (tr.run_dir / "model.safetensors").read_bytes(), load_file(tr.run_dir / "model.safetensors")


def test_stacked_fit_leaves_batchnorm_counters_alone_and_repeats_bytes(tmp_path):
    model, first, tensors = _fit(tmp_path, "a")
    counters = {k: v for k, v in tensors.items() if k.endswith("num_batches_tracked")}
    assert counters, "the model has a BatchNorm layer"
    fresh = int(torch.nn.BatchNorm2d(4).num_batches_tracked)
    assert {k: int(v) for k, v in counters.items()} == dict.fromkeys(counters, fresh)
    assert int(model.net[1].num_batches_tracked) == fresh  # the user's module too
    # The second fit reuses this process's path decision (no probe): the same bytes all the same.
    _, second, _ = _fit(tmp_path, "b")
    assert first == second
