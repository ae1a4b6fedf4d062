"""`elasticft status --run-dir`: the newest diagnostics detections of a run, from its event log."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from elasticft.events import EventLog
from tests.conftest import BIN


def _statuses(*arg_lists: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """`elasticft status` with each argument list, all started at once (each loads torch)."""
    procs = [subprocess.Popen([str(BIN / "elasticft"), "status", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in arg_lists]
    done = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=60)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_status_shows_the_newest_detections_of_a_run(tmp_path: Path, job_env):
    for node in ("node-a", "node-b"):
        log = EventLog(tmp_path / node, node)
        log.emit("workers_started", attempt=0)
        for i in range(3):
            log.emit("detection", detector="slow_rank", message=f"slow rank {i} on {node}",
                     rank=i)
        log.close()
    last = EventLog(tmp_path / "node-a", "node-a")
    last.emit("detection", detector="hang", message="hang: all_reduce; culprit: rank 1 on node-a")
    last.close()

    shown, json_shown = _statuses(["--run-dir", str(tmp_path), "--detections", "2"],
                                  ["--run-dir", str(tmp_path), "--json"])
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    # The workers' processes come first (none recorded here), then the detections.
    lines = lines[lines.index(f"detections in {tmp_path}: 2"):]
    assert "node-b  slow_rank: slow rank 2 on node-b" in lines[1]
    assert "node-a  hang: hang: all_reduce; culprit: rank 1 on node-a" in lines[2]

    as_json = json.loads(json_shown.stdout)
    detections = as_json["detections"]
    assert len(detections) == 7
    assert [d["detector"] for d in detections].count("slow_rank") == 6
    assert detections[-1]["node"] == "node-a" and detections[-1]["detector"] == "hang"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_status_without_job_or_run_dir_names_both_fixes(tmp_path: Path):
    done, missing = _statuses(["--rdzv-id", ""], ["--run-dir", str(tmp_path / "nope")])
    assert done.returncode != 0
    assert "--rdzv-id" in done.stderr and "--run-dir" in done.stderr
    assert missing.returncode != 0 and "is not a directory" in missing.stderr
