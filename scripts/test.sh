#!/usr/bin/env bash
# Sets up everything and runs the whole test suite (unit, multi-process, real etcd and Slurm) on
# the local torch (.venv), then the smoke subset on a second torch release (scripts/compat.sh).
# Extra arguments go to the full suite's pytest runs, e.g. `scripts/test.sh -m "not slow"`.
# ELASTICFT_COMPAT_TORCH picks the second release (default 2.14.1, from the local pip index);
# set it to "none" to leave that run out (it is then reported as left out, never passed).
# TEST_WORKERS sets how many pytest-xdist workers share the full suite's run (default 5; each
# takes whole test files; 0 runs everything in one process). The multi-process tests wait on real
# processes part of the time, so five at a time keep 2 cores busy; the smoke subset on the second
# torch runs beside them (one worker), and the tests marked `serial` run alone at the end. (Not an
# ELASTICFT_* variable: elasticft-run refuses ELASTICFT_* names it does not know, and the tests
# launch it.)
# Exit status: non-zero when either run fails; each run's status is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is cached (in the checkout's gitignored __pycache__): a shell that turns it off would
# have each of the run's pytest processes rewrite and compile every test module again (~3.5 s CPU
# each) and each launched interpreter compile what it imports from the checkout.
unset PYTHONDONTWRITEBYTECODE
COMPAT_TORCH=${ELASTICFT_COMPAT_TORCH:-2.14.1}
TEST_WORKERS=${TEST_WORKERS:-5}
# The smoke subset on the second torch starts first: its environment's install uses the core
# that this one's (single-threaded pip) leaves idle, and its tests run beside the full suite's
# parallel phase. Its output is kept until that phase is over; both are over before the serial
# phase starts.
compat_log=$(mktemp)
compat_pid=""
# A setup that fails ends the smoke run it started too.
trap 'rm -f "$compat_log"; if [ -n "$compat_pid" ]; then pkill -P "$compat_pid"; kill "$compat_pid"; fi 2>/dev/null; true' EXIT
if [ "$COMPAT_TORCH" != "none" ]; then
  TEST_WORKERS=1 bash scripts/compat.sh "$COMPAT_TORCH" >"$compat_log" 2>&1 &
  compat_pid=$!
fi
bash scripts/setup.sh
bash scripts/install-servers.sh
.venv/bin/ruff check elasticft tests bench examples scripts
set +e
# Files go to the workers longest first (tests/conftest.py orders them; xdist must not reorder).
TEST_PHASE=parallel .venv/bin/python -m pytest -p no:cacheprovider -q --durations=25 \
  -n "$TEST_WORKERS" --dist loadfile --no-loadscope-reorder "$@"
parallel=$?
if [ "$COMPAT_TORCH" = "none" ]; then
  compat="left out (ELASTICFT_COMPAT_TORCH=none)"
  compat_status=0
else
  wait "$compat_pid"
  compat_status=$?
  compat_pid=""
  compat="exit $compat_status"
  cat "$compat_log"
fi
# Tests marked `serial` judge thread timing in the pytest process: they run alone, afterwards.
TEST_PHASE=serial .venv/bin/python -m pytest -p no:cacheprovider -q "$@"
serial=$?
# Exit 5 is pytest's "no test selected": fine for one phase, not for both.
if [ "$parallel" -eq 5 ] && [ "$serial" -ne 5 ]; then parallel=0; fi
if [ "$serial" -eq 5 ] && [ "$parallel" -eq 0 ]; then serial=0; fi
suite=$(( parallel != 0 ? parallel : serial ))
set -e
local_torch=$(.venv/bin/python -c 'import torch; print(torch.__version__)')
echo "test.sh: full suite on torch $local_torch: exit $suite; smoke subset on torch $COMPAT_TORCH: $compat"
if [ "$suite" -ne 0 ]; then
  exit "$suite"
fi
exit "$compat_status"
