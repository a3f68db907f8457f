"""The command line: ``python -m fedshard_lightning``.

:mod:`~fedshard_lightning.cli.federated_cli` (a LightningCLI over the trainer, and :func:`main`),
the checks of its input (:mod:`~fedshard_lightning.cli.inputs`,
:mod:`~fedshard_lightning.cli.yaml_bounds`, :mod:`~fedshard_lightning.cli.config_code`) and the
commands that need no config (:mod:`~fedshard_lightning.cli.no_config`: ``runs``, ``cache``).
Names are imported on first use (PEP 562): ``runs`` lists runs without importing Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedshard_lightning.cli.federated_cli import (
        FederatedCLI,
        check_config_file,
        launcher_seed,
        main,
        with_run_config,
    )
    from fedshard_lightning.launch.parse_errors import PlainHelpParser, parse_reason, plain_text

__all__ = [
    "FederatedCLI",
    "PlainHelpParser",
    "check_config_file",
    "launcher_seed",
    "main",
    "parse_reason",
    "plain_text",
    "with_run_config",
]


def __getattr__(name: str) -> Any:
    if name in ("FederatedCLI", "check_config_file", "launcher_seed", "main", "with_run_config"):
        from fedshard_lightning.cli import federated_cli

        return getattr(federated_cli, name)
    if name in ("PlainHelpParser", "parse_reason", "plain_text"):
        from fedshard_lightning.launch import parse_errors

        return getattr(parse_errors, name)
    raise AttributeError(f"module 'fedshard_lightning.cli' has no attribute {name!r}")
