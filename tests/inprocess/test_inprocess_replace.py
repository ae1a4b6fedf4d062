"""One worker of torch's own process context is replaced while the other keeps running (real
processes): the agent's side of in-process recovery, without an agent."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.agent.server.api import Worker
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

from elasticft.agent.replace import failed_exits, start_replacements


@pytest.mark.timeout(60)
def test_a_failed_worker_is_replaced_and_the_survivor_keeps_running(tmp_path: Path) -> None:
    marker = tmp_path / "replacement-started"
    code = ("import os, sys, time\n"
            "if os.environ.get('GEN') == '1':\n"
            f"    open({str(marker)!r}, 'w').write(os.environ['RANK'])\n"
            "    time.sleep(60)\n"
            "sys.exit(3 if os.environ['RANK'] == '1' else time.sleep(60))\n")
    context = start_processes(
        name="inprocess",
        entrypoint=sys.executable,
        args={0: ("-c", code), 1: ("-c", code)},
        envs={0: {"RANK": "0"}, 1: {"RANK": "1"}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.ALL),
    )
    workers = [Worker(local_rank=r, global_rank=r, role_rank=r, world_size=2,
                      role_world_size=2) for r in (0, 1)]
    survivor = context.pids()[0]
    try:
        deadline = time.monotonic() + 30
        while not (failed := failed_exits(context, workers)):
            assert time.monotonic() < deadline, "the failed worker was never seen"
            time.sleep(0.05)
        assert list(failed) == [1] and failed[1].exitcode == 3
        started = start_replacements(context, [1], None, lambda env: {**env, "GEN": "1"})
        assert context.pids() == {0: survivor, 1: started[1]} and started[1] != survivor
        while not marker.exists():
            assert time.monotonic() < deadline, "the replacement never started"
            time.sleep(0.05)
        assert marker.read_text() == "1"
        # torch's own poll sees both running: no failure, nobody stopped.
        assert context.wait(timeout=0) is None
        assert failed_exits(context, workers) == {}
    finally:
        context.close()
