"""Built-in federated callbacks: progress, metrics logging, fairness logging, stage-merge logging, the unlearning replay.

Callbacks observe; they never commit (FLCache commits are the trainer's). :func:`default_callbacks`
says which ones every trainer adds. The design card's four:

* :class:`StageMergeLogger`: every merge of FedShard (groups, alphas, rounds) to ``merges.jsonl``
  and ``merge/...`` scalars, so the shard tree grows in the loggers.
* :class:`FLCacheCheckpoint`: the loop commits FLCache itself (atomic, one version per stage and
  per request); this callback verifies each commit and keeps the models of the newest versions.
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
    user: list[FederatedCallback], progress_bar: bool, fairness: bool = True
) -> list[FederatedCallback]:
    """Progress (when enabled), metrics and fairness logging (when enabled) unless the user passed their own, then the user's.

    An :class:`UnlearningReplay` reports fairness itself (under the same ``fairness/`` names), so
    it takes the default :class:`FairnessLogger`'s place.
    """
    kinds = {type(c) for c in user}
    out: list[FederatedCallback] = []
    if progress_bar and ProgressBar not in kinds:
        out.append(ProgressBar())
    if progress_bar and TaskProgressCallback not in kinds:
        out.append(TaskProgressCallback())
    if MetricsLogger not in kinds:
        out.append(MetricsLogger())
    if fairness and not kinds & {FairnessLogger, UnlearningReplay}:
        out.append(FairnessLogger())
    return out + list(user)
