"""Federated callbacks: plain objects with named hooks, fired by ``Fabric.call``.

Lightning's own ``Callback`` needs a ``Trainer`` and a ``LightningModule`` in every hook, which do
not exist in a Fabric loop, so fedshard_lightning has its own small base class. Every hook takes
a :class:`~fedshard_lightning.callbacks.view.RunView` first (a read-only view of the run: its
directory, algorithm, data, history, loggers and console; never the trainer) and keyword
arguments after it; override only the hooks you need.

Hooks, in the order they fire during ``fit``:

* ``on_fit_start(run)``
* ``on_stage_start(run, stage, groups)``: the groups (shards) about to train.
* ``on_stage_merge(run, stage, groups, alphas, rounds)``: FedShard's merge decision (A1) and
  round allocation (A2) for the new stage.
* ``on_round_end(run, info, metrics)``: after each FedAvg round of a stage.
* ``on_commit(run, version, label)``: the loop committed a new FLCache version (each stage,
  and each ``unlearn`` request; first process only).
* ``on_stage_end(run, stage, metrics)``: a stage is complete (the trainer has committed it to FLCache).
* ``on_fit_end(run, metrics)``

and ``on_test_end(run, metrics)``, ``on_unlearn_start(run, clients)``,
``on_unlearn_end(run, report)``, ``on_audit_start(run)``, ``on_audit_end(run, result)``;
``on_groups_trained(run, stage, groups, client_steps)`` after every engine call (fit,
unlearn, audit), for progress.
"""

from __future__ import annotations

from typing import Any

from fedshard_lightning.callbacks.view import RunView

__all__ = ["FederatedCallback"]


class FederatedCallback:
    """Base class; every hook is a no-op."""

    def on_fit_start(self, run: RunView) -> None:
        """Training is about to start (run directory and data are ready)."""

    def on_stage_start(self, run: RunView, stage: int, groups: Any) -> None:
        """A stage's groups are about to train."""

    def on_stage_merge(self, run: RunView, stage: int, groups: Any, alphas: Any, rounds: Any) -> None:
        """FedShard merged the shards of ``stage - 1`` into ``groups`` and allocated ``rounds``."""

    def on_round_end(self, run: RunView, info: Any, metrics: dict[str, float]) -> None:
        """A FedAvg round finished; ``metrics`` holds what the trainer measured."""

    def on_commit(self, run: RunView, version: str, label: str) -> None:
        """The loop committed FLCache ``version`` (labelled e.g. ``stage-0003``, ``unlearn-0001``)."""

    def on_stage_end(self, run: RunView, stage: int, metrics: dict[str, float]) -> None:
        """A stage is complete."""

    def on_fit_end(self, run: RunView, metrics: dict[str, float]) -> None:
        """Training finished; ``metrics`` are the final ones."""

    def on_test_end(self, run: RunView, metrics: dict[str, float]) -> None:
        """Evaluation of a finished run finished."""

    def on_unlearn_start(self, run: RunView, clients: list[int]) -> None:
        """An unlearning request is about to run."""

    def on_unlearn_end(self, run: RunView, report: dict[str, Any]) -> None:
        """An unlearning request finished and was committed."""

    def on_audit_start(self, run: RunView) -> None:
        """An audit's replay is about to run."""

    def on_audit_end(self, run: RunView, result: dict[str, Any]) -> None:
        """An audit finished (``result["passed"]``)."""

    def on_groups_trained(self, run: RunView, stage: int, groups: Any, client_steps: int) -> None:
        """An engine call trained ``groups`` (in fit, unlearn or audit) with ``client_steps``."""
