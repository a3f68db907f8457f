"""Built-in image models: parameter counts against the papers' formulas, one-line refusal of vector data."""

from __future__ import annotations

import pytest
import torch

from fedshard_lightning.errors import ConfigError
from fedshard_lightning.models import FedAvgCNN, ResNet18BN, ResNetGN


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_fedavg_cnn_has_the_papers_parameter_count():
    # conv 1->32 5x5, conv 32->64 5x5, fc 7*7*64 -> 512, fc 512 -> 10 (McMahan et al.: 1,663,370).
    expected = (25 * 32 + 32) + (25 * 32 * 64 + 64) + (7 * 7 * 64 * 512 + 512) + (512 * 10 + 10)
    assert expected == 1_663_370
    assert _count(FedAvgCNN(input_shape=(1, 28, 28), num_classes=10)) == expected


def _conv(cin: int, cout: int, k: int) -> int:
    return cin * cout * k * k  # no bias: a normalisation follows


def _block(cin: int, cout: int) -> int:
    """He et al.'s basic block: two 3x3 convolutions with GroupNorm, a 1x1 shortcut when the shape changes."""
    main = _conv(cin, cout, 3) + 2 * cout + _conv(cout, cout, 3) + 2 * cout
    return main + (_conv(cin, cout, 1) + 2 * cout if cin != cout else 0)


def test_resnet_gn_depth_8_parameter_count():
    w = 8
    expected = (
        _conv(3, w, 3) + 2 * w + _block(w, w) + _block(w, 2 * w) + _block(2 * w, 4 * w) + (4 * w * 10 + 10)
    )
    assert _count(ResNetGN(depth=8, width=w, groups=2, input_shape=(3, 32, 32), num_classes=10)) == expected


@pytest.mark.parametrize("cls", [FedAvgCNN, ResNetGN, ResNet18BN])
def test_image_models_refuse_vector_data_in_one_line(cls):
    with pytest.raises(ConfigError) as err:
        cls(input_shape=(64,), num_classes=10)
    message = str(err.value)
    assert "\n" not in message and cls.__name__ in message and "use MLP" in message


@pytest.mark.parametrize("cls", [FedAvgCNN, ResNetGN, ResNet18BN])
def test_layers_are_built_once_the_shapes_are_known(cls):
    model = cls(width=8) if cls is not FedAvgCNN else cls(channels=(4, 8), hidden=16)
    assert model.features is None
    model.input_shape, model.num_classes = (3, 16, 16), 5
    model.configure_model()
    first = model.features
    model.configure_model()
    assert model.features is first
    assert model(torch.zeros(2, 3, 16, 16)).shape == (2, 5)
