"""Equal training budgets for a comparison of unlearning methods, in client-steps.

A comparison of unlearning costs means little when the methods trained different amounts: a
method that trained less also has less to retrain. The reference is FedShard's fit (its rounds
come from A2, so it cannot be set in advance); every other method gets the number of rounds that
spends the same client-steps (one client-step = one local optimizer step of one client):

- all-client methods (FedAvg, FedEraser, RapidRetrain, FedRecover; ``client_fraction`` applied):
  ``rounds = round(C / (f * S))`` with ``C`` FedShard's fit client-steps, ``S`` the client-steps of
  one round of all clients and ``f`` the client fraction;
- FATS draws ``sample_size`` clients with replacement per round and drops duplicates, so a round
  holds ``K (1 - (1 - 1/K)^m)`` distinct clients on average: ``rounds = round(C / (S * that / K))``.

A FedShard after the first method whose rounds are calibrated (``rounds: auto`` or ``stage_a2``)
gets the calibration cap ``max_rounds = floor(C / (P * S))`` with ``P`` its number of stages: no
stage trains more than its share of the budget. With stage-shared rounds (``stage_a2``) that run
to the cap, as they do on digits, the fit spends ``P * S * cap``, just under ``C``; a stage that
converges earlier spends less (the table reports every fit's client-steps).

RapidRetrain keeps its ratio of unlearning to training rounds. The fit's real client-steps are
reported beside the target, because rounding (and FATS's draws) leave a small difference. The
copy's recorded constructor arguments (the run's cache fingerprint and hparams) get the new
rounds too: a run reopened from its recorded settings must retrain the rounds it trained.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from fedshard_lightning.sharding import AutoRounds, num_stages

__all__ = ["match_budget"]


def _distinct_share(num_clients: int, draws: int) -> float:
    """Expected share of distinct clients in ``draws`` draws with replacement out of ``num_clients``."""
    return 1.0 - (1.0 - 1.0 / num_clients) ** draws


def match_budget(algorithm: Any, budget: int, client_steps: Sequence[int]) -> tuple[Any, dict[str, Any]]:
    """A copy of ``algorithm`` whose fit spends about ``budget`` client-steps.

    Args:
        algorithm: A baseline with a ``rounds`` attribute (FedAvg, FATS, FedEraser, RapidRetrain,
            FedRecover); FedShard and other algorithms without one are returned unchanged.
        budget: Target client-steps (FedShard's fit).
        client_steps: Local steps of one round of every client (same schedule for all methods).

    Returns:
        ``(copy, how)`` where ``how`` says how it was matched: ``rounds``, ``target_client_steps``
        and a sentence ``rule``.
    """
    alg = copy.deepcopy(algorithm)
    policy = getattr(alg, "round_policy", None)
    if isinstance(policy, AutoRounds):
        return _cap_calibration(alg, policy, budget, client_steps)
    if not hasattr(alg, "rounds") or not isinstance(alg.rounds, int):
        return alg, {"rule": "reference (its own rounds)", "rounds": None, "target_client_steps": budget}
    k = len(client_steps)
    per_round = float(sum(client_steps))
    if hasattr(alg, "sample_size"):
        share = _distinct_share(k, int(alg.sample_size))
        rule = f"round(C / (S * {share:.3f})): {alg.sample_size} draws with replacement per round"
    else:
        share = float(getattr(alg, "client_fraction", 1.0))
        rule = "round(C / S): all clients every round" if share == 1.0 else f"round(C / ({share} S))"
    old = alg.rounds
    rounds = max(1, round(budget / (per_round * share)))
    alg.rounds = rounds
    changed = {"rounds": rounds}
    if hasattr(alg, "unlearn_rounds"):  # RapidRetrain: keep the configured share of rounds
        alg.unlearn_rounds = changed["unlearn_rounds"] = max(1, round(alg.unlearn_rounds * rounds / old))
        rule += f"; unlearn_rounds scaled to {alg.unlearn_rounds}"
    recorded = getattr(alg, "_init_args", None)
    if isinstance(recorded, dict):  # what the fingerprint and a reopened run read (init_args.py)
        object.__setattr__(alg, "_init_args", {**recorded, **changed})
    return alg, {"rule": rule, "rounds": rounds, "target_client_steps": budget}


def _cap_calibration(
    alg: Any, policy: AutoRounds, budget: int, client_steps: Sequence[int]
) -> tuple[Any, dict[str, Any]]:
    """A FedShard with calibrated rounds, its cap set so that ``P`` stages at the cap spend ``budget``."""
    stages = num_stages(len(client_steps), alg.merge_rate)
    cap = max(1, int(budget // (stages * float(sum(client_steps)))))
    policy = copy.deepcopy(policy)
    policy.max_rounds = cap
    alg.round_policy = policy
    recorded = getattr(alg, "_init_args", None)
    if isinstance(recorded, dict):
        object.__setattr__(alg, "_init_args", {**recorded, "max_rounds": cap})
    rule = f"calibration cap max_rounds = floor(C / (P S)) = {cap} (P = {stages} stages)"
    return alg, {"rule": rule, "rounds": cap, "target_client_steps": budget}
