"""Built-in federated callbacks."""

from fedshard_lightning.callbacks.base import FederatedCallback
from fedshard_lightning.callbacks.checkpoint import FLCacheCheckpoint
from fedshard_lightning.callbacks.metrics_logger import MetricsLogger
from fedshard_lightning.callbacks.progress import ProgressBar

__all__ = ["FLCacheCheckpoint", "FederatedCallback", "MetricsLogger", "ProgressBar"]
