"""FedBN: BatchNorm layers that each client keeps local instead of receiving the group's average.

FedBN (Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021) leaves the BatchNorm layers out of the averaging that clients train
from: a client's running statistics (``stats``), and with ``layers`` also the layer's affine
weight and bias, carry over from its own previous round. The server still averages them with the
FedAvg weights, and that average is the group's model: it is what the global model is evaluated
with (a global test set has no client of its own) and what a new stage of FedShard merges.

A client keeps its local values for the whole engine call that trains its group, which is a whole
stage for FedShard and the whole fit for FedAvg: a retrained shard then recomputes its clients'
local values from the shard's stage-start model alone, so unlearning stays exact, and nothing per
client has to go into the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from fedshard_lightning.errors import ConfigError

__all__ = ["LocalBN", "LocalLayers", "local_layer_names"]

LocalBN = Literal["off", "stats", "layers"]


def local_layer_names(module: nn.Module, mode: LocalBN, trainable: Sequence[str]) -> list[str]:
    """State names FedBN keeps per client: BN running statistics, and with ``layers`` BN weights and biases.

    Raises:
        ConfigError: ``mode`` is unknown, or the model has nothing it would keep local.
    """
    if mode not in ("off", "stats", "layers"):
        raise ConfigError(f"algorithm.local_bn={mode!r}: choose off, stats or layers")
    if mode == "off":
        return []
    out: list[str] = []
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.modules.batchnorm._BatchNorm):
            continue
        if sub.track_running_stats:
            out += [f"{name}.running_mean", f"{name}.running_var"]
        if mode == "layers":
            out += [f"{name}.{p}" for p in ("weight", "bias") if f"{name}.{p}" in trainable]
    if not out:
        raise ConfigError(
            f"algorithm.local_bn={mode!r}: {type(module).__name__} has no BatchNorm layer to keep local; "
            "use local_bn: off"
        )
    return out


class LocalLayers:
    """The local values of every client trained so far in one engine call (``train_groups``)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.values: dict[int, dict[str, Tensor]] = {}

    def start(self, state: dict[str, Tensor], rows: Tensor, clients: Sequence[int]) -> tuple[dict, Tensor]:
        """(start models, rows) for ``clients``: their group's row, with their own local values once they have them."""
        if not self.names or not any(c in self.values for c in clients):
            return state, rows
        start = {k: v.index_select(0, rows) for k, v in state.items()}
        for j, c in enumerate(clients):
            own = self.values.get(c)
            if own is not None:
                for k in self.names:
                    start[k][j] = own[k]
        return start, torch.arange(len(clients), device=rows.device)

    def keep(self, params: dict[str, Tensor], clients: Sequence[int]) -> None:
        """Remember each client's values after its local training (rows in ``clients`` order)."""
        if not self.names:
            return
        for j, c in enumerate(clients):
            self.values[c] = {k: params[k][j].clone() for k in self.names}
