#!/usr/bin/env bash
# Installs fedmeta into ./.venv from scratch: the CPU build of torch first (so that pip does not pull a
# multi-GB CUDA build as a dependency), then the project with its test extras.
# Usage: bash scripts/install.sh            (FEDMETA_TORCH=2.13.0 by default; set it to change)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${FEDMETA_VENV:-.venv}
torch_version=${FEDMETA_TORCH:-2.13.0}

# Flower's update check and telemetry and Ray's usage stats stay off everywhere fedmeta runs.
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_USAGE_STATS_ENABLED=0

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  "$venv/bin/python" -m pip install -q "torch==${torch_version}"
fi
"$venv/bin/python" -m pip install -q -e ".[test]"
"$venv/bin/fedmeta" --help >/dev/null
echo "fedmeta installed in $venv"
