"""Exceptions that the CLI turns into one-line messages.

Every error a user can cause by bad input derives from :class:`FedShardError`; the CLI prints
``error: <message>`` on one line and exits with status 2, without a traceback.
"""

from __future__ import annotations

__all__ = [
    "CacheError",
    "ConfigError",
    "ContractError",
    "DataError",
    "FedShardError",
    "NonFiniteLossError",
    "PeerStopped",
    "Terminated",
    "UnlearningRequestError",
]


class FedShardError(Exception):
    """Base class of all user-facing errors."""


class ConfigError(FedShardError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class ContractError(FedShardError, TypeError):
    """A user class breaks its contract: a model (logs inside the training step), an algorithm, a dataset."""


class DataError(FedShardError):
    """A dataset is missing, corrupt or cannot serve the requested partition."""


class CacheError(FedShardError):
    """An FLCache or run directory is missing, foreign, corrupt or half-written."""


class UnlearningRequestError(FedShardError, ValueError):
    """An unlearning request names unknown, duplicate or all clients."""


class NonFiniteLossError(FedShardError, FloatingPointError):
    """A client produced a NaN or infinite loss; the message names stage, shard, round and client."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``scancel``, ``docker stop``, ``kill``): stops a run as Ctrl-C does, so it says how to resume."""


class PeerStopped(KeyboardInterrupt):
    """Another process of a DDP run stopped (killed, or failed): the launcher stops as Ctrl-C does, exit 8."""
