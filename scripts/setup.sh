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
  # --no-compile: pip would compile every module of every package, over 25 s of one core; the
  # import at the end compiles the ones every run uses, once, and the rest compile when used.
  quietly .venv/bin/python -m pip install --no-compile "torch==2.13.0" || true
  # One editable install of this checkout at a time: scripts/compat.sh makes its own beside
  # this one (scripts/test.sh starts both at once), and each may build the shim in place.
  exec 7<setup.py
  flock 7
  quietly .venv/bin/python -m pip install --no-compile -e ".[dev]" || true
  flock -u 7
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "import torch, torch._dynamo, \
torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.tensor.parallel, \
elasticft.run, elasticft.agent.agent, elasticft.inprocess" \
    || { echo "setup: installing elasticft failed" >&2; exit 1; }
  touch .venv/.elasticft-installed
fi
