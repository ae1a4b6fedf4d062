"""In-process recovery of sharded models end to end: ``examples/train_3d.py --fsdp --inprocess``
under a real ``elasticft-run --standalone`` (gloo, a real SIGKILL). FSDP2 on 2 ranks, and FSDP2
outside DTensor tensor parallelism on a (dp 2, tp 2) mesh of 4 ranks, and the same with the loss
averaged over a mesh flattened from it. Rank 1 is killed once step
4 is saved; the survivors keep their processes, their modules and shards, make their mesh's
groups again and re-point FSDP2 at them; a replacement restores rank 1's shard from the
agent's memory; the losses are an uninterrupted run's, bit for bit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.conftest import BIN, EXAMPLES, pids_by_rank

# Also on the second torch (scripts/compat.sh): there the reconfigure path, here a new group.
pytestmark = pytest.mark.smoke

STEPS = 8
CRASH_AT = 4


def _run(tmp: Path, name: str, env: dict[str, str], nproc: int, layout: str,
         *extra: str) -> dict:
    losses, pids = tmp / f"{name}.loss", tmp / f"{name}.pid"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "3", "--run-dir", str(tmp / name), "--ckpt-persist-every", "0",
           "--monitor-interval", "0.1", "--layout", layout,
           str(EXAMPLES / "train_3d.py"), "--fsdp", "--inprocess", "--steps", str(STEPS),
           "--loss-log", str(losses), "--pid-log", str(pids), *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    by_step: dict[int, float] = {}
    for line in losses.read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["loss"]  # a redone step overwrites its first try
    return {"text": text, "losses": by_step, "pids": pids_by_rank(pids),
            "events": read_events(tmp / name)}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("nproc", "layout", "references", "extra"), [
    (2, "1,1,2", 3, ()),  # FSDP2 over dp 2: the three fully_shard calls' shard groups
    (4, "2,1,2", 3, ()),  # FSDP2 over dp 2 outside TP over tp 2
    # and the loss averaged over a flattened (dp, tp) mesh, as torchtitan's loss_mesh
    (4, "2,1,2", 3, ("--loss-mesh",)),
], ids=["fsdp2", "fsdp2-tp", "fsdp2-tp-flattened"])
def test_survivors_keep_their_sharded_modules_and_the_losses_are_exact(
        tmp_path: Path, job_env: dict[str, str], nproc: int, layout: str,
        references: int, extra: tuple[str, ...]) -> None:
    reference = _run(tmp_path, "reference", job_env, nproc, layout, *extra)
    run = _run(tmp_path, "fault", job_env, nproc, layout, *extra, "--fault-rank", "1",
               "--crash-at-step", str(CRASH_AT))
    kinds = [e["kind"] for e in run["events"]]
    assert "restart" not in kinds, run["text"][-5000:]
    done = [e for e in run["events"] if e["kind"] == "recover_in_process"]
    assert len(done) == 1 and [int(r) for r in done[0]["replaced"]] == [1], run["text"][-5000:]
    # Every survivor kept its process; rank 1 had a replacement.
    assert {rank: len(pids) for rank, pids in run["pids"].items()} == {
        rank: 2 if rank == 1 else 1 for rank in range(nproc)}, run["pids"]
    # Each survivor made its mesh's groups again and re-pointed FSDP2 at them.
    assert run["text"].count(f"1 meshes, {references} FSDP2 group references") == nproc - 1
    assert f"resumed from step {CRASH_AT} (source=memory)" in run["text"]
    assert "1 in-process recoveries in this process" in run["text"]
    assert sorted(run["losses"]) == list(range(1, STEPS + 1))
    assert run["losses"] == reference["losses"]  # bitwise on CPU (JSON keeps a float exact)
