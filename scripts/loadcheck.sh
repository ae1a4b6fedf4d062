#!/usr/bin/env bash
# README command 2 (scripts/test.sh) on a busy machine: the same run, with a fixed background
# load on the same cores, so that timing races which a quiet machine hides show up here first.
# Extra arguments go to scripts/test.sh (and so to its pytest runs), e.g.
#   bash scripts/loadcheck.sh -m "not slow" tests/ckpt/integrity
# The load: LOAD_LOOPS busy loops (default 2, one per core of the 2-core machines the suite is
# sized for) at a lower priority (nice 10), as other jobs on a shared host would be; each ends
# after LOAD_LIMIT_S seconds (default 7200) even if this script is killed with SIGKILL, and this
# script ends them when it exits, however it exits otherwise. At the end it prints the tests
# that failed (pytest's FAILED and ERROR lines, of both torch runs) and the wall time.
# Exit status: scripts/test.sh's.
set -uo pipefail
cd "$(dirname "$0")/.."
LOAD_LOOPS=${LOAD_LOOPS:-2}
LOAD_LIMIT_S=${LOAD_LIMIT_S:-7200}
work=$(mktemp -d)
mkfifo "$work/out"
loops=()
run=""
stop() {
  local pid
  # The test run has a process group of its own (setsid): end it with everything it started.
  if [ -n "$run" ]; then
    kill -TERM -- "-$run" 2>/dev/null
    run=""
  fi
  for pid in "${loops[@]}"; do
    kill "$pid" 2>/dev/null
  done
  for pid in "${loops[@]}"; do
    wait "$pid" 2>/dev/null
  done
  loops=()
}
trap 'stop; rm -rf "$work"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in $(seq "$LOAD_LOOPS"); do
  # timeout passes the TERM it gets on to the loop, and ends it by itself at the limit.
  nice -n 10 timeout "$LOAD_LIMIT_S" bash -c 'while :; do :; done' &
  loops+=("$!")
done
echo "loadcheck: $LOAD_LOOPS busy loop(s) at nice 10 (for at most $LOAD_LIMIT_S s) beside: bash scripts/test.sh $*"
start=$(date +%s)
tee "$work/log" <"$work/out" &
tee_pid=$!
# In the background and waited for, so that a signal to this script is handled at once.
setsid --wait bash scripts/test.sh "$@" >"$work/out" 2>&1 &
run=$!
wait "$run"
status=$?
run=""
wait "$tee_pid"
wall=$(( $(date +%s) - start ))
failures=$(grep -E '^(FAILED|ERROR) ' "$work/log" | sort -u)
stop
echo
echo "loadcheck: failures under load:"
if [ -n "$failures" ]; then
  printf '%s\n' "$failures" | sed 's/^/  /'
elif [ "$status" -ne 0 ]; then
  echo "  no test failed, yet scripts/test.sh did (its set-up or ruff: see above)"
else
  echo "  none"
fi
printf 'loadcheck: wall time %dm%02ds with %d busy loop(s) at nice 10; scripts/test.sh exit %d\n' \
  $(( wall / 60 )) $(( wall % 60 )) "$LOAD_LOOPS" "$status"
exit "$status"
