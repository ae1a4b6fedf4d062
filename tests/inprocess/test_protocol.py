"""The records an agent and its workers write for each other (elasticft.inprocess.protocol):
each read back whole by its one reader, and a file that is missing, torn or another's read as
none."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft.inprocess.protocol import (
    INTERRUPT_FILE,
    Generation,
    InterruptNotice,
    SpareReady,
    WorkerRecord,
    ready_file,
    worker_file,
)


def test_each_record_reads_back_as_written(tmp_path: Path) -> None:
    generation = Generation(2, "127.0.0.1", 29500, 4, env={"1": {"RANK": "3"}})
    generation.write(tmp_path)
    assert Generation.read(tmp_path) == generation
    notice = InterruptNotice(1, at_step=True, time=5.0)
    notice.write(tmp_path)
    assert InterruptNotice.read(tmp_path) == notice
    ready = SpareReady(pid=42, ready=7.5)
    ready.write(tmp_path, "1")
    assert SpareReady.read(tmp_path, "1") == ready
    record = WorkerRecord("failed", 1, 42, 2, {"failed": 3.0, "cause": "reset"})
    record.write(tmp_path)
    assert WorkerRecord.read(tmp_path, "failed", 1) == record


@pytest.mark.parametrize(("content", "expected"), [
    (None, None),  # no file
    ('{"ended": 3', None),  # torn
    ('{"ended": "3"}', None),
    ('{"ended": true}', None),  # a bool is no generation
    ('{"ended": 3}', InterruptNotice(3)),
    ('{"ended": 3, "at_step": true, "time": 1.5}', InterruptNotice(3, True, 1.5)),
])
def test_the_interrupt_notice_reader(tmp_path: Path, content: str | None,
                                     expected: InterruptNotice | None) -> None:
    if content is not None:
        (tmp_path / INTERRUPT_FILE).write_text(content)
    assert InterruptNotice.read(tmp_path) == expected


@pytest.mark.parametrize(("content", "pid", "generation", "of"), [
    ('{"pid": 10, "generation": 1}', 10, 1, True),
    ('{"pid": 10, "generation": 1}', 10, None, True),  # any generation
    ('{"pid": 10, "generation": 1}', 11, 1, False),  # another process's
    ('{"pid": 10, "generation": 1}', 10, 2, False),  # an older generation's
    ('{"pid": 10, "generation": 1}', None, None, False),  # no process to match
    ('{"pid": 10}', 10, 0, False),  # no generation: none matches
])
def test_a_worker_record_names_its_process_and_generation(
        tmp_path: Path, content: str, pid: int | None, generation: int | None, of: bool) -> None:
    worker_file(tmp_path, "joined", 0).write_text(content)
    record = WorkerRecord.read(tmp_path, "joined", 0)
    assert record is not None and record.of(pid, generation) is of


@pytest.mark.parametrize("content", ['{"pid": "10"}', '{"generation": 1}', "[1]", '{"pid": 1'])
def test_a_worker_record_without_its_pid_reads_as_none(tmp_path: Path, content: str) -> None:
    worker_file(tmp_path, "armed", 0).write_text(content)
    assert WorkerRecord.read(tmp_path, "armed", 0) is None


@pytest.mark.parametrize("content", ['{"pid": 1}', '{"pid": "x", "ready": 1}', "{"])
def test_a_spare_ready_word_without_its_fields_reads_as_none(tmp_path: Path,
                                                           content: str) -> None:
    ready_file(tmp_path, "1").write_text(content)
    assert SpareReady.read(tmp_path, "1") is None
