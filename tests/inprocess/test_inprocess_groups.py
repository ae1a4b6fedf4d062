"""What the regroup keeps of the script's group, with real processes on gloo: the test plays
the agent (it publishes the next generation once both workers reported their failure)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticft.inprocess.generations import InProcessCoordinator
from elasticft.inprocess.protocol import worker_file

WORKER = Path(__file__).with_name("regroup_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_after_a_recovery_the_group_keeps_the_scripts_timeout(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    coordinator = InProcessCoordinator(tmp_path / "inprocess", 60.0)
    coordinator.reset()
    result = tmp_path / "result.json"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    workers = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(store.port),
                                 str(coordinator.directory), str(result)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while not all(worker_file(coordinator.directory, "failed", r).exists() for r in (0, 1)):
            assert time.monotonic() < deadline, "the workers never reported their failure"
            assert all(w.poll() is None for w in workers), workers[0].communicate()[0]
            time.sleep(0.05)
        coordinator.publish("127.0.0.1", 2)
        assert workers[0].wait(timeout=200) == 0, workers[0].communicate()[0]
        found = json.loads(result.read_text())
        assert found["recoveries"] == 1
        # The hang after the recovery is found within the script's 5 s, not torch's 30 min.
        assert "5000ms" in found["error"], found
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
        coordinator.close()
