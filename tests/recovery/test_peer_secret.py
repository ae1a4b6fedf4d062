"""The peer backup's secret across rendezvous rounds, with real checkpoint services (their peer
servers on loopback) and real round stores: every node of a round uses the secret its leader
published, also when a node that joined later becomes the leader, and a node that is no longer
in the round (or anyone else) cannot fetch shards."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from elasticft.addon.api import GroupInfo, WorkerInfo
from elasticft.ckpt.api import CheckpointError
from elasticft.ckpt.backup.peer import PeerClient
from elasticft.ckpt.service import CheckpointService
from elasticft.config import CheckpointConfig


def join(tmp: Path, round_: int, connect, *members: tuple[CheckpointService, str, int],
         nproc: int = 1) -> dict[str, GroupInfo]:
    """One rendezvous round: every member's on_rendezvous runs at once, as on real nodes (each
    waits in the store for the others' peer addresses). Returns each node's group."""
    threads = []
    groups = {}
    world = max(2, len(members) * nproc)
    for service, node, rank in members:
        workers = tuple(WorkerInfo(i, rank * nproc + i, world) for i in range(nproc))
        group = groups[node] = GroupInfo(
            run_id="job", node_id=node, run_dir=tmp / f"run-{node}", round=round_,
            group_rank=rank, group_world_size=len(members), restart_count=0, workers=workers)
        threads.append(threading.Thread(target=service.on_rendezvous,
                                        args=(group, connect(round_))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return groups


def secret_of(service: CheckpointService) -> str:
    return service._secret or ""


def can_list(service: CheckpointService, secret: str) -> bool:
    assert service._peer_server is not None
    try:
        PeerClient(service._peer_server.address, secret, timeout_s=10).steps(0, 2)
        return True
    except CheckpointError as e:
        assert "authentication failed" in str(e)
        return False


def services(tmp: Path, n: int, layout: tuple[int, int, int] | None = None,
             **options) -> list[CheckpointService]:
    config = CheckpointConfig(ckpt_persist_every=0, ckpt_dir=tmp / "ckpt", **options)
    return [CheckpointService(config, local_addr="127.0.0.1", shm_dir=tmp, layout=layout)
            for _ in range(n)]


@pytest.mark.timeout(60)
def test_a_new_leader_and_the_old_nodes_share_one_secret_and_a_departed_node_is_out(
        tmp_path: Path, round_store):
    a, b, c = services(tmp_path, 3)
    try:
        join(tmp_path, 1, round_store, (a, "a", 0), (b, "b", 1))
        first = secret_of(a)
        assert first and secret_of(b) == first
        assert can_list(b, first) and can_list(a, first)

        # b is gone; the standby c joins and becomes the leader of the next round.
        join(tmp_path, 2, round_store, (c, "c", 0), (a, "a", 1))
        second = secret_of(c)
        assert secret_of(a) == second, "a node kept an old secret the new leader does not know"
        assert can_list(a, second) and can_list(c, second)
        # b (left after round 1) still knows the first secret: it is refused now.
        assert not can_list(a, first) and not can_list(c, first)
        assert not can_list(a, "not the job secret")
    finally:
        for service in (a, b, c):
            service.close()


@pytest.mark.timeout(60)
def test_a_secret_given_by_the_user_is_used_by_every_round(tmp_path: Path, round_store):
    a, c = services(tmp_path, 2, ckpt_peer_secret="the-users-secret")
    try:
        join(tmp_path, 1, round_store, (a, "a", 0), (c, "c", 1))
        join(tmp_path, 2, round_store, (c, "c", 0), (a, "a", 1))
        assert secret_of(a) == secret_of(c) == "the-users-secret"
        assert can_list(a, "the-users-secret")
        assert not can_list(a, "a guess")
    finally:
        for service in (a, c):
            service.close()
