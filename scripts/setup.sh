#!/usr/bin/env bash
# Creates .venv (if absent) and installs elasticft with its test and report extras.
# torch comes from the local CPU wheel when pip's find-links has one (pip install torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, elasticft, nvidia.nccl, xdist" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.elasticft-installed ] || [ setup.py -nt .venv/.elasticft-installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, elasticft" || { echo "setup: installing elasticft failed" >&2; exit 1; }
  touch .venv/.elasticft-installed
fi
