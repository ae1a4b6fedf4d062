#!/usr/bin/env bash
# Sets up everything and runs the whole test suite (unit, multi-process, real etcd and Slurm).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-servers.sh
.venv/bin/ruff check elasticft tests bench examples scripts
exec .venv/bin/python -m pytest -p no:cacheprovider -q --durations=25 "$@"
