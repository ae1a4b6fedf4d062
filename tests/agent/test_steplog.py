"""Whether an attempt completed a step, from its workers' step records (the policy's
``FailureFacts.step_completed``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft.addon.api import GroupInfo, WorkerInfo
from elasticft.agent.steplog import StepLogEnv
from elasticft.steps import StepRecorder, auto_step_path, step_log_path


def group(run_dir: Path) -> GroupInfo:
    return GroupInfo(run_id="r", node_id="n0", run_dir=run_dir, round=0, group_rank=0,
                     group_world_size=1, restart_count=0,
                     workers=(WorkerInfo(0, 0, 2), WorkerInfo(1, 1, 2)))


@pytest.mark.parametrize(("before", "during", "stepped"), [
    ((), (), False),                    # the attempt failed before any record
    ((), ("explicit",), True),          # the script's own record
    ((), ("auto",), True),              # the optimizer step the bootstrap records
    (("explicit",), (), False),         # an earlier attempt's records do not count
    (("explicit", "auto"), ("auto",), True),
])
def test_a_step_counts_when_a_record_was_written_during_the_attempt(
        tmp_path: Path, before: tuple[str, ...], during: tuple[str, ...], stepped: bool) -> None:
    collaborator = StepLogEnv()
    info = group(tmp_path)
    for worker in info.workers:
        collaborator.worker_env(info, worker)

    def write(kinds: tuple[str, ...]) -> None:
        for kind in kinds:
            path = step_log_path(tmp_path, 1)
            recorder = StepRecorder(auto_step_path(path) if kind == "auto" else path)
            recorder.record(7)
            recorder.close()

    write(before)
    collaborator.on_workers_started(info)
    write(during)
    assert collaborator.failure_facts(info, ()) == {"step_completed": stepped}
