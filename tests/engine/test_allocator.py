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


@pytest.mark.slow  # a fresh interpreter importing torch; the glibc test above covers the setting itself
def test_environment_variable_leaves_malloc_alone():
    assert _run({"FEDSHARD_KEEP_MALLOC": "1"}) == "False False"


@pytest.mark.slow  # a fresh interpreter importing torch and Lightning
def test_building_an_engine_changes_no_process_setting():
    code = (
        "import torch\n"
        "from fedshard_lightning.data import SyntheticDataModule\n"
        "from fedshard_lightning.engine import FederatedEngine, LocalSchedule\n"
        "from fedshard_lightning.engine import allocator\n"
        "from fedshard_lightning.models import MLP\n"
        "dm = SyntheticDataModule(num_clients=2, partition='iid', num_samples=20, shape=(4,)); dm.setup()\n"
        "m = MLP(hidden=(4,)); m.bind_data(dm.input_shape, dm.num_classes)\n"
        "FederatedEngine(m, dm, LocalSchedule(batch_size=5))\n"
        "print(allocator._done)\n"
        "allocator.configure_process('cpu')\n"
        "print(allocator._done is not None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["None", "True"]
