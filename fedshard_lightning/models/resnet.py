"""A small CIFAR ResNet (He et al., CVPR 2016, section 4.2) with GroupNorm instead of BatchNorm.

He et al.'s CIFAR networks have ``6n + 2`` layers: a 3x3 stem convolution, three stages of ``n``
basic blocks with ``w``, ``2w`` and ``4w`` channels (the last two halve the resolution), global
average pooling and one dense layer. BatchNorm is replaced by GroupNorm (Wu & He, ECCV 2018), as
Hsieh et al. (ICML 2020) recommend for non-IID federated learning and as Reddi et al. (ICLR 2021)
use for federated CIFAR-100: GroupNorm keeps no running statistics, so a client's forward pass is
a pure function of its parameters and its batch, and the model can be trained under
``torch.func.vmap`` by the federated engine. There is no dropout.

Departure from He et al.: the shortcut of a block that changes shape is a strided 1x1 convolution
followed by GroupNorm (their "option B"), not zero padding.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedshard_lightning.errors import ConfigError
from fedshard_lightning.models.image import ImageClassifier, kaiming_convs

__all__ = ["ResNet18BN", "ResNetGN"]


class _BasicBlock(nn.Module):
    """conv3x3 -> GN -> ReLU -> conv3x3 -> GN, plus the shortcut, then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.GroupNorm(groups, c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.norm1(self.conv1(x)).relu()
        out = self.norm2(self.conv2(out))
        return (out + self.shortcut(x)).relu()


class ResNetGN(ImageClassifier):
    """CIFAR ResNet-``depth`` of He et al. with GroupNorm: vmap-safe, no running statistics, no dropout.

    ``depth = 6n + 2`` (8, 14, 20, 32, 44, 56, 110, ...), ``n`` basic blocks per stage; the stages
    have ``width``, ``2 * width`` and ``4 * width`` channels. Parameter counts for 3x32x32 inputs
    and 100 classes (CIFAR-100)::

        depth  width   parameters
        8      16          83,892   (the defaults)
        20     16         278,324   (He et al.'s ResNet-20 with GN)
        8      32         320,260
        20     32       1,096,196

    Works for any ``[C, H, W]`` input (e.g. 1x28x28); the resolution is pooled away at the end.

    Args:
        depth: Number of layers, ``6n + 2`` with ``n >= 1``.
        width: Channels of the first stage (and of the stem).
        groups: GroupNorm groups; must divide ``width``.
        zero_init_residual: Start the last GroupNorm of every block at scale 0, so that each block
            begins as the identity (Goyal et al., 2017); helps deep nets train without BatchNorm.
        **kwargs: See :class:`~fedshard_lightning.module.FederatedModule`.
    """

    def __init__(
        self,
        depth: int = 8,
        width: int = 16,
        groups: int = 4,
        zero_init_residual: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
            raise ConfigError(f"model.depth={depth!r}: must be 6n + 2 with n >= 1 (8, 14, 20, 32, ...)")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ConfigError(f"model.width={width!r}: must be a positive integer")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or width % groups:
            raise ConfigError(
                f"model.groups={groups!r}: must be a positive integer that divides model.width={width}"
            )
        self.depth, self.width, self.groups = depth, width, groups
        self.zero_init_residual = bool(zero_init_residual)
        self.build_when_shaped()

    def build_layers(self, c_in: int, h: int, w_in: int) -> tuple[nn.Module, nn.Module]:
        """Stem, residual stages, global average pooling; one dense layer."""
        blocks_per_stage = (self.depth - 2) // 6
        w, g = self.width, self.groups
        layers: list[nn.Module] = [
            nn.Conv2d(c_in, w, 3, padding=1, bias=False),
            nn.GroupNorm(g, w),
            nn.ReLU(),
        ]
        c_in = w
        for stage, c_out in enumerate((w, 2 * w, 4 * w)):
            for b in range(blocks_per_stage):
                stride = 2 if stage > 0 and b == 0 else 1
                layers.append(_BasicBlock(c_in, c_out, stride, g))
                c_in = c_out
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        features, classifier = nn.Sequential(*layers), nn.Linear(c_in, self.num_classes)
        kaiming_convs(features)  # after the classifier: the order of the random draws is kept
        if self.zero_init_residual:
            for m in features.modules():
                if isinstance(m, _BasicBlock):
                    nn.init.zeros_(m.norm2.weight)
        return features, classifier


class _BasicBlockBN(nn.Module):
    """conv3x3 -> BN -> ReLU -> conv3x3 -> BN, plus the shortcut (1x1 conv + BN on a shape change), then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn1(self.conv1(x)).relu()
        out = self.bn2(self.conv2(out))
        return (out + self.shortcut(x)).relu()


class ResNet18BN(ImageClassifier):
    """ResNet-18 with BatchNorm, CIFAR variant: the baseline users compare federated models against.

    He et al. (CVPR 2016) ImageNet ResNet-18 (four stages of two basic blocks, ``width``,
    ``2 width``, ``4 width``, ``8 width`` channels) with the common CIFAR stem: one 3x3 stride-1
    convolution and no max pooling. ``width=64`` is the usual 11.2M-parameter model; tests use a
    tiny width. BatchNorm's running statistics are per-client buffers: the engine stacks them like
    parameters and averages them with the FedAvg weights (see ``docs/architecture.md``), and
    evaluation uses the aggregated statistics.

    Args:
        width: Channels of the first stage (and of the stem).
        **kwargs: See :class:`~fedshard_lightning.module.FederatedModule`.
    """

    def __init__(self, width: int = 64, **kwargs) -> None:
        super().__init__(**kwargs)
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ConfigError(f"model.width={width!r}: must be a positive integer")
        self.width = width
        self.build_when_shaped()

    def build_layers(self, c_in: int, h: int, w_in: int) -> tuple[nn.Module, nn.Module]:
        """Stem, residual stages, global average pooling; one dense layer."""
        w = self.width
        layers: list[nn.Module] = [
            nn.Conv2d(c_in, w, 3, padding=1, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(),
        ]
        c_in = w
        for stage, c_out in enumerate((w, 2 * w, 4 * w, 8 * w)):
            for b in range(2):
                layers.append(_BasicBlockBN(c_in, c_out, 2 if stage > 0 and b == 0 else 1))
                c_in = c_out
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        features, classifier = nn.Sequential(*layers), nn.Linear(c_in, self.num_classes)
        kaiming_convs(features)
        return features, classifier
