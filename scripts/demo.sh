#!/usr/bin/env bash
# Sets up elasticft and runs the demo: 2 workers training, one SIGKILLed mid-run, recovery,
# completion, and the run's report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
