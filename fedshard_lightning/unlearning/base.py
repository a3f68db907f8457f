"""The algorithm interface: a policy (who trains together, from which model, how long) over explicit state.

Every method of the package (FedShard, the FedAvg retraining baseline, FATS, FedEraser,
RapidRetrain, FedRecover) is an :class:`Algorithm`. It never writes a training loop: it hands
groups of clients to :meth:`fedshard_lightning.engine.FederatedEngine.train_groups` through
:meth:`Algorithm.train`. It never holds the trainer either: it sees the run through an
:class:`~fedshard_lightning.unlearning.context.AlgorithmContext` and reports through its
:class:`~fedshard_lightning.unlearning.context.LoopEvents`. Cache commits, the fingerprint check,
the request journal and the lock belong to the trainer.

The protocol, driven by :class:`~fedshard_lightning.trainer.trainer.FederatedTrainer`:

* ``setup(ctx)`` once the model and data are on the device (builds the engines);
* ``reset(theta0)`` before a fresh fit, or ``restore_cache(...)`` before a resumed one: the
  state is explicit (:attr:`Algorithm.state_fields`, ``state_dict``/``load_state_dict``), so a
  reused instance behaves like a fresh one;
* ``fit()`` continues training from the state (a fresh state trains everything) and returns the
  final model; it reports ``events.stage_end`` after each complete stage (the trainer commits);
* ``cache_files(cache)`` (and ``cache_stacks(cache)``, one blob per model row) / ``restore_cache(...)``
  turn the state into files and back (the defaults store tensor dicts as safetensors and the rest
  as JSON);
* ``predict_cost(clients)``, ``retrain_cost(clients)`` and ``unlearn(clients)`` serve requests;
  :meth:`Algorithm.what_if` is the pure form ``state, clients -> new state, result``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from fedshard_lightning.engine import FederatedEngine, Group, LocalSchedule, RoundInfo, TrainResult
from fedshard_lightning.engine.local_layers import LocalBN, local_layer_names
from fedshard_lightning.errors import CacheError, ConfigError, ContractError
from fedshard_lightning.init_args import RecordsInitArgs
from fedshard_lightning.unlearning.context import AlgorithmContext, LoopEvents
from fedshard_lightning.unlearning.contract import REQUIRED, UnlearnResult, check_result, is_tensor_dict

__all__ = ["Algorithm", "UnlearnResult", "check_implemented"]

BASE_STATE = ("theta0", "unlearned", "total_client_steps")
"""State every algorithm has; the trainer persists and restores it, subclasses cannot forget it."""


def retrain_audit(
    current: dict[str, Tensor],
    reference: dict[str, Tensor],
    unlearned: list[int],
    tolerance: float,
    steps: int,
) -> dict[str, Any]:
    """An audit's verdict: the deployed model against a retraining from theta^0 without ``unlearned``."""
    diff = max(float((current[k] - reference[k]).abs().max()) for k in current)
    summary = (
        f"final model max|diff| = {diff:.3e} against a retraining from theta^0 without clients "
        f"{unlearned}, tolerance {tolerance:.1e}; replay cost {steps} client-steps"
    )
    return {
        "passed": diff <= tolerance,
        "max_abs_diff": diff,
        "final_max_abs_diff": diff,
        "lines": [],
        "summary": summary,
    }


