"""Built-in federated callbacks: progress, metrics logging, fairness logging, stage-merge logging, the unlearning replay.

Callbacks observe; they never commit (FLCache commits are the trainer's). :func:`default_callbacks`
says which ones every trainer adds. The design card's four:

* :class:`StageMergeLogger`: every merge of FedShard (groups, alphas, rounds) to ``merges.jsonl``
  and ``merge/...`` scalars, so the shard tree grows in the loggers.
* :class:`FLCacheCheckpoint`: the loop commits FLCache itself (atomic, one version per stage and
  per request); this callback verifies each commit, keeps the models of the newest versions and
  says what the deployed model is exported as (on by default; ``enable_checkpointing: false``
  drops it and keeps only the final model).
* :class:`UnlearningReplay`: every client unlearned alone after ``fit``: measured costs, M_e, M_p,
  membership inference, plots, ``RUN/fairness/``.
* :class:`FairnessLogger`: M_e from the predicted costs and M_p within a replay budget, after
  every ``fit`` and ``unlearn`` (on by default).
"""

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.fairness_logger import FairnessLogger
from fedshard_lightning.callbacks.flcache_checkpoint import FLCacheCheckpoint
from fedshard_lightning.callbacks.metrics_logger import MetricsLogger
from fedshard_lightning.callbacks.progress import ProgressBar
from fedshard_lightning.callbacks.replay import MembershipAudit, UnlearningReplay
from fedshard_lightning.callbacks.stage_merge_logger import StageMergeLogger
from fedshard_lightning.callbacks.task_progress import TaskProgress, TaskProgressCallback

__all__ = [
    "FLCacheCheckpoint",
    "FairnessLogger",
    "FederatedCallback",
    "MembershipAudit",
    "MetricsLogger",
    "ProgressBar",
    "StageMergeLogger",
    "TaskProgress",
    "TaskProgressCallback",
    "UnlearningReplay",
    "default_callbacks",
]


def default_callbacks(
    user: list[FederatedCallback],
    progress_bar: bool,
    fairness: bool = True,
    checkpoint: FLCacheCheckpoint | None = None,
) -> list[FederatedCallback]:
    """The defaults the user did not pass their own of, then the user's.

    Progress (when enabled), metrics, stage-merge logging, the trainer's ``checkpoint`` (its
    :class:`FLCacheCheckpoint`, when not among the user's; ``None`` with checkpointing off) and
    fairness logging (when enabled). An :class:`UnlearningReplay` reports fairness itself
    (under the same ``fairness/`` names), so it takes the default :class:`FairnessLogger`'s place.
    """
    kinds = {type(c) for c in user}
    out: list[FederatedCallback] = []
    if progress_bar and ProgressBar not in kinds:
        out.append(ProgressBar())
    if progress_bar and TaskProgressCallback not in kinds:
        out.append(TaskProgressCallback())
    if MetricsLogger not in kinds:
        out.append(MetricsLogger())
    if StageMergeLogger not in kinds:
        out.append(StageMergeLogger())
    if checkpoint is not None and not any(c is checkpoint for c in user):
        out.append(checkpoint)
    if fairness and not kinds & {FairnessLogger, UnlearningReplay}:
        out.append(FairnessLogger())
    return out + list(user)
