"""The pre-flight all-reduce: real gloo processes on this node, a correct sum and a bandwidth."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from elasticft.diag.health import allreduce_probe
from elasticft.events import read_events
from tests.conftest import BIN, EXAMPLES


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_wrong_sum_is_a_critical_issue():
    probe = allreduce_probe(2, nbytes=1 << 16, iterations=1, fault_rank=1, fault="sum")
    assert not probe.ok
    [issue] = probe.issues
    assert issue.critical and issue.check == "allreduce"
    assert "wrong sum" in issue.message


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_process_that_cannot_join_is_a_critical_issue_and_the_others_are_stopped():
    probe = allreduce_probe(3, nbytes=1 << 16, iterations=1, timeout_s=60, fault_rank=2,
                            fault="exit")
    assert not probe.ok and probe.busbw_gbps is None
    messages = {i.message for i in probe.issues}
    assert all(i.critical for i in probe.issues)
    assert any("rank 2 of 3 failed (exit 3)" in m for m in messages), messages
    # The two healthy ranks were waiting for rank 2; they are stopped, not left to time out.
    assert sum("stopped: rank(s) [2] failed" in m for m in messages) == 2, messages


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_elasticft_run_reports_the_probe_as_a_preflight_event(tmp_path: Path, job_env):
    """The probe among two processes, as elasticft-run runs it: a correct sum (no issue) and a
    bandwidth."""
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2", "--max-restarts",
         "0", "--run-dir", str(run_dir), "--diag-preflight", "allreduce",
         str(EXAMPLES / "train_plain.py"), "--steps", "2", "--ckpt-dir", str(tmp_path / "ckpt")],
        env=job_env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    [preflight] = [e for e in read_events(run_dir) if e["kind"] == "preflight"]
    assert preflight["ok"] is True
    assert preflight["allreduce"]["world"] == 2 and preflight["allreduce"]["ok"] is True
    assert preflight["allreduce"]["issues"] == []
    assert preflight["allreduce"]["busbw_gbps"] > 0


@pytest.mark.timeout(60)
def test_the_node_is_checked_once_after_the_first_rendezvous_and_never_in_worker_env(
        tmp_path: Path) -> None:
    from elasticft.addon.api import GroupInfo, WorkerInfo
    from elasticft.config import DiagConfig
    from elasticft.diag.monitor import DiagMonitor

    monitor = DiagMonitor(DiagConfig(diag_preflight="on", health_interval_s=3600), base_env={},
                          event_dir=tmp_path / "events")
    group = GroupInfo("run", "node0", tmp_path, 0, 0, 1, 0, (WorkerInfo(0, 0, 1),))

    def preflights() -> int:
        events = tmp_path / "events"
        return sum(e["kind"] == "preflight" for e in read_events(events)) if events.exists() else 0

    try:
        monitor.worker_env(group, group.workers[0])
        assert preflights() == 0
        monitor.on_rendezvous(group, None)
        assert preflights() == 1
        monitor.on_rendezvous(group, None)  # a later round: the node was checked
        monitor.worker_env(group, group.workers[0])
        assert preflights() == 1
    finally:
        monitor.close()
