#!/usr/bin/env bash
# Installs fedshard_lightning and its test tools into the current Python environment.
# torch is pinned to the local CPU wheel (2.13.0) first when it is missing, so that pip does not
# pull a multi-GB CUDA build to satisfy the package's torch range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
