"""Where a replacement node's workers look for their shards under a (tp, pp, dp) layout: the
backup node is outside every parallel group of the node (so one failure cannot take both), which
means it holds none of the node's shards in memory; the agents also tell the workers a node that
holds a data-parallel replica of each of their ranks, asked first (real services, real stores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft.ckpt import settings
from tests.recovery.test_peer_secret import join, services


@pytest.mark.timeout(60)
def test_workers_are_told_a_replica_node_and_the_backup_node(tmp_path: Path, round_store):
    # 4 nodes x 2 ranks, tp=2 pp=2 dp=2: node 1 holds the data-parallel replicas of node 0's
    # ranks (same tp and pp coordinates); node 3 shares no group with node 0 and is its backup.
    nodes = services(tmp_path, 4, layout=(2, 2, 2))
    try:
        members = [(service, f"n{rank}", rank) for rank, service in enumerate(nodes)]
        groups = join(tmp_path, 1, round_store, *members, nproc=2)
        address = [service._peer_server.address for service in nodes]  # type: ignore[union-attr]
        for rank, replica, backup in ((0, 1, 3), (2, 3, 1)):
            group = groups[f"n{rank}"]
            for worker in group.workers:
                env = nodes[rank].worker_env(group, worker)
                assert env[settings.ENV_REPLICA_PEER] == address[replica]
                assert env[settings.ENV_PEER] == address[backup]
    finally:
        for service in nodes:
            service.close()


@pytest.mark.timeout(60)
def test_without_a_layout_the_backup_node_is_the_replica(tmp_path: Path, round_store):
    a, b = services(tmp_path, 2)
    try:
        groups = join(tmp_path, 1, round_store, (a, "a", 0), (b, "b", 1))
        env = a.worker_env(groups["a"], groups["a"].workers[0])
        assert env[settings.ENV_PEER] == b._peer_server.address  # type: ignore[union-attr]
        assert settings.ENV_REPLICA_PEER not in env
    finally:
        a.close()
        b.close()


def test_every_checkpoint_worker_variable_is_known_to_the_launcher():
    # The launcher rejects unknown ELASTICFT_* variables; the ones the service sets are not.
    from elasticft.agent.agent import WORKER_ENV_NAMES

    assert settings.WORKER_ENV <= WORKER_ENV_NAMES