class Algorithm(RecordsInitArgs):
    """Base class of federated (un)learning methods.

    Args:
        batch_size: Client mini-batch size B.
        local_epochs: Local epochs per round (ignored when ``local_steps`` is set).
        local_steps: Fixed number of local steps per round instead of epochs.
        client_fraction: Share of a group's clients sampled in each round.
        local_bn: FedBN: ``stats`` keeps each client's BatchNorm running statistics its own,
            ``layers`` also the BatchNorm weights and biases; ``off`` (default) averages them
            like every parameter. Evaluation uses their FedAvg average (engine/local_layers.py).
    """

    name: str = "algorithm"
    exact: bool = True
    """Unlearning equals retraining without the clients (``audit`` can certify it)."""
    state_fields: tuple[str, ...] = BASE_STATE
    """Attributes that make up the state; subclasses extend the tuple and :meth:`initial_state`."""
    local_bn_ok: bool = False
    """Each group's rounds are one engine call, so FedBN's client-local layers last the whole training."""

    def __init__(
        self,
        batch_size: int = 10,
        local_epochs: int = 1,
        local_steps: int | None = None,
        client_fraction: float = 1.0,
        local_bn: LocalBN = "off",
    ) -> None:
        if local_bn not in ("off", "stats", "layers"):
            raise ConfigError(f"algorithm.local_bn={local_bn!r}: choose off, stats or layers")
        if local_bn != "off" and not self.local_bn_ok:
            raise ConfigError(
                f"algorithm.local_bn={local_bn!r}: {type(self).__name__} trains round by round, so client-local "
                "BatchNorm layers would not last; use it with FedShard, FedAvg or RapidRetrain"
            )
        self.local_bn = local_bn
        self.schedule = LocalSchedule(
            batch_size=batch_size, local_epochs=local_epochs, local_steps=local_steps
        )
        if not 0 < client_fraction <= 1:
            raise ConfigError(f"algorithm.client_fraction={client_fraction}: must be in (0, 1]")
        self.client_fraction = float(client_fraction)
        self.ctx: AlgorithmContext | None = None
        self.engine: FederatedEngine | None = None
        self.theta0: dict[str, Tensor] | None = None
        self.unlearned: list[int] = []
        self.total_client_steps = 0

    # -- wiring -----------------------------------------------------------------------------------
    def setup(self, ctx: AlgorithmContext) -> None:
        """Bind to a run (its model and data are ready); build the engine."""
        self.ctx = ctx
        self.engine = ctx.make_engine(self.schedule, self.client_fraction)
        self.engine.local_names = local_layer_names(self.engine.module, self.local_bn, self.engine.names)

    @property
    def events(self) -> LoopEvents:
        """Where the loop events go (nowhere before ``setup``)."""
        return self.ctx.events if self.ctx is not None else LoopEvents()

    @property
    def num_clients(self) -> int:
        """K, the number of clients of the partition."""
        return self.ctx.num_clients

    @property
    def active_clients(self) -> list[int]:
        """Clients not unlearned so far."""
        return self.remaining(())

    def remaining(self, clients: Sequence[int]) -> list[int]:
        """Active clients without ``clients`` (and without every client unlearned before)."""
        gone = set(self.unlearned) | {int(c) for c in clients}
        return [c for c in range(self.num_clients) if c not in gone]

    # -- state ------------------------------------------------------------------------------------
    def initial_state(self, theta0: dict[str, Tensor]) -> dict[str, Any]:
        """The state of a fit that has not trained yet; subclasses add their fields."""
        return {"theta0": theta0, "unlearned": [], "total_client_steps": 0}

    def reset(self, theta0: dict[str, Tensor], exclude: Sequence[int] = ()) -> None:
        """Start a fresh fit from ``theta0``, as if ``exclude`` had left before training."""
        state = self.initial_state(theta0)
        state["unlearned"] = sorted(int(c) for c in exclude)
        self.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """The state (shallow: tensors are shared, containers copied)."""
        out = {}
        for f in self.state_fields:
            v = getattr(self, f)
            out[f] = list(v) if isinstance(v, list) else (dict(v) if isinstance(v, dict) else v)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the state; every field of :attr:`state_fields` must be given."""
        missing = [f for f in self.state_fields if f not in state]
        if missing:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing state fields {missing}")
        for f in self.state_fields:
            v = state[f]
            setattr(self, f, list(v) if isinstance(v, list) else (dict(v) if isinstance(v, dict) else v))

    def is_complete(self) -> bool:
        """Whether the state is that of a finished fit (the trainer also knows when ``fit`` returned)."""
        return False

    def progress(self) -> str:
        """How far the fit got, for the message that refuses to unlearn from an unfinished run."""
        return "training did not finish"

    def what_if(self, state: dict[str, Any], clients: Sequence[int]) -> tuple[dict[str, Any], UnlearnResult]:
        """Pure unlearning: the state after removing ``clients`` from ``state``, and the result.

        The instance's own state is the same before and after; nothing is written. The trainer's
        ``unlearn`` runs this and commits the new state; what-if analyses just keep it.
        """
        saved, t = self.state_dict(), time.perf_counter()
        self.load_state_dict(state)
        try:
            result = check_result(self, self.unlearn(clients), time.perf_counter() - t)
            new = self.state_dict()
        finally:
            self.load_state_dict(saved)
        return new, result

    # -- training -----------------------------------------------------------------------------------
    def train(
        self,
        init: dict[str, Tensor],
        groups: Sequence[Group],
        stage: int,
        on_round_end: Callable[[RoundInfo, dict[str, Tensor]], Sequence[bool] | None] | None = None,
        keep_client_params: bool = False,
        report: bool = True,
        engine: FederatedEngine | None = None,
    ) -> TrainResult:
        """Train groups with the engine (``engine``: another of the method's); rounds reported when ``report``."""
        events = self.events
        eng = self.engine if engine is None else engine
        if self.ctx is not None and self.ctx.world_size > 1 and len(groups) > 1:  # the engine splits them
            res = eng.train_groups_split(
                self.ctx.ranks,
                init,
                groups,
                stage,
                on_round_end,
                keep_client_params,
                events.round_end if report else None,
            )
            events.groups_trained(stage, groups, res.client_steps)
            return res

        def hook(info: RoundInfo, state: dict[str, Tensor]) -> Sequence[bool] | None:
            if report:
                events.round_end(info, state, groups)
            return on_round_end(info, state) if on_round_end is not None else None

        watched = report or on_round_end is not None  # unwatched rounds: no per-round record or hook
        res = eng.train_groups(init, groups, stage, hook if watched else None, keep_client_params)
        events.groups_trained(stage, groups, res.client_steps)
        return res

    def train_stages(
        self,
        jobs: Sequence[tuple[int, Sequence[Group]]],
        init_of: Callable[[int, list[TrainResult]], dict[str, Tensor]],
    ) -> list[TrainResult]:
        """Unreported :meth:`train` of ``(stage, groups)`` jobs in turn, job j from ``init_of(j, results)``.

        One engine call (:meth:`.FederatedEngine.train_stages`) for a request's whole replay; the
        events hear of each job when the next one starts from it, and of the last at the end.
        """
        results: list[TrainResult] = []
        if self.ctx is not None and self.ctx.world_size > 1:
            for j, (stage, groups) in enumerate(jobs):
                results.append(self.train(init_of(j, results), groups, stage, report=False))
            return results

        def init_after(j: int, done: list[TrainResult]) -> dict[str, Tensor]:
            if j:
                self.events.groups_trained(*jobs[j - 1], done[-1].client_steps)
            return init_of(j, done)

        results = self.engine.train_stages(jobs, init_after)
        if results:
            self.events.groups_trained(*jobs[-1], results[-1].client_steps)
        return results

    # -- cache (files only; the trainer commits) ----------------------------------------------------
    def cache_files(self, cache: Any) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict[str, str]]:
        """(manifest fields, tensor files to write, files to reuse from ``cache``'s current version).

        ``theta0`` and the base state are the trainer's. The default stores every other state field
        that is a dict of tensors as ``<field>.safetensors`` and the rest, which must be JSON, under
        ``manifest["state"]``.
        """
        tensors: dict[str, dict[str, Tensor]] = {}
        state: dict[str, Any] = {}
        for f in self.state_fields:
            if f in BASE_STATE:
                continue
            v = getattr(self, f)
            if is_tensor_dict(v):
                tensors[f"{f}.safetensors"] = v
            else:
                state[f] = v
        return {"state": state}, tensors, {}

    def cache_stacks(self, cache: Any) -> dict[str, Any]:
        """Stacks of models to commit besides :meth:`cache_files`: name -> ``cache.StackWrite``.

        One blob per row (e.g. FedShard's shard models of a stage), written only for the rows the
        ``StackWrite`` names as changed since ``cache``'s current version. None by default.
        """
        return {}

    def committed(self, cache: Any, version: str) -> None:
        """The state now lives in ``version`` (e.g. to write only what changed next time); every process hears it."""

    def restore_cache(self, cache: Any, manifest: dict[str, Any], device: torch.device) -> None:
        """Restore the fields that :meth:`cache_files` wrote (``theta0`` and the base state are the trainer's)."""
        files = manifest.get("files", {})
        state = manifest.get("state", {})
        for f in self.state_fields:
            if f in BASE_STATE:
                continue
            if f"{f}.safetensors" in files:
                setattr(self, f, cache.tensors(f"{f}.safetensors", device=device, manifest=manifest))
            elif f in state:
                setattr(self, f, state[f])
            else:
                raise CacheError(f"{cache.root}: the cache holds no state field {f!r} of {self.name}")

    def run_files(self) -> dict[str, str]:
        """Text files for the run directory after ``fit`` (name -> content); the trainer writes them."""
        return {}

    def resumable(self, manifest: dict[str, Any]) -> bool:
        """Whether ``fit`` can continue from a restored partial state (else it restarts).

        True for a finished fit and for any state stored by the default :meth:`cache_files`
        (which stores all of it); algorithms with their own files decide for themselves.
        """
        return bool(manifest.get("complete")) or "state" in manifest

    # -- certificate -------------------------------------------------------------------------------
    def audit(self, tolerance: float) -> dict[str, Any]:
        """Certify exact unlearning: retrain from theta^0 without every unlearned client; compare.

        The replay is a second fit (``reset`` with the unlearned clients excluded, then ``fit`` with
        silent events) by the method's own code, not the unlearning code path; it must give the
        same bits. :func:`~.reference.certify` adds the independent reference
        (:meth:`reference_params`) and the verdict line; ``summary`` is what that line says of this
        check. Methods that only approximate retraining (``exact = False``) cannot be certified.
        """
        if not self.exact:
            raise ConfigError(f"trainer.algorithm: {self.name} does not support audit (it is not exact)")
        saved, ctx = self.state_dict(), self.ctx
        self.ctx = replace(ctx, events=LoopEvents())
        try:
            self.reset(saved["theta0"], exclude=saved["unlearned"])
            reference = {k: v.clone() for k, v in self.fit().items()}
            steps = self.total_client_steps
        finally:
            self.ctx = ctx
            self.load_state_dict(saved)
        return retrain_audit(self.current_params(), reference, list(self.unlearned), tolerance, steps)

    def reference_params(self) -> dict[str, Tensor] | None:
        """The current model recomputed by :class:`~.reference.ReferenceReplay`, or None (no reference).

        ``audit``'s independent check: the method's record (groups, initial models, rounds, the
        clients that remain) trained by the per-client loop kernel and averaged by a plain mean,
        none of the engine's drivers or aggregation. A method overrides it where its record
        allows; a subclass that trains otherwise than its parent overrides it or returns None.
        """
        return None

    # -- to implement -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Tensor]:
        """Train from the state (fresh: from ``theta0``); return the final model's parameters."""
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

    def predict_latency(self, clients: Sequence[int]) -> int:
        """Latency of :meth:`unlearn` in steps, computed before running it (SPEC section 8).

        Clients train in parallel as in a deployment: a round costs its slowest participant's
        local steps, and groups retrained side by side cost their slowest one.
        """
        raise NotImplementedError

    def unlearn(self, clients: Sequence[int]) -> UnlearnResult:
        """Remove ``clients``' contribution; update the state so that later requests accumulate."""
        raise NotImplementedError


def check_implemented(alg: Algorithm) -> None:
    """Refuse, before training, an algorithm that leaves a required method to the base class."""
    missing = [m for m in REQUIRED if getattr(type(alg), m) is getattr(Algorithm, m)]
    if missing:
        raise ContractError(
            f"trainer.algorithm: {type(alg).__name__} does not define {', '.join(m + '()' for m in missing)}; "
            f"an Algorithm subclass defines all of {', '.join(m + '()' for m in REQUIRED)} (docs/extending.md)"
        )
