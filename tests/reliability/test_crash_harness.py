"""The crash harnesses, a few trials each (slow: each trial starts a Python process).

``scripts/crash_trials.py`` kills ``fit``, ``scripts/crash_unlearn.py`` kills ``unlearn``; after
every kill the run must resume bit-identically and ``test``, ``unlearn`` and ``audit`` must agree
on one model, never a stale one. The scripts exit 1 otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _reliability_helpers import ROOT


def _harness(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


@pytest.mark.slow
def test_killed_unlearns_resume_exactly_and_every_reader_agrees():
    out = _harness("crash_unlearn.py", "--trials", "4", "--seed", "11")
    assert "stale models 0" in out and "bit-identical 4/4" in out, out


@pytest.mark.slow
def test_killed_fits_resume_exactly_and_every_reader_agrees():
    out = _harness("crash_trials.py", "--trials", "4", "--jobs", "1", "--seed", "11")
    assert "stale models 0" in out and "bit-identical 4/4" in out, out
