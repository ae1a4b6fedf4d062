"""Two agents as two nodes on one host: each node's shards are backed up on the other node over
the authenticated peer transport, and a rank's checkpoint can be fetched back from there."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from elasticft.ckpt import Checkpointer, WorkerSettings
from elasticft.ckpt.backup.peer import PeerServer, new_secret
from elasticft.ckpt.persisting import durable
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
        # The final backups land before either node leaves (the exit barrier waits for them).
        assert "peer backup of step" not in outputs[node], outputs[node][-3000:]
    # Each node holds the other node's shard, verified on receipt. Which node got rank 0 is the
    # rendezvous' choice, so the ranks are read from what each node holds.
    held_by_b = tmp_path / "run-b" / "ckpt" / "peer-backups" / "node-node-b"
    held_by_a = tmp_path / "run-a" / "ckpt" / "peer-backups" / "node-node-a"
    rank_held_by = {root: _ranks_held(durable.step_dir(root, STEPS))
                    for root in (held_by_a, held_by_b)}
    assert sorted(rank_held_by.values()) == [[0], [1]], rank_held_by
    for root, (rank,) in rank_held_by.items():
        assert durable.read_rank_shard(durable.step_dir(root, STEPS), rank).step == STEPS
    # Rank 0's node lost its disk (a replaced node): rank 0 comes back from the other's backup.
    holder_of_rank0 = next(root for root, ranks in rank_held_by.items() if ranks == [0])
    secret = new_secret()
    server = PeerServer(holder_of_rank0, secret, "127.0.0.1")
    try:
        settings = WorkerSettings(peer_addr=server.address, secret=secret,
                                  local_dir=tmp_path / "empty")
        with Checkpointer(settings, rank=0, world_size=2) as ckpt:
            step, state = ckpt.load()
        assert (step, ckpt.last_source) == (STEPS, "peer")
        assert state["extra"] == {"step": STEPS}
    finally:
        server.close()


def _ranks_held(step_dir: Path) -> list[int]:
    return sorted(int(path.stem[1:]) for path in step_dir.glob("r*.json"))
