#!/usr/bin/env bash
# Creates .venv (if absent) and installs elasticft with its test and report extras.
# torch comes from the local CPU wheel when pip's find-links has one (pip install torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Runs a command with its output kept aside, shown only when it fails: pip's build output
# (setuptools' warnings about an editable install) is no part of a demo.
quietly() {
  local log status=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || status=$?
  [ "$status" = 0 ] || cat "$log" >&2
  rm -f "$log"
  return "$status"
}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, elasticft, nvidia.nccl, xdist" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.elasticft-installed ] || [ setup.py -nt .venv/.elasticft-installed ]; then
  quietly .venv/bin/python -m pip install --upgrade pip || true
  quietly .venv/bin/python -m pip install "torch==2.13.0" || true
  # One editable install of this checkout at a time: scripts/compat.sh makes its own beside
  # this one (scripts/test.sh starts both at once), and each may build the shim in place.
  exec 7<setup.py
  flock 7
  quietly .venv/bin/python -m pip install -e ".[dev]" || true
  flock -u 7
  .venv/bin/python -c "import torch, elasticft" || { echo "setup: installing elasticft failed" >&2; exit 1; }
  touch .venv/.elasticft-installed
fi
