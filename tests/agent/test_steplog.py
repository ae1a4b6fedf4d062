"""Whether an attempt completed a step, and where the job is, from its workers' step records (the
policy's ``FailureFacts.step_completed`` and ``newest_step``)."""

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
    assert collaborator.failure_facts(info, ())["step_completed"] is stepped


@pytest.mark.parametrize(("records", "newest"), [
    ({}, None),
    ({(0, "explicit"): [1, 2, 3], (1, "explicit"): [1, 2]}, 3),
    ({(0, "explicit"): [18, 19, 20, 19]}, 19),           # a roll-back: where the rank is now
    ({(0, "auto"): [40, 41]}, 41),                       # no explicit records: the automatic
    ({(0, "explicit"): [5], (0, "auto"): [40]}, 5),      # the explicit records win
    ({(0, "explicit"): [5], (1, "auto"): [6]}, 6),       # per rank
])
def test_the_newest_step_is_where_the_ranks_records_end(
        tmp_path: Path, records: dict[tuple[int, str], list[int]], newest: int | None) -> None:
    collaborator = StepLogEnv()
    info = group(tmp_path)
    for worker in info.workers:
        collaborator.worker_env(info, worker)
    collaborator.on_workers_started(info)
    for (rank, kind), steps in records.items():
        path = step_log_path(tmp_path, rank)
        recorder = StepRecorder(auto_step_path(path) if kind == "auto" else path)
        for step in steps:
            recorder.record(step)
        recorder.close()
    assert collaborator.failure_facts(info, ())["newest_step"] == newest
