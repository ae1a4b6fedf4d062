"""Steps rejected after silent data corruption: the record, and every tier that honours it."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest

from elasticft.ckpt import Checkpointer, WorkerSettings
from elasticft.ckpt.api import CheckpointError
from elasticft.ckpt.backup.peer import PeerClient
from elasticft.ckpt.persisting import durable, rejected
from tests.ckpt.backup.test_peer import persisted, server  # noqa: F401  (fixtures)
from tests.ckpt.helpers import unique_prefix

RECORD = {"after": 4, "at": 100.0, "steps": [6, 8], "reason": "sdc"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("step", "written_at", "rejected_by"), [
    (4, 50.0, None),          # the agreed step itself stays
    (3, 150.0, None),         # older steps stay
    (6, 50.0, RECORD),        # after the agreed step, written before the rejection
    (6, 100.0, RECORD),       # ... at the same instant: still the corrupted write
    (6, 150.0, None),         # the step redone after the rejection
    (12, 99.0, RECORD),       # a step not seen then, landed late (a copy in flight)
    (6, None, RECORD),        # no time known: taken as written before
])
def test_a_record_rejects_the_steps_after_the_agreed_one_written_before_it(
        step: int, written_at: float | None, rejected_by: dict | None) -> None:
    assert rejected.rejecting(step, written_at, [RECORD]) == rejected_by


@pytest.mark.timeout(120)
def test_a_rejected_step_is_gone_from_the_disk_tier_and_a_late_commit_is_refused(
        persisted, tmp_path: Path, caplog) -> None:  # noqa: F811
    local, _ = persisted
    late = durable.step_dir(local, 2)
    kept = tmp_path / "late"
    shutil.copytree(late, kept)
    removed = durable.reject_after(local, 1, "silent data corruption after step 1")
    assert removed == [2] and not late.exists()
    assert sorted(durable.committed_steps(local)) == [1]
    (record,) = rejected.records(local)
    assert (record["after"], record["steps"]) == (1, [2])
    # The same step's directory landing afterwards (a copy in flight) but committed before the
    # rejection stays rejected; a step redone and committed after it is offered again.
    shutil.copytree(kept, late)
    assert sorted(durable.committed_steps(local)) == [1]
    marker = json.loads((late / durable.COMMIT_MARKER).read_bytes())
    (late / durable.COMMIT_MARKER).write_text(json.dumps(dict(marker, committed_at=time.time())))
    assert sorted(durable.committed_steps(local)) == [1, 2]
    (late / durable.COMMIT_MARKER).write_text(json.dumps(marker))
    # A load (a relaunch) takes step 1 and says why step 2 is not there.
    settings = WorkerSettings(shm_slots=unique_prefix(), local_dir=local)
    with caplog.at_level(logging.WARNING), Checkpointer(settings) as ckpt:
        step, _ = ckpt.load()
    assert step == 1
    assert any("step(s) [2] skipped: rejected at" in r.getMessage()
               and "silent data corruption after step 1" in r.getMessage()
               for r in caplog.records), caplog.text


@pytest.mark.timeout(120)
def test_a_peer_store_rejects_durably_and_refuses_a_late_shard(persisted, server) -> None:  # noqa: F811
    local, _ = persisted
    peer, secret = server
    client = PeerClient(peer.address, secret)
    for step in (1, 2):
        client.put_from_dir(durable.step_dir(local, step), 0)
    assert client.steps(0, 1) == [2, 1]
    assert peer.reject_after(1, 2, "silent data corruption after step 1") == [2]
    assert client.steps(0, 1) == [1]
    with pytest.raises(CheckpointError, match="rejected after silent data corruption"):
        client.put_from_dir(durable.step_dir(local, 2), 0)
    with pytest.raises(CheckpointError):
        client.get(2, 0, 1)
    # The record outlives the server: a shard of step 2 older than it, found by a relaunch's
    # server, is not offered.
    stored = durable.step_dir(peer.root, 2)
    stored.mkdir()
    for name in (durable.manifest_name(0), durable.shard_name(0)):
        shutil.copy2(durable.step_dir(local, 2) / name, stored / name)
    assert peer.steps(0, 1) == [1]
