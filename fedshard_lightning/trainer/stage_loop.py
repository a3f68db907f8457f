"""The trainer's stage loop: a planner's fit, run plan by plan, one commit per stage.

For a :class:`~fedshard_lightning.unlearning.planner.Planner`, ``fit`` is this loop and nothing
of the method's::

    while (plan := next_stage(state)) is not None:
        on_stage_merge                 # a plan that merges earlier groups says how
        on_stage_start                 # callbacks see the plan's groups
        result = engine runs the plan  # every round measured and reported (on_round_end)
        state = absorb(state, plan, result) + the plan's client-steps
        commit FLCache; on_stage_end   # the stage is on disk before anyone hears of it
                                       # (its metrics: the loop's, stage_report's, the test accuracy)

The method cannot forget a commit, lose a field, or miscount the fit: each is the loop's. The
checks around ``next_stage``/``absorb``/``current_params`` (``unlearning/plan_contract.py``)
stop a mistake inside them when the call returns. Unlearning requests go through
``FederatedTrainer.unlearn`` as for every method: the planner's ``what_if`` is the fold of
``absorb`` over ``plan_unlearn``'s plans; the request's costs are those of the plans.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from torch import Tensor

from fedshard_lightning.unlearning.context import LoopEvents
from fedshard_lightning.unlearning.planner import Planner

if TYPE_CHECKING:
    from fedshard_lightning.unlearning.plan_state import PlanState

__all__ = ["StageLoop"]


class StageLoop:
    """The loop that runs a planner's fit with the trainer's events (``stage_end`` commits).

    Args:
        planner: The method: its plans and its state.
        events: The trainer's events: ``stage_end`` commits the state to FLCache (rank zero, then
            a barrier) before it fires ``on_stage_end``.
    """

    def __init__(self, planner: Planner, events: LoopEvents) -> None:
        self.planner, self.events = planner, events

    def fit(self) -> dict[str, Tensor]:
        """Run the fit from the planner's current state (fresh or resumed); return the final model."""
        planner, events = self.planner, self.events
        check = planner.checked
        state: PlanState = planner.state
        t = time.perf_counter()
        while (plan := check.next_stage(state)) is not None:
            if plan.merge is not None:
                m = plan.merge
                events.stage_merge(plan.stage, m.groups, m.alphas, m.rounds)
            events.stage_start(plan.stage, list(plan.groups))
            result = planner.run_plan(plan, report=True)
            state = check.absorb(state, plan, result)
            state = state._with({"total_client_steps": state.total_client_steps + result.client_steps})
            planner.load_state_dict(state)
            metrics = {
                "groups": float(len(plan.groups)),
                "client_steps": float(result.client_steps),
                "seconds": time.perf_counter() - t,  # planning (the merge) included
            }
            own, model = planner.stage_report(state, plan, result)
            metrics.update(own)
            if model is not None:
                metrics["test_accuracy"], metrics["test_loss"] = events.evaluate(model)
            events.stage_end(plan.stage, metrics)
            t = time.perf_counter()
        return check.current_params(state)
