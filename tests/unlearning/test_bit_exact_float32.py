"""float32 audits are bit-exact (max|diff| == 0.0) for MLP, FedAvgCNN and ResNetGN, stacked and loop."""

from __future__ import annotations

import pytest
from _tiny import tiny_data, tiny_model, tiny_trainer

from fedshard_lightning.models import MLP, FedAvgCNN, ResNetGN


def _fresh(cls, shape):
    return tiny_model(cls), tiny_data(shape)


def _trainer(root, vectorize):
    return tiny_trainer(root, vectorize=vectorize)


@pytest.mark.parametrize("vectorize", ["always", "never"])
@pytest.mark.parametrize(("cls", "shape"), [(MLP, (10,)), (FedAvgCNN, (1, 28, 28)), (ResNetGN, (3, 16, 16))])
def test_float32_audit_is_bit_exact(tmp_path, cls, shape, vectorize):
    tr = _trainer(tmp_path, vectorize)
    tr.fit(*_fresh(cls, shape))
    run = str(tr.run_dir)
    for clients in ([3], [0, 6]):
        _trainer(tmp_path, vectorize).unlearn(*_fresh(cls, shape), run, clients)
        res = _trainer(tmp_path, vectorize).audit(*_fresh(cls, shape), run, tolerance=0.0)
        assert res["passed"] and res["max_abs_diff"] == 0.0
