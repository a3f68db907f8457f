"""The CLI run in-process, for tests that check its exit status and its one-line errors."""

from __future__ import annotations

import contextlib
import io

from fedshard_lightning.cli import main


def cli(args: list[str]) -> tuple[int, str, str]:
    """Run ``main(args)`` in-process; returns (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()
