"""Two agents as two nodes on one host: each node's shards are backed up on the other node over
the authenticated peer transport, and a rank's checkpoint can be fetched back from there."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from elasticft.ckpt import Checkpointer, WorkerSettings, durable
from elasticft.ckpt.peer import PeerServer, new_secret
from tests.conftest import BIN, EXAMPLES, free_port

STEPS = 9


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_node_backs_up_on_the_other(tmp_path: Path, job_env) -> None:
    port = free_port()
    procs = {}
    for node in ("a", "b"):
        cmd = [str(BIN / "elasticft-run"), "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "two-nodes", "--node-id", f"node-{node}",
               "--run-dir", str(tmp_path / f"run-{node}"), "--ckpt-persist-every", "3",
               str(EXAMPLES / "train_elasticft.py"), "--steps", str(STEPS)]
        procs[node] = subprocess.Popen(cmd, env=job_env, cwd=tmp_path, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    outputs = {node: proc.communicate(timeout=200)[0] for node, proc in procs.items()}
    for node, proc in procs.items():
        assert proc.returncode == 0, outputs[node][-3000:]
    # Node a (rank 0) is backed up on node b and the other way round, verified on receipt.
    held_by_b = tmp_path / "run-b" / "ckpt" / "peer-backups" / "node-node-b"
    held_by_a = tmp_path / "run-a" / "ckpt" / "peer-backups" / "node-node-a"
    assert (durable.step_dir(held_by_b, STEPS) / "r0.json").exists()
    assert (durable.step_dir(held_by_a, STEPS) / "r1.json").exists()
    for rank, root in ((0, held_by_b), (1, held_by_a)):
        assert durable.read_rank_shard(durable.step_dir(root, STEPS), rank).step == STEPS
    # Node a's own disk copy is gone (a replaced node): rank 0 comes back from node b's backup.
    secret = new_secret()
    server = PeerServer(held_by_b, secret, "127.0.0.1")
    try:
        settings = WorkerSettings(peer_addr=server.address, secret=secret,
                                  local_dir=tmp_path / "empty")
        with Checkpointer(settings, rank=0, world_size=2) as ckpt:
            step, state = ckpt.load()
        assert (step, ckpt.last_source) == (STEPS, "peer")
        assert state["extra"] == {"step": STEPS}
    finally:
        server.close()
