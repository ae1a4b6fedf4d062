"""`elasticft status --run-dir`: the newest diagnostics detections of a run, from its event log."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from elasticft.events import EventLog
from tests.conftest import BIN


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "elasticft"), "status", *args], capture_output=True,
                          text=True, timeout=60)


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

    shown = _status("--run-dir", str(tmp_path), "--detections", "2")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"detections in {tmp_path}: 2"
    assert "node-b  slow_rank: slow rank 2 on node-b" in lines[1]
    assert "node-a  hang: hang: all_reduce; culprit: rank 1 on node-a" in lines[2]

    as_json = json.loads(_status("--run-dir", str(tmp_path), "--json").stdout)
    detections = as_json["detections"]
    assert len(detections) == 7
    assert [d["detector"] for d in detections].count("slow_rank") == 6
    assert detections[-1]["node"] == "node-a" and detections[-1]["detector"] == "hang"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_status_without_job_or_run_dir_names_both_fixes(tmp_path: Path):
    done = _status("--rdzv-id", "")
    assert done.returncode != 0
    assert "--rdzv-id" in done.stderr and "--run-dir" in done.stderr
    missing = _status("--run-dir", str(tmp_path / "nope"))
    assert missing.returncode != 0 and "is not a directory" in missing.stderr
