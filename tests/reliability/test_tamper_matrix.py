"""``scripts/tamper_matrix.py``: a few kinds on the session's runs here, the whole matrix with ``-m slow``.

Each kind must be refused in one line (exit 2, nothing changed), detected by ``audit``, repaired,
or left unused (the same bits as the untampered run); see the script's docstring.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _reliability_helpers import ROOT

_spec = importlib.util.spec_from_file_location("tamper_matrix", ROOT / "scripts" / "tamper_matrix.py")
tamper_matrix = importlib.util.module_from_spec(_spec)
sys.modules["tamper_matrix"] = tamper_matrix  # its dataclasses look their module up there
_spec.loader.exec_module(tamper_matrix)

#: Without the key, one per outcome and the kinds a fix was made for.
FAST = {
    "rollback CURRENT, resume fit": "refused",
    "unlearned [2] -> [] rehashed, test": "refused",
    "logs/ symlinked, test": "refused",
    "cache/blobs/ symlinked, unlearn": "refused",
    "flip client_sizes blob, unlearn": "refused",
    "missing old manifest, test": "refused",
    "missing model.safetensors, test": "repaired",
    "extra file in the run folder, unlearn": "unused",
}


@pytest.fixture(scope="module")
def bases(reference_run, unlearned_run) -> tamper_matrix.Bases:
    return tamper_matrix.Bases(
        {("fit", False): reference_run, ("unlearned", False): unlearned_run}, Path("-")
    )


@pytest.mark.parametrize("name", sorted(FAST))
def test_a_tamper_kind_is_refused_repaired_or_unused(name, bases, tmp_path, monkeypatch):
    monkeypatch.delenv(tamper_matrix.KEY_VARIABLE, raising=False)
    kind = next(k for k in tamper_matrix.kinds(bases.signed_parent) if k.name == name)
    result = tamper_matrix.run_kind(kind, bases, tmp_path)
    assert result.outcome == FAST[name], (result.outcome, result.detail)


def test_the_matrix_is_large_enough():
    kinds = tamper_matrix.kinds(Path("-"))
    names = [k.name for k in kinds]
    assert len(set(names)) == len(names)
    assert sum(not k.limit for k in kinds) >= 60
    assert set(FAST) <= set(names)


@pytest.mark.slow
def test_the_whole_matrix():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tamper_matrix.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-4000:]
