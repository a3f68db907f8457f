"""Sharding of FedShard: the shard tree, the signed contribution angle, merging A1 and rounds A2.

Pure functions and small classes over small data (SPEC sections 1, 2, 4, 5 and 7); the training
loop lives in the engine and the FedShard algorithm.
"""

from __future__ import annotations

from fedshard_lightning.sharding.contribution import flatten_update, signed_angles, unflatten_update
from fedshard_lightning.sharding.costs import (
    StageCosts,
    eq7_weights,
    expected_future_costs,
    predicted_m_e,
    refine_by_swaps,
    tree_client_costs,
)
from fedshard_lightning.sharding.merging import (
    A1Merge,
    MergePolicy,
    RandomMerge,
    a1_grouping,
    group_capacities,
    random_grouping,
)
from fedshard_lightning.sharding.rounds import (
    A2Rounds,
    AutoRounds,
    ConvergenceTracker,
    FixedRounds,
    RoundPolicy,
    StageA2Rounds,
    a2_rounds,
)
from fedshard_lightning.sharding.tree import Shard, ShardTree, num_stages

__all__ = [
    "A1Merge",
    "A2Rounds",
    "AutoRounds",
    "ConvergenceTracker",
    "FixedRounds",
    "MergePolicy",
    "RandomMerge",
    "RoundPolicy",
    "Shard",
    "ShardTree",
    "StageA2Rounds",
    "StageCosts",
    "a1_grouping",
    "a2_rounds",
    "eq7_weights",
    "expected_future_costs",
    "flatten_update",
    "group_capacities",
    "num_stages",
    "predicted_m_e",
    "random_grouping",
    "refine_by_swaps",
    "signed_angles",
    "tree_client_costs",
    "unflatten_update",
]
