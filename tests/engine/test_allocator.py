"""The allocator setting: applied once on glibc, skippable by environment variable."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CODE = "from fedshard_lightning.engine.allocator import retain_freed_memory as r; print(r(), r())"


def _run(env_extra: dict[str, str]) -> str:
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_applied_once_on_glibc():
    assert _run({}) == "True True"


def test_environment_variable_leaves_malloc_alone():
    assert _run({"FEDSHARD_KEEP_MALLOC": "1"}) == "False False"
