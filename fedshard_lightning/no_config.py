"""The commands that need no config, ``runs`` and ``cache``, and the one-line answer to every failure.

``python -m fedshard_lightning runs`` is dispatched here before the CLI module is imported: the
CLI imports Lightning and torch (seconds), while listing runs reads a few JSON files. The same
error handling serves the CLI (:func:`fedshard_lightning.cli.main`), so both answer a user error,
an interrupt or an OS fault with the same line and exit status.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from fedshard_lightning.errors import FedShardError, Terminated
from fedshard_lightning.os_faults import describe, ignore_sigxfsz, terminate_as_interrupt

__all__ = ["NO_CONFIG", "no_config_main", "one_line", "one_line_errors", "run_no_config"]

NO_CONFIG = ("runs", "cache")


def one_line(message: str, limit: int = 600) -> str:
    """The message on one line; a long one loses its middle (a long path), never its end (the reason)."""
    text = " ".join(str(message).split())
    if len(text) <= limit:
        return text
    tail = limit // 2
    return text[: limit - tail - 5] + " ... " + text[-tail:]


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """User errors exit 2, Ctrl-C 130, SIGTERM 143, OS faults 3..7: each as one line on stderr."""
    try:
        yield
    except FedShardError as e:
        sys.stderr.write(f"error: {one_line(str(e))}\n")
        raise SystemExit(2) from None
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        sys.stderr.write("terminated (SIGTERM)\n" if terminated else "interrupted\n")
        raise SystemExit(143 if terminated else 130) from None
    except OSError as e:  # disk full, read-only, ulimit -f, no permission: one line, exit 3..7
        code, line = describe(e)
        sys.stderr.write(one_line(line) + "\n")
        raise SystemExit(code) from None


def no_config_main(argv: list[str]) -> bool:
    """Run ``runs`` or ``cache`` when ``argv`` names one; False for any other command."""
    if argv[:1] == ["runs"]:
        from fedshard_lightning.runs import runs_main

        runs_main(argv[1:])
        return True
    if argv[:1] == ["cache"]:  # maintenance without a config: cache gc / verify
        from fedshard_lightning.cache_command import cache_main

        cache_main(argv[1:])
        return True
    return False


def run_no_config(argv: list[str]) -> None:
    """``python -m fedshard_lightning runs|cache ...`` without importing the CLI (see the module docstring)."""
    ignore_sigxfsz()
    terminate_as_interrupt()
    with one_line_errors():
        no_config_main(argv)
