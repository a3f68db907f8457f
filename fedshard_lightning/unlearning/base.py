"""The algorithm interface: who trains together, from which model, for how many rounds.

Every method of the package (FedShard, the FedAvg retraining baseline, FATS, FedEraser,
RapidRetrain, FedRecover) is an :class:`Algorithm`. It never writes a training loop: it hands
groups of clients to :meth:`fedshard_lightning.engine.FederatedEngine.train_groups` through
:meth:`Algorithm.train`, which also reports every round to the trainer's callbacks.

The protocol, driven by :class:`~fedshard_lightning.trainer.FederatedTrainer`:

* ``attach(trainer)`` once the model and data are on the device;
* ``fit()`` trains from ``trainer.theta0`` and returns the final model's parameters, calling
  ``trainer.stage_end`` after each complete stage (the cache is committed there);
* ``write_cache(cache, label)`` / ``load_cache(cache)`` persist and restore everything unlearning
  needs (tensors in safetensors, structure in JSON);
* ``resume(cache)`` continues an interrupted ``fit`` from its last complete stage;
* ``predict_cost(clients)`` and ``unlearn(clients)`` serve deletion requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, RoundInfo, TrainResult
from fedshard_lightning.errors import ConfigError

__all__ = ["Algorithm", "UnlearnResult"]


@dataclass
class UnlearnResult:
    """The unlearned model and what it cost."""

    params: dict[str, Tensor]
    client_steps: int
    predicted_client_steps: int
    retrain_client_steps: int
    seconds: float
    server_seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


class Algorithm:
    """Base class of federated (un)learning methods.

    Args:
        batch_size: Client mini-batch size B.
        local_epochs: Local epochs per round (ignored when ``local_steps`` is set).
        local_steps: Fixed number of local steps per round instead of epochs.
        client_fraction: Share of a group's clients sampled in each round.
    """

    name: str = "algorithm"

    def __init__(
        self,
        batch_size: int = 10,
        local_epochs: int = 1,
        local_steps: int | None = None,
        client_fraction: float = 1.0,
    ) -> None:
        self.schedule = LocalSchedule(
            batch_size=batch_size, local_epochs=local_epochs, local_steps=local_steps
        )
        if not 0 < client_fraction <= 1:
            raise ConfigError(f"algorithm.client_fraction={client_fraction}: must be in (0, 1]")
        self.client_fraction = float(client_fraction)
        self.trainer: Any = None
        self.engine: FederatedEngine | None = None
        self.unlearned: list[int] = []
        self.total_client_steps = 0

    # -- identity ---------------------------------------------------------------------------------
    def hparams(self) -> dict[str, Any]:
        """Settings that change the result; part of the cache fingerprint and manifest."""
        return {
            "name": self.name,
            "batch_size": self.schedule.batch_size,
            "local_epochs": self.schedule.local_epochs,
            "local_steps": self.schedule.local_steps,
            "client_fraction": self.client_fraction,
        }

    # -- wiring -----------------------------------------------------------------------------------
    def attach(self, trainer: Any) -> None:
        """Bind to a trainer whose model and data are ready; build the engine."""
        self.trainer = trainer
        self.engine = trainer.make_engine(self.schedule, self.client_fraction)

    @property
    def num_clients(self) -> int:
        """K, the number of clients of the partition."""
        return len(self.trainer.datamodule.client_indices)

    @property
    def active_clients(self) -> list[int]:
        """Clients not unlearned so far."""
        gone = set(self.unlearned)
        return [c for c in range(self.num_clients) if c not in gone]

    def train(
        self,
        init: dict[str, Tensor],
        groups: Sequence[Group],
        stage: int,
        on_round_end: Callable[[RoundInfo, dict[str, Tensor]], Sequence[bool] | None] | None = None,
        keep_client_params: bool = False,
        report: bool = True,
    ) -> TrainResult:
        """Train groups with the engine; every round is reported to the callbacks when ``report``."""
        fabric = self.trainer.fabric
        world = fabric.world_size if fabric is not None else 1
        if world > 1 and len(groups) > 1:
            return self._train_distributed(init, groups, stage, on_round_end, keep_client_params, report)

        def hook(info: RoundInfo, state: dict[str, Tensor]) -> Sequence[bool] | None:
            if report:
                self.trainer.round_end(info, state, groups)
            return on_round_end(info, state) if on_round_end is not None else None

        return self.engine.train_groups(init, groups, stage, hook, keep_client_params)

    def _train_distributed(
        self,
        init: dict[str, Tensor],
        groups: Sequence[Group],
        stage: int,
        on_round_end: Callable[[RoundInfo, dict[str, Tensor]], Sequence[bool] | None] | None,
        keep_client_params: bool,
        report: bool,
    ) -> TrainResult:
        """Multi-process: rank r trains groups r, r+W, ...; the results are gathered in order.

        Groups are independent (keyed randomness), so the gathered models equal a single-process
        run. Per-round callbacks on rank zero see rank zero's groups only.
        """
        fabric = self.trainer.fabric
        world, rank = fabric.world_size, fabric.global_rank
        mine = list(range(rank, len(groups), world))
        sub_groups = [groups[i] for i in mine]
        idx = torch.as_tensor(mine, dtype=torch.long, device=next(iter(init.values())).device)
        sub_init = {k: v.index_select(0, idx) for k, v in init.items()}

        def hook(info: RoundInfo, state: dict[str, Tensor]) -> Sequence[bool] | None:
            if report:
                self.trainer.round_end(info, state, sub_groups)
            if on_round_end is None:
                return None
            local = RoundInfo(**{**vars(info), "active": [mine[a] for a in info.active]})
            flags = on_round_end(local, state)
            return None if flags is None else [bool(flags[g]) for g in mine]

        res = self.engine.train_groups(sub_init, sub_groups, stage, hook, keep_client_params)
        per = -(-len(groups) // world)
        params = {}
        for k, v in res.params.items():
            padded = torch.zeros(per, *v.shape[1:], dtype=v.dtype, device=v.device)
            padded[: len(mine)] = v
            gathered = fabric.all_gather(padded)  # [world, per, ...]
            params[k] = torch.stack([gathered[g % world, g // world] for g in range(len(groups))])
        counters = torch.zeros(per, 2, dtype=torch.long)
        counters[: len(mine), 0] = torch.as_tensor(res.group_client_steps, dtype=torch.long)
        counters[: len(mine), 1] = torch.as_tensor(res.rounds_run, dtype=torch.long)
        allc = fabric.all_gather(counters.to(fabric.device)).cpu()
        steps = [int(allc[g % world, g // world, 0]) for g in range(len(groups))]
        rounds = [int(allc[g % world, g // world, 1]) for g in range(len(groups))]
        return TrainResult(params, sum(steps), steps, rounds, res.seconds, res.history)

    def manifest_base(self, complete: bool) -> dict[str, Any]:
        """Fields every manifest carries: identity and fingerprint, state, and the trainer's request log."""
        return {
            "algorithm": self.name,
            "fingerprint": self.trainer.fingerprint,
            "hparams": self.hparams(),
            "num_clients": self.num_clients,
            "unlearned": self.unlearned,
            "complete": complete,
            "client_steps": self.total_client_steps,
            **self.trainer.cache_extra(),
        }

    # -- to implement -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Tensor]:
        """Train from ``trainer.theta0``; return the final model's parameters."""
        raise NotImplementedError

    def resume(self, cache: Any) -> bool:
        """Restore a partial fit from ``cache``; False when it cannot continue (then fit restarts)."""
        return False

    def write_cache(self, cache: Any, label: str) -> str:
        """Commit the algorithm's state as a new cache version; return its name."""
        raise NotImplementedError

    def load_cache(self, cache: Any) -> None:
        """Restore the state of a finished fit (and of every applied unlearning request)."""
        raise NotImplementedError

    def current_params(self) -> dict[str, Tensor]:
        """The current global model (after every applied request)."""
        raise NotImplementedError

    def predict_cost(self, clients: Sequence[int]) -> int:
        """Client-steps that :meth:`unlearn` will spend, computed before running it."""
        raise NotImplementedError

    def retrain_cost(self, clients: Sequence[int]) -> int:
        """Client-steps of retraining from scratch without ``clients`` (the reference cost)."""
        raise NotImplementedError

    def unlearn(self, clients: Sequence[int]) -> UnlearnResult:
        """Remove ``clients``' contribution; update the state so that later requests accumulate."""
        raise NotImplementedError
