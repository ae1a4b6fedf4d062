"""A failure that repeats before the first step stops the run after the second attempt, with
the reason in the launcher's log, the event log and ``elasticft report``; real gloo workers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.conftest import BIN
from tests.tuned_run import tuned_run

PARITY = Path(__file__).parent / "workers" / "parity.py"
REASON = ("the same failure before the first step of two attempts in a row, not restarted (a "
          "restart would fail the same way; 2 of --max-restarts 3 left unused)")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failure_that_repeats_before_the_first_step_stops(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2", "--max-restarts",
         "3", "--run-dir", str(run_dir), str(PARITY), "repeat"],
        env=job_env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-5000:]
    frame = f"{PARITY}:{_line_of(PARITY, 'raise RuntimeError')} in load_data"

    decision = next(line for line in proc.stderr.splitlines() if "decision: stop" in line)
    assert REASON in decision and frame in decision
    assert "with 1 restart(s)" in proc.stderr

    events = read_events(run_dir)
    assert [e["kind"] for e in events].count("workers_started") == 2
    decisions = [e for e in events if e["kind"] == "decision"]
    assert [d["action"] for d in decisions] == ["restart_in_place", "stop"]
    assert decisions[0]["step_completed"] is False and decisions[0]["previous_failure"] is None
    stop = decisions[1]
    assert REASON in stop["reason"]
    assert stop["step_completed"] is False
    assert stop["signature"] == stop["previous_failure"] == {
        "failure_class": "unknown", "exception": "RuntimeError", "frame": frame}
    end = next(e for e in events if e["kind"] == "run_end")
    assert REASON in end["reason"] and end["restarts"] == 1

    report = subprocess.run([str(BIN / "elasticft"), "report", str(run_dir)],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert f"ended: {REASON}" in report.stdout


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


RESET_AFTER_INIT = Path(__file__).parent / "workers" / "reset_after_init.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_communication_fault_that_repeats_before_the_first_step_waits_longer_each_time(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [*tuned_run({"restart_backoff_max_s": 5}), "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "3", "--monitor-interval", "0.2", "--restart-backoff-s", "0.4",
         "--run-dir", str(run_dir), str(RESET_AFTER_INIT)],
        env=job_env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-5000:]
    # Restarted until --max-restarts is spent (a communication fault may clear: no repeat stop).
    assert "with 3 restart(s)" in proc.stderr, proc.stderr[-5000:]
    assert "ConnectionResetError: connection reset by peer while loading shard 3" in proc.stderr

    # The first fault is restarted at once; each repeat waits, longer each time, and says so.
    logged = [(float(m[0]), int(m[1]), int(m[2])) for m in re.findall(
        r"waiting (\d+\.\d+) s before restart (\d+): the same communication fault before the "
        r"first step (\d+) times in a row", proc.stderr)]
    assert [(restart, times) for _, restart, times in logged] == [(2, 2), (3, 3)], proc.stderr
    waits = [wait for wait, _, _ in logged]
    assert 0.3 <= waits[0] <= 0.4 and 0.6 <= waits[1] <= 0.8 and waits[1] > waits[0]

    events = read_events(run_dir)
    backoffs = [e for e in events if e["kind"] == "backoff"]
    assert [e["wait_s"] for e in backoffs] == pytest.approx(waits, abs=0.01)
    assert [e["repeats"] for e in backoffs] == [1, 2]
    assert all("ConnectionResetError" in e["reason"] for e in backoffs)
    # The wait lies between the decision and the next attempt's workers.
    for backoff in backoffs:
        decided = max(e["mono"] for e in events
                      if e["kind"] == "decision" and e["mono"] <= backoff["mono"])
        started = min(e["mono"] for e in events
                      if e["kind"] == "workers_started" and e["mono"] > backoff["mono"])
        assert started - decided >= backoff["wait_s"]
