"""Built-in federated callbacks: progress, metrics logging, stage-merge logging, the unlearning replay.

Callbacks observe; they never commit (FLCache commits are the trainer's). :func:`default_callbacks`
says which ones every trainer adds.
"""

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.metrics_logger import MetricsLogger
from fedshard_lightning.callbacks.progress import ProgressBar
from fedshard_lightning.callbacks.replay import MembershipAudit, UnlearningReplay
from fedshard_lightning.callbacks.stage_merge_logger import StageMergeLogger
from fedshard_lightning.callbacks.task_progress import TaskProgress, TaskProgressCallback

__all__ = [
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


def default_callbacks(user: list[FederatedCallback], progress_bar: bool) -> list[FederatedCallback]:
    """Progress (fit's, and unlearn's and audit's, when enabled) and metrics logging unless the user passed their own, then the user's."""
    kinds = {type(c) for c in user}
    out: list[FederatedCallback] = []
    if progress_bar and ProgressBar not in kinds:
        out.append(ProgressBar())
    if progress_bar and TaskProgressCallback not in kinds:
        out.append(TaskProgressCallback())
    if MetricsLogger not in kinds:
        out.append(MetricsLogger())
    return out + list(user)
