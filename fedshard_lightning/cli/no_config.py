"""The commands that need no config, ``runs`` and ``cache``, dispatched before the CLI is imported.

``python -m fedshard_lightning runs`` is answered here: the CLI imports Lightning and torch
(seconds), while listing runs reads a few JSON files. Failures get the CLI's own one-line answer
(:func:`fedshard_lightning.launch.exits.one_line_errors`).
"""

from __future__ import annotations

from fedshard_lightning.launch.exits import one_line_errors
from fedshard_lightning.launch.os_faults import ignore_sigxfsz, terminate_as_interrupt

__all__ = ["NO_CONFIG", "no_config_main", "run_no_config"]

NO_CONFIG = ("runs", "cache")


def no_config_main(argv: list[str]) -> bool:
    """Run ``runs`` or ``cache`` when ``argv`` names one; False for any other command."""
    if argv[:1] == ["runs"]:
        from fedshard_lightning.cli.runs import runs_main

        runs_main(argv[1:])
        return True
    if argv[:1] == ["cache"]:  # maintenance without a config: cache gc / verify
        from fedshard_lightning.cli.cache_command import cache_main

        cache_main(argv[1:])
        return True
    return False


def run_no_config(argv: list[str]) -> None:
    """``python -m fedshard_lightning runs|cache ...`` without importing the CLI (see the module docstring)."""
    ignore_sigxfsz()
    terminate_as_interrupt()
    with one_line_errors():
        no_config_main(argv)
