#!/usr/bin/env bash
# Installs fedmeta into ./.venv from scratch: torch first, then the project with its test extras.
# torch comes from PyTorch's own CPU wheel index where it answers within a few seconds (on Linux the
# public index's torch is the multi-GB CUDA build), else from the configured index (pip's own
# settings: PyPI, a mirror, a wheel folder); one line says which build it got and from where.
# Usage: bash scripts/install.sh            (FEDMETA_TORCH=2.13.0 by default; set it to change;
#        FEDMETA_TORCH_INDEX=URL another CPU wheel index, FEDMETA_TORCH_INDEX= none)
set -euo pipefail

#: PyTorch's CPU-only wheels (torch and its dependencies).
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
#: Seconds the index has to answer: offline or behind a firewall, the fallback starts at once.
PROBE_SECONDS=5

# Whether the wheel index at $1 answers within PROBE_SECONDS (a name that does not resolve, a
# connection that hangs and an HTTP error all count as no). `timeout` bounds the name lookup too,
# which urllib's own timeout does not.
index_reachable() {
  local url=$1 python=${2:-python3}
  [ -n "$url" ] || return 1
  local bound=()
  if command -v timeout >/dev/null 2>&1; then bound=(timeout "$((PROBE_SECONDS + 1))"); fi
  ${bound[@]+"${bound[@]}"} "$python" -c '
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=float(sys.argv[2])).close()
' "$url" "$PROBE_SECONDS" >/dev/null 2>&1
}

# torch into the venv at $1, version $2; prints one line: the build and where it came from.
install_torch() {
  local venv=$1 version=$2 index=${FEDMETA_TORCH_INDEX-$TORCH_CPU_INDEX} source
  if "$venv/bin/python" -c "import torch" 2>/dev/null; then
    source="already in $venv"
  elif index_reachable "$index" "$venv/bin/python"; then
    "$venv/bin/python" -m pip install -q --index-url "$index" "torch==${version}"
    source="from PyTorch's CPU wheel index ($index)"
  else
    "$venv/bin/python" -m pip install -q "torch==${version}"
    source="from the configured package index (${index:-no CPU index set} did not answer within \
${PROBE_SECONDS} s)"
  fi
  "$venv/bin/python" -W ignore::UserWarning -c '
import sys, torch
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
print(f"torch {torch.__version__}: {build}, {sys.argv[1]}")
' "$source"
}

main() {
  cd "$(dirname "$0")/.."
  local python=${PYTHON:-python3} venv=${FEDMETA_VENV:-.venv} torch_version=${FEDMETA_TORCH:-2.13.0}
  # Flower's update check and telemetry and Ray's usage stats stay off everywhere fedmeta runs.
  export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_USAGE_STATS_ENABLED=0
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip
  install_torch "$venv" "$torch_version"
  "$venv/bin/python" -m pip install -q -e ".[test]"
  "$venv/bin/fedmeta" --help >/dev/null
  echo "fedmeta installed in $venv"
}

# Run, not sourced (a test sources it to check the probe alone).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
