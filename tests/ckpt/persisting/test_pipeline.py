"""The persist pipeline's stages on their own: a step commits once every rank's shard is on
disk, and which rank's shard a replica in memory stands in for."""

from __future__ import annotations

import mmap
import threading
import time
from pathlib import Path

import pytest
import torch

from elasticft.ckpt.api import Snapshot
from elasticft.ckpt.backup.replicas import is_replica, whole_tensors
from elasticft.ckpt.persisting import durable, pipeline
from elasticft.ckpt.snapshot import flatten, tensor_view


def rank_snapshot(step: int, rank: int, world_size: int) -> Snapshot:
    layout = flatten({"w": torch.full((256,), float(rank))})
    payload = mmap.mmap(-1, max(1, layout.payload_bytes))
    for entry in layout.tensors:
        tensor_view(payload, entry.to_json()).copy_(entry.tensor)
    return Snapshot(layout.manifest(step, rank, world_size), payload)


@pytest.mark.timeout(60)
def test_a_step_commits_in_every_directory_once_every_ranks_shard_is_written(
    tmp_path: Path
) -> None:
    roots = [tmp_path / "local", tmp_path / "remote"]
    commits = pipeline.PendingCommits(keep=2)
    pipeline.write_shards(roots, [rank_snapshot(5, 0, 2)])
    commits.add(5, roots, world_size=2)
    commits.commit()
    assert commits.waiting()
    assert all(5 not in durable.committed_steps(root) for root in roots)

    pipeline.write_shards(roots, [rank_snapshot(5, 1, 2)])  # the other rank's writer
    commits.commit()
    assert not commits.waiting()
    assert all(durable.committed_steps(root)[5]["ranks"] == [0, 1] for root in roots)


@pytest.mark.timeout(60)
def test_the_persist_thread_retries_waiting_commits_until_they_land(tmp_path: Path) -> None:
    commits = pipeline.PendingCommits(keep=2)
    thread = pipeline.PersistThread(commits.commit, commits.waiting, retry_s=0.05)
    try:
        thread.offer(lambda: (pipeline.write_shards([tmp_path], [rank_snapshot(3, 0, 2)]),
                              commits.add(3, [tmp_path], world_size=2)))
        pipeline.write_shards([tmp_path], [rank_snapshot(3, 1, 2)])
        deadline = time.monotonic() + 30
        while 3 not in durable.committed_steps(tmp_path):
            assert time.monotonic() < deadline, "the thread never committed the step"
            time.sleep(0.05)
    finally:
        thread.close(timeout_s=10)


@pytest.mark.timeout(60)
def test_a_newer_step_takes_the_place_of_one_still_waiting_never_the_other_way(
        tmp_path: Path) -> None:
    """Steps 2 and 3 are offered while step 1 is being written: 2 waits, and 3 takes its place,
    so the newest step offered is the last one written (a rank that skipped it would leave its
    commit incomplete for ever)."""
    commits = pipeline.PendingCommits(keep=2)
    thread = pipeline.PersistThread(commits.commit, commits.waiting, retry_s=0.05)
    writing, release = threading.Event(), threading.Event()
    written: list[int] = []

    def persist(step: int) -> None:
        writing.set()
        release.wait(30)
        written.append(step)

    try:
        thread.offer(lambda: persist(1))
        assert writing.wait(30)
        thread.offer(lambda: persist(2))
        thread.offer(lambda: persist(3))
        release.set()
        deadline = time.monotonic() + 30
        while thread.busy:
            assert time.monotonic() < deadline, written
            time.sleep(0.01)
    finally:
        release.set()
        thread.close(timeout_s=10)
    assert written == [1, 3]


@pytest.mark.parametrize(
    ("held", "rank", "world", "layout", "replica"),
    [
        (0, 1, 2, None, True),             # pure data parallelism: every rank alike
        (3, 0, 4, None, True),
        (0, 1, 4, (2, 1, 2), False),       # tp 2: ranks 0 and 1 hold different halves
        (0, 2, 4, (2, 1, 2), True),        # same tp coordinate, other dp rank
        (1, 3, 4, (2, 1, 2), True),
        (0, 4, 8, (2, 2, 2), False),       # another pipeline stage
        (4, 6, 8, (2, 2, 2), True),
        (0, 1, 6, (2, 1, 2), False),       # a layout that is not this world's
    ],
)
def test_which_rank_a_replica_stands_in_for(held: int, rank: int, world: int,
                                            layout: tuple[int, int, int] | None,
                                            replica: bool) -> None:
    assert is_replica(held, rank, world, layout) is replica


@pytest.mark.parametrize(
    ("item", "whole"),
    [
        ({"kind": "tensor", "shape": [4]}, True),
        ({"kind": "tensor", "shape": [4], "global_size": [4], "chunk_offsets": [0]}, True),
        ({"kind": "tensor", "shape": [2], "global_size": [4], "chunk_offsets": [2]}, False),
        ({"kind": "tensor", "shape": [2], "global_size": [4], "chunk_offsets": [0]}, False),
        ({"kind": "value", "shape": [2], "global_size": [4]}, True),
    ],
)
def test_only_whole_tensors_stand_in_for_another_rank(item: dict, whole: bool) -> None:
    assert whole_tensors({"items": [item]}) is whole
