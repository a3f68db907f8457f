"""FedAvg and its unlearning by retraining from scratch ("FA" in the FedShard paper's section 6).

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, Algorithm 1. Unlearning by retraining: the remaining clients train from the same initial model with the
same keyed randomness, so the result equals FedAvg trained without the leaving clients from the
start.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from fedshard_lightning.cache import FLCache
from fedshard_lightning.engine import Group, stack_params, unstack_params
from fedshard_lightning.errors import CacheError, ConfigError
from fedshard_lightning.unlearning.base import Algorithm, UnlearnResult

__all__ = ["FedAvg"]


class FedAvg(Algorithm):
    """Plain FedAvg over all clients; unlearning retrains from scratch.

    Args:
        rounds: Communication rounds.
        **kwargs: Local training settings, see :class:`~fedshard_lightning.unlearning.base.Algorithm`.
    """

    name = "fedavg"

    def __init__(self, rounds: int = 20, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(rounds, int) or rounds < 1:
            raise ConfigError(f"algorithm.rounds={rounds!r}: must be a positive integer")
        self.rounds = rounds
        self.theta0: dict[str, Tensor] | None = None
        self.params: dict[str, Tensor] | None = None
        self.total_client_steps = 0

    def hparams(self) -> dict[str, Any]:
        """Base settings plus the number of rounds."""
        return {**super().hparams(), "rounds": self.rounds}

    def _train_on(self, clients: Sequence[int], report: bool) -> tuple[dict[str, Tensor], int]:
        res = self.train(
            stack_params([self.theta0]), [Group(0, tuple(clients), self.rounds)], stage=0, report=report
        )
        return unstack_params(res.params, 0), res.client_steps

    def fit(self) -> dict[str, Tensor]:
        """Train all clients for ``rounds`` rounds from theta^0."""
        self.theta0 = self.trainer.theta0
        self.trainer.stage_start(0, [Group(0, tuple(self.active_clients), self.rounds)])
        self.params, self.total_client_steps = self._train_on(self.active_clients, report=True)
        self.trainer.stage_end(0)
        return self.params

    def current_params(self) -> dict[str, Tensor]:
        """The current global model."""
        return self.params

    def _cost(self, clients: Sequence[int]) -> int:
        group = Group(0, tuple(clients), self.rounds)
        return sum(
            self.engine.client_steps_of(self.engine.participants(0, group, r)) for r in range(self.rounds)
        )

    def predict_cost(self, clients: Sequence[int]) -> int:
        """Retraining the remaining clients for every round."""
        gone = set(clients)
        return self._cost([c for c in self.active_clients if c not in gone])

    retrain_cost = predict_cost

    def unlearn(self, clients: Sequence[int]) -> UnlearnResult:
        """Retrain from theta^0 without ``clients`` (and without every earlier unlearned client)."""
        gone = set(clients)
        remaining = [c for c in self.active_clients if c not in gone]
        predicted = self._cost(remaining)
        t = time.perf_counter()
        params, steps = self._train_on(remaining, report=False)
        seconds = time.perf_counter() - t
        self.params = params
        self.unlearned = sorted({*self.unlearned, *clients})
        return UnlearnResult(params, steps, predicted, predicted, seconds)

    # -- cache ------------------------------------------------------------------------------------
    def write_cache(self, cache: FLCache, label: str) -> str:
        """theta^0, the current model, and the unlearned clients."""
        manifest = self.manifest_base(complete=self.params is not None)
        tensors = {"theta0.safetensors": self.theta0}
        if self.params is not None:
            tensors["model.safetensors"] = self.params
        return cache.commit(cache.next_name(label), manifest, tensors)

    def load_cache(self, cache: FLCache) -> dict[str, Any]:
        """Restore theta^0, the model and the unlearned set; return the manifest for subclasses."""
        manifest = self.trainer.check_manifest(cache, self.name)
        if not manifest.get("complete"):
            raise CacheError(f"{cache.root}: training did not finish; run fit again")
        if manifest.get("num_clients") != self.num_clients:
            raise CacheError(f"{cache.root}: the cache was made for another number of clients")
        device = self.trainer.device
        self.theta0 = cache.tensors("theta0.safetensors", device=device)
        self.params = cache.tensors("model.safetensors", device=device)
        self.unlearned = [int(c) for c in manifest.get("unlearned", [])]
        self.total_client_steps = int(manifest.get("client_steps", 0))
        return manifest
