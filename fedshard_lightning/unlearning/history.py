"""FedAvg that keeps per-round history in FLCache: the shared base of FedEraser and FedRecover.

Training runs one engine call per round (the engine stage is the round number), so any retained
round can be replayed alone with its original keyed randomness; retained rounds' start models and
client updates are written to FLCache as training goes and read back one round at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.engine import (
    FederatedEngine,
    Group,
    RoundInfo,
    TrainResult,
    stack_params,
    unstack_params,
)
from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.cache import FLCache
from fedshard_lightning.unlearning.fedavg import FedAvgRounds

__all__ = ["HistoryFedAvg", "UpdateHistory"]


class UpdateHistory:
    """Start model and participants' updates of retained rounds, one safetensors file per round.

    A round recorded by :meth:`add` stays in memory until a cache commit stores it
    (:meth:`files` then :meth:`committed`); afterwards it is read back from its cache version on
    demand. Files already in the cache are shared by later versions (same blob), never rewritten.
    """

    def __init__(self) -> None:
        self.participants: dict[int, list[int]] = {}
        self._memory: dict[int, dict[str, Tensor]] = {}
        self._stored: dict[int, tuple[FLCache, str, str]] = {}

    @staticmethod
    def fname(r: int) -> str:
        """File name of round ``r``."""
        return f"round_{r:04d}.safetensors"

    @property
    def rounds(self) -> list[int]:
        """Retained rounds, in order."""
        return sorted(self.participants)

    def add(
        self, r: int, clients: Sequence[int], start: dict[str, Tensor], updates: dict[str, Tensor]
    ) -> None:
        """Record round ``r``: its starting global model and the updates ``[clients, ...]``."""
        self.participants[r] = [int(c) for c in clients]
        self._memory[r] = {
            **{f"global/{k}": v.detach().cpu() for k, v in start.items()},
            **{f"update/{k}": v.detach().cpu() for k, v in updates.items()},
        }
        self._stored.pop(r, None)

    def load(self, r: int, device: torch.device | str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(start model, updates ``[participants, ...]``) of round ``r`` on ``device``."""
        if r in self._memory:
            flat = {k: v.to(device) for k, v in self._memory[r].items()}
        else:
            cache, version, _ = self._stored[r]
            flat = cache.tensors(self.fname(r), version, device=device)
        start = {k[7:]: v for k, v in flat.items() if k.startswith("global/")}
        updates = {k[7:]: v for k, v in flat.items() if k.startswith("update/")}
        return start, updates

    def files(self, cache: FLCache) -> tuple[dict[str, dict[str, Tensor]], dict[str, str]]:
        """Tensor files to write and files to reuse from the cache's current version."""
        base = cache.manifest()["files"] if cache.exists() else {}
        tensors, reuse = {}, {}
        for r in self.rounds:
            name = self.fname(r)
            if r in self._memory:
                tensors[name] = self._memory[r]
            elif base.get(name) == self._stored[r][2]:
                reuse[name] = name
            else:
                src, version, _ = self._stored[r]
                tensors[name] = src.tensors(name, version)
        return tensors, reuse

    def committed(self, cache: FLCache, version: str) -> None:
        """Everything is in ``version`` now: free the memory copies."""
        files = cache.manifest(version)["files"]
        for r in self.rounds:
            self._stored[r] = (cache, version, files[self.fname(r)])
        self._memory.clear()

    def to_dict(self) -> dict[str, list[int]]:
        """JSON form (participants by round)."""
        return {str(r): self.participants[r] for r in self.rounds}

    @classmethod
    def from_cache(cls, cache: FLCache, data: dict[str, list[int]]) -> UpdateHistory:
        """The history of the cache's current version (files are read lazily)."""
        hist = cls()
        version = cache.current()
        files = cache.manifest(version)["files"]
        for key, parts in data.items():
            r = int(key)
            if cls.fname(r) not in files:
                raise CacheError(f"{cache.root}/{version}: the history file of round {r} is missing")
            hist.participants[r] = [int(c) for c in parts]
            hist._stored[r] = (cache, version, files[cls.fname(r)])
        return hist


