"""`elasticft status --run-dir` finds each rank's process: rank -> pid and host, from the event
log. A warm-started worker's /proc/<pid>/environ holds the warm interpreter's environment, not its
RANK, so this is how a rank's process is found."""

from __future__ import annotations

import json
import re
import socket
import subprocess
from pathlib import Path

import psutil
import pytest

from elasticft.events import EventLog
from elasticft.report.status import format_worker_processes, worker_processes
from tests.agent.test_launch import wait_until
from tests.conftest import BIN

REPORT_PID = Path(__file__).parents[1] / "agent" / "workers" / "report_pid.py"


@pytest.mark.timeout(30)
def test_status_shows_each_nodes_newest_workers(tmp_path: Path) -> None:
    a, b = EventLog(tmp_path, "node-a"), EventLog(tmp_path, "node-b")
    a.emit("workers_started", attempt=0, pids={"0": 10, "1": 11}, host="ha")
    b.emit("workers_started", attempt=0, pids={"2": 20, "3": 21}, host="hb")
    a.emit("workers_started", attempt=1, pids={"0": 12, "1": 13}, host="ha")
    b.emit("run_end", state="failed")
    a.close()
    b.close()
    found = worker_processes(tmp_path)
    assert [(w["node"], w["attempt"], w["pids"], w["ended"]) for w in found] == [
        ("node-a", 1, {0: 12, 1: 13}, False), ("node-b", 0, {2: 20, 3: 21}, True)]
    text = format_worker_processes(found)
    assert "    rank 1: pid 13 on ha" in text and "node node-b (host hb, attempt 0, ended)" in text
    assert format_worker_processes([]) == "workers: none started yet"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_status_maps_each_rank_to_its_running_process(tmp_path: Path,
                                                      job_env: dict[str, str]) -> None:
    pids, run_dir = tmp_path / "pids", tmp_path / "run"
    pids.mkdir()
    job = subprocess.Popen(
        [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2", "--run-dir",
         str(run_dir), str(REPORT_PID), str(pids)],
        env=job_env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(list(pids.iterdir())) == 2, 120, "both workers' pid files")
        own = {int(p.name): int(p.read_text()) for p in pids.iterdir()}
        status = subprocess.run([str(BIN / "elasticft"), "status", "--run-dir", str(run_dir)],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        host = socket.gethostname()
        listed = {int(r): int(p) for r, p in re.findall(rf"rank (\d+): pid (\d+) on {host}",
                                                        status.stdout)}
        assert listed == own, status.stdout
        for pid in listed.values():  # the workers themselves, running the script
            assert str(REPORT_PID) in psutil.Process(pid).cmdline()
        as_json = json.loads(subprocess.run(
            [str(BIN / "elasticft"), "status", "--run-dir", str(run_dir), "--json"],
            capture_output=True, text=True, timeout=60, check=True).stdout)
        (workers,) = as_json["workers"]
        assert {int(r): p for r, p in workers["pids"].items()} == own
        assert workers["host"] == host and workers["ended"] is False
    finally:
        job.terminate()
        job.communicate(timeout=120)
