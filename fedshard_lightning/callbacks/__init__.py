"""Built-in federated callbacks."""

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.metrics_logger import MetricsLogger
from fedshard_lightning.callbacks.progress import ProgressBar
from fedshard_lightning.callbacks.replay import MembershipAudit, UnlearningReplay
from fedshard_lightning.callbacks.stage_merge_logger import StageMergeLogger

__all__ = [
    "FederatedCallback",
    "MembershipAudit",
    "MetricsLogger",
    "ProgressBar",
    "StageMergeLogger",
    "UnlearningReplay",
]