class HistoryFedAvg(FedAvgRounds):
    """FedAvg trained one engine call per round, retaining the updates of every ``keep_every``-th round.

    Round r is the engine's stage r (round 0 of a one-round group), so any round can be re-run
    later, alone, with the keys it was trained with; the callbacks still see stage 0, round r.
    Subclasses implement :meth:`predict_cost` and :meth:`unlearn` from :attr:`history`.

    Args:
        rounds: Communication rounds.
        keep_every: Retain rounds ``0, keep_every, 2 keep_every, ...``.
        **kwargs: Local training settings, see :class:`~fedshard_lightning.unlearning.base.Algorithm`.
    """

    local_bn_ok = False  # one engine call per round

    state_fields = (*FedAvgRounds.state_fields, "history")

    def __init__(self, rounds: int = 20, keep_every: int = 1, **kwargs: Any) -> None:
        super().__init__(rounds=rounds, **kwargs)
        self.keep_every = int(keep_every)
        self.history = UpdateHistory()

    def initial_state(self, theta0: dict[str, Tensor]) -> dict[str, Any]:
        """No model and no retained round yet."""
        return {**super().initial_state(theta0), "history": UpdateHistory()}

    # -- rounds -----------------------------------------------------------------------------------
    def _group(self, clients: Sequence[int]) -> Group:
        return Group(0, tuple(clients), 1)

    def train_round(
        self,
        start: dict[str, Tensor],
        clients: Sequence[int],
        r: int,
        report: bool = False,
        keep: bool = False,
        engine: FederatedEngine | None = None,
    ) -> TrainResult:
        """One FedAvg round ``r`` of ``clients`` from ``start`` (with ``engine``, default the algorithm's)."""
        group = self._group(clients)
        init = stack_params([start])
        if engine is not None:
            return engine.train_groups(init, [group], r, None, keep)

        events = self.events

        def hook(info: RoundInfo, state: dict[str, Tensor]) -> None:
            events.round_end(replace(info, stage=0, round=r), state, [group])

        return self.train(init, [group], r, hook if report else None, keep_client_params=keep, report=False)

    @staticmethod
    def client_updates(res: TrainResult) -> tuple[list[int], dict[str, Tensor], dict[str, Tensor]]:
        """(client ids, start model, updates ``[clients, ...]``) of a one-round ``keep`` result."""
        info = res.history[0]
        start = unstack_params(info.start_params, 0)
        return info.client_ids, start, {k: v - start[k] for k, v in info.client_params.items()}

    def participants(self, r: int, clients: Sequence[int]) -> list[int]:
        """The engine's keyed participants of round ``r`` among ``clients``."""
        return self.engine.participants(r, self._group(clients), 0)

    def fit(self) -> dict[str, Tensor]:
        """``rounds`` FedAvg rounds from theta^0, committing each retained round to the cache."""
        clients = tuple(self.active_clients)
        self.events.stage_start(0, [Group(0, clients, self.rounds)])
        w, steps = self.theta0, 0
        for r in range(self.rounds):
            keep = r % self.keep_every == 0
            res = self.train_round(w, clients, r, report=True, keep=keep)
            if keep and res.history:
                ids, start, updates = self.client_updates(res)
                self.history.add(r, ids, start, updates)
            w = unstack_params(res.params, 0)
            steps += res.client_steps
            self.total_client_steps = steps
            if keep:
                self.events.checkpoint(f"round-{r + 1}")  # spill: memory holds one round
        self.params = w
        self.events.stage_end(0, {"client_steps": float(steps)})
        return self.params

    # -- costs ------------------------------------------------------------------------------------
    def retrain_cost(self, clients: Sequence[int]) -> int:
        """Steps of retraining every round from theta^0 without ``clients``."""
        rest = self.remaining(clients)
        return sum(self.engine.client_steps_of(self.participants(r, rest)) for r in range(self.rounds))

    # -- cache ------------------------------------------------------------------------------------
    def cache_files(
        self, cache: FLCache
    ) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict[str, str]]:
        """The current model and the retained rounds (shared blobs once written)."""
        fields, tensors, reuse = super().cache_files(cache)
        hist_tensors, hist_reuse = self.history.files(cache)
        return (
            {**fields, "history": self.history.to_dict()},
            {**tensors, **hist_tensors},
            {**reuse, **hist_reuse},
        )

    def committed(self, cache: FLCache, version: str) -> None:
        """The retained rounds are on disk now: free their memory copies."""
        self.history.committed(cache, version)

    def restore_cache(self, cache: FLCache, manifest: dict[str, Any], device: torch.device) -> None:
        """Restore the model and the retained rounds (read lazily)."""
        super().restore_cache(cache, manifest, device)
        self.history = UpdateHistory.from_cache(cache, manifest.get("history", {}))
