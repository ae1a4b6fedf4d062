"""A failure that repeats before the first step stops the run after the second attempt, with
the reason in the launcher's log, the event log and ``elasticft report``; real gloo workers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.conftest import BIN

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
