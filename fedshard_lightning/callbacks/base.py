"""Federated callbacks: plain objects with named hooks, fired by ``Fabric.call``.

Lightning's own ``Callback`` needs a ``Trainer`` and a ``LightningModule`` in every hook, which do
not exist in a Fabric loop, so fedshard_lightning has its own small base class. Every hook takes
the :class:`~fedshard_lightning.trainer.trainer.FederatedTrainer` first and keyword arguments after it;
override only the hooks you need.

Hooks, in the order they fire during ``fit``:

* ``on_fit_start(trainer)``
* ``on_stage_start(trainer, stage, groups)``: the groups (shards) about to train.
* ``on_stage_merge(trainer, stage, groups, alphas, rounds)``: FedShard's merge decision (A1) and
  round allocation (A2) for the new stage.
* ``on_round_end(trainer, info, metrics)``: after each FedAvg round of a stage.
* ``on_commit(trainer, version, label)``: the loop committed a new FLCache version (each stage,
  and each ``unlearn`` request; first process only).
* ``on_stage_end(trainer, stage, metrics)``: a stage is complete (the trainer has committed it to FLCache).
* ``on_fit_end(trainer, metrics)``

and ``on_test_end(trainer, metrics)``, ``on_unlearn_start(trainer, clients)``,
``on_unlearn_end(trainer, report)``, ``on_audit_start(trainer)``, ``on_audit_end(trainer, result)``;
``on_groups_trained(trainer, stage, groups, client_steps)`` after every engine call (fit,
unlearn, audit), for progress.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FederatedCallback"]


class FederatedCallback:
    """Base class; every hook is a no-op."""

    def on_fit_start(self, trainer: Any) -> None:
        """Training is about to start (run directory and data are ready)."""

    def on_stage_start(self, trainer: Any, stage: int, groups: Any) -> None:
        """A stage's groups are about to train."""

    def on_stage_merge(self, trainer: Any, stage: int, groups: Any, alphas: Any, rounds: Any) -> None:
        """FedShard merged the shards of ``stage - 1`` into ``groups`` and allocated ``rounds``."""

    def on_round_end(self, trainer: Any, info: Any, metrics: dict[str, float]) -> None:
        """A FedAvg round finished; ``metrics`` holds what the trainer measured."""

    def on_commit(self, trainer: Any, version: str, label: str) -> None:
        """The loop committed FLCache ``version`` (labelled e.g. ``stage-0003``, ``unlearn-0001``)."""

    def on_stage_end(self, trainer: Any, stage: int, metrics: dict[str, float]) -> None:
        """A stage is complete."""

    def on_fit_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        """Training finished; ``metrics`` are the final ones."""

    def on_test_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        """Evaluation of a finished run finished."""

    def on_unlearn_start(self, trainer: Any, clients: list[int]) -> None:
        """An unlearning request is about to run."""

    def on_unlearn_end(self, trainer: Any, report: dict[str, Any]) -> None:
        """An unlearning request finished and was committed."""

    def on_audit_start(self, trainer: Any) -> None:
        """An audit's replay is about to run."""

    def on_audit_end(self, trainer: Any, result: dict[str, Any]) -> None:
        """An audit finished (``result["passed"]``)."""

    def on_groups_trained(self, trainer: Any, stage: int, groups: Any, client_steps: int) -> None:
        """An engine call trained ``groups`` (in fit, unlearn or audit) with ``client_steps``."""
