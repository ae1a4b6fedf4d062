"""The peer tier: backup placement, the authenticated TCP transport, loading from the peer."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from elasticft.ckpt import Checkpointer, WorkerSettings, capture
from elasticft.ckpt.api import CheckpointError, SnapshotCorrupt, TierLevel
from elasticft.ckpt.backup.peer import PeerClient, PeerServer, backup_node, new_secret, replica_node
from elasticft.ckpt.persisting import durable
from elasticft.ckpt.restoring.loader import SnapshotLoader
from tests.ckpt.helpers import remove_segments, trained_model, unique_prefix


def test_a_load_tries_the_tiers_in_the_order_of_their_numbers(tmp_path: Path) -> None:
    settings = WorkerSettings(
        shm_slots=str(tmp_path / "slots"), local_dir=tmp_path / "local",
        remote_dir=tmp_path / "remote", peer_addr="127.0.0.1:9", replica_peer_addr="127.0.0.1:8",
        node_peer_addr="127.0.0.1:7", secret="s")
    tiers = SnapshotLoader(settings, rank=0, world_size=1, slot_count=2).tiers()
    assert [(t.level, t.name) for t in tiers] == [
        (TierLevel.MEMORY, "memory"), (TierLevel.LOCAL, "local"), (TierLevel.PEER, "node"),
        (TierLevel.PEER, "replica"), (TierLevel.PEER, "peer"), (TierLevel.REMOTE, "remote")]
    assert [int(level) for level in TierLevel] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="the local or the remote tier, not peer"):
        durable.DurableTier(tmp_path, TierLevel.PEER)


def test_ring_backup_is_the_next_node() -> None:
    assert [backup_node(n, 4, 8) for n in range(4)] == [1, 2, 3, 0]
    assert backup_node(0, 1, 8) is None


def test_layout_backup_avoids_every_parallel_group() -> None:
    # 4 nodes x 2 ranks, tp=2 pp=2 dp=2: node 1 shares data-parallel groups with node 0 and
    # node 2 pipeline groups; only node 3 shares none.
    assert backup_node(0, 4, 2, layout=(2, 2, 2)) == 3
    assert backup_node(3, 4, 2, layout=(2, 2, 2)) == 0
    # A layout that leaves no such node falls back to the ring.
    assert backup_node(0, 2, 2, layout=(2, 1, 2)) == 1


def test_replica_node_holds_the_same_tp_and_pp_shards() -> None:
    # tp=2 pp=2 dp=2 over 4 nodes x 2: nodes 0 and 1 are pp stage 0, nodes 2 and 3 stage 1.
    assert [replica_node(n, 4, 2, layout=(2, 2, 2)) for n in range(4)] == [1, 0, 3, 2]
    # Pure data parallelism: the next node; no data parallelism: no replica anywhere.
    assert replica_node(2, 4, 8) == 3
    assert replica_node(0, 4, 2, layout=(2, 4, 1)) is None
    assert replica_node(0, 1, 8) is None


@pytest.fixture
def persisted(tmp_path: Path):
    """A committed local checkpoint of steps 1 and 2 (memory removed)."""
    prefix = unique_prefix()
    model, optim = trained_model()
    local = tmp_path / "local"
    settings = WorkerSettings(shm_slots=prefix, local_dir=local, persist_every=1)
    with Checkpointer(settings, optimizers=[optim]) as ckpt:
        for step in (1, 2):
            ckpt.save(step, capture(model, optim, {"step": step})).wait(30)
            deadline = time.monotonic() + 60
            while step not in durable.committed_steps(local):
                assert time.monotonic() < deadline
                time.sleep(0.05)
    remove_segments(prefix)
    return local, model


@pytest.fixture
def server(tmp_path: Path):
    secret = new_secret()
    peer = PeerServer(tmp_path / "backups", secret, "127.0.0.1")
    yield peer, secret
    peer.close()


@pytest.mark.timeout(120)
def test_wrong_secret_is_rejected_and_corrupt_shards_refused(persisted, server) -> None:
    local, _ = persisted
    peer, secret = server
    with pytest.raises(CheckpointError, match="authentication failed"):
        PeerClient(peer.address, "not-the-secret").steps(0, 1)
    directory = durable.step_dir(local, 2)
    manifest = durable.read_rank_manifest(directory, 0)
    data = bytearray((directory / manifest["file"]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        PeerClient(peer.address, secret).put(manifest, data)
    assert PeerClient(peer.address, secret).steps(0, 1) == []


@pytest.mark.timeout(120)
def test_load_fetches_from_the_peer_after_the_local_copy_is_deleted(persisted, server) -> None:
    local, model = persisted
    peer, secret = server
    client = PeerClient(peer.address, secret)
    for step in (1, 2):
        client.put_from_dir(durable.step_dir(local, step), 0)
    assert client.steps(0, 1) == [2, 1]
    shutil.rmtree(local)
    settings = WorkerSettings(shm_slots=unique_prefix(), local_dir=local,
                              peer_addr=peer.address, secret=secret)
    with Checkpointer(settings) as ckpt:
        step, state = ckpt.load()
    assert (step, ckpt.last_source) == (2, "peer")
    assert torch.equal(state["model"]["0.weight"], model.state_dict()["0.weight"])
    assert state["extra"] == {"step": 2}
    # A shard damaged on the backup node is detected when fetched; the older one still loads.
    stored = durable.step_dir(peer.root, 2) / durable.shard_name(0)
    raw = bytearray(stored.read_bytes())
    raw[-50] ^= 0xFF
    stored.write_bytes(bytes(raw))
    with pytest.raises(SnapshotCorrupt):
        client.get(2, 0)
    with Checkpointer(settings) as ckpt:
        step, _ = ckpt.load()
    assert (step, ckpt.last_source) == (1, "peer")


@pytest.mark.timeout(120)
def test_a_replica_node_is_asked_before_the_backup_node(persisted, tmp_path: Path) -> None:
    local, _ = persisted
    secret = new_secret()
    replica = PeerServer(tmp_path / "replica", secret, "127.0.0.1")
    backup = PeerServer(tmp_path / "backup", secret, "127.0.0.1")
    try:
        # The replica's node has the newest step; the backup node only an older one.
        PeerClient(replica.address, secret).put_from_dir(durable.step_dir(local, 2), 0)
        PeerClient(backup.address, secret).put_from_dir(durable.step_dir(local, 1), 0)
        settings = WorkerSettings(local_dir=tmp_path / "empty", peer_addr=backup.address,
                                  replica_peer_addr=replica.address, secret=secret)
        with Checkpointer(settings) as ckpt:
            step, _ = ckpt.load()
        assert (step, ckpt.last_source) == (2, "replica")
        # The replica's node gone too: the backup node's step.
        replica.close()
        with Checkpointer(settings) as ckpt:
            step, _ = ckpt.load()
        assert (step, ckpt.last_source) == (1, "peer")
    finally:
        replica.close()
        backup.close()
