#!/usr/bin/env bash
# Sets up elasticft and runs the demo: workers training, one SIGKILLed mid-run, recovery,
# completion, and the run's report.
#
#   bash scripts/demo.sh          CPU, gloo: makes .venv (torch for CPU) first
#   bash scripts/demo.sh --gpu    GPU, NCCL: elasticft into the machine's own torch (PYTHON=...),
#                                 one worker per GPU, a crash and then a hang, both recovered
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--gpu" ]; then
  PYTHON=${PYTHON:-python3}
  # Without its dependencies: the torch pin must not replace the machine's CUDA torch.
  installed=0
  bash scripts/install_into.sh "$PYTHON" || installed=$?
  if [ "$installed" = 3 ]; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  elif [ "$installed" != 0 ]; then
    exit "$installed"
  fi
  "$PYTHON" -m pip install -q numpy pyyaml psutil zlib-ng tenacity prometheus-client py-spy nvidia-ml-py
  exec "$PYTHON" scripts/demo.py "$@"
fi
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
