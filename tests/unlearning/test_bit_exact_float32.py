"""float32 audits are bit-exact (max|diff| == 0.0) for MLP, FedAvgCNN and ResNetGN, stacked and loop.

The independent reference replay is left out here (it retrains on the loop kernel and certifies
nothing about bit-equality); tests/unlearning/test_audit_reference.py covers it.
"""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_data, tiny_model, tiny_trainer

from fedshard_lightning.models import MLP, FedAvgCNN, ResNetGN


def _plain_mlp(**_: object) -> MLP:
    """An MLP with plain SGD: stacked, it trains (and unlearns) on the engine's lean path."""
    torch.manual_seed(0)
    return MLP(hidden=(16,), lr=0.1)


def _fresh(cls, shape):
    return (_plain_mlp() if cls is _plain_mlp else tiny_model(cls)), tiny_data(shape)


def _trainer(root, vectorize):
    return tiny_trainer(root, vectorize=vectorize)


# The per-client loop (never) of the CNN and the ResNet runs -m slow: the loop's exactness is the
# MLPs' never cases here, the convolution and GroupNorm kernels' is their stacked (always) cases.
_MODELS = [
    ("MLP", MLP, (10,)),
    ("plain_mlp", _plain_mlp, (10,)),
    ("FedAvgCNN", FedAvgCNN, (1, 28, 28)),
    ("ResNetGN", ResNetGN, (3, 16, 16)),
]
_CASES = [
    pytest.param(
        cls,
        shape,
        vectorize,
        id=f"{name}-{vectorize}",
        marks=pytest.mark.slow if vectorize == "never" and name in ("FedAvgCNN", "ResNetGN") else (),
    )
    for name, cls, shape in _MODELS
    for vectorize in ("always", "never")
]


@pytest.mark.parametrize(("cls", "shape", "vectorize"), _CASES)
def test_float32_audit_is_bit_exact(tmp_path, cls, shape, vectorize):
    tr = _trainer(tmp_path, vectorize)
    tr.fit(*_fresh(cls, shape))
    run = str(tr.run_dir)
    for clients in ([3], [0, 6]):
        _trainer(tmp_path, vectorize).unlearn(*_fresh(cls, shape), run, clients)
        res = _trainer(tmp_path, vectorize).audit(*_fresh(cls, shape), run, tolerance=0.0, reference=False)
        assert res["passed"] and res["max_abs_diff"] == 0.0
