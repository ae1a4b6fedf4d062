"""Between a worker's failure and torch stopping the other workers, the agent's collaborators
see the survivors alive (torch's own process context, real processes)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

from elasticft.agent.replace import notify_before_survivors_stopped


@pytest.mark.smoke
@pytest.mark.timeout(60)
def test_the_hook_sees_the_survivor_alive_before_torch_stops_it(tmp_path: Path) -> None:
    context = start_processes(
        name="survivors",
        entrypoint=sys.executable,
        args={0: ("-c", "import time; time.sleep(60)"), 1: ("-c", "import sys; sys.exit(3)")},
        envs={0: {}, 1: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL),
    )
    calls: list[tuple[tuple[int, ...], bool]] = []
    survivor = context.subprocess_handlers[0].proc
    assert notify_before_survivors_stopped(
        context, lambda failed: calls.append((failed, survivor.poll() is None)))
    try:
        deadline = time.monotonic() + 30
        result = None
        while result is None:
            assert time.monotonic() < deadline, "the failed worker was never seen"
            result = context.wait(timeout=0)
            time.sleep(0.05)
        assert result.is_failed() and result.failures[1].exitcode == 3
        assert calls == [((1,), True)]  # once, with the survivor still running
        assert survivor.poll() is not None  # and torch stopped it right after
    finally:
        context.close()
