"""Data-parallel replicas stored once: each rank snapshots and persists only its share.

Real processes: two gloo ranks of DDP + AdamW snapshot every step with ``dedup_replicas``;
rank 1 is SIGKILLed; new processes restore the exact state after the last step, from shared
memory (each rank reads the other's share from its segment), from disk after the memory is
gone (the owner broadcasts its share), and ``dcp.load`` reads the durable checkpoint alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elasticft.ckpt import WorkerSettings
from elasticft.ckpt.memory import shm
from elasticft.ckpt.memory.shm import SlotSet, segment_prefix
from elasticft.ckpt.persisting import durable
from tests.forked import killed, start_forked

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("dedup_job.py")
STEPS = 3


def _run(mode: str, tmp: Path, token: str, env: dict[str, str]) -> list[int]:
    """The two ranks' exit statuses; they are forked from one interpreter (:mod:`tests.forked`)."""
    init = tmp / f"init-{mode}-{uuid.uuid4().hex[:6]}"
    codes = tmp / f"codes-{init.name}.json"
    env = dict(env, PYTHONPATH=str(ROOT))
    ranks = [(env, [str(JOB), mode, str(rank), str(init), token, str(os.getpid()), str(tmp)])
             for rank in (0, 1)]
    with killed(start_forked(ranks, ("tests.ckpt.dedup_job",), env, ROOT, codes=codes,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)) as job:
        out = job.communicate(timeout=150)[0]
    assert codes.exists(), out[-6000:]
    statuses = json.loads(codes.read_text())
    assert all(c in (0, -signal.SIGKILL) for c in statuses), out[-6000:]
    return statuses


def _assert_same(actual: dict, expected: dict) -> None:
    for part in ("model", "optim"):
        flat_a = {k: v for k, v in _flat(actual[part])}
        flat_e = {k: v for k, v in _flat(expected[part])}
        assert flat_a.keys() == flat_e.keys()
        for key, value in flat_e.items():
            assert torch.equal(flat_a[key], value), f"{part}.{key} differs"


def _flat(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.fixture
def token():
    name = uuid.uuid4().hex[:8]
    yield name
    for rank in (0, 1):
        for path in shm.SHM_DIR.glob(f"{segment_prefix(os.getpid(), name, rank)}-s*"):
            path.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_deduplicated_snapshots_restore_exactly_after_a_sigkill(tmp_path: Path, token: str,
                                                                 job_env) -> None:
    assert _run("train", tmp_path, token, job_env) == [0, -signal.SIGKILL]
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)

    # Each rank's slot holds its own share of the replicated state, about half of it.
    manifests = []
    for rank in (0, 1):
        slots = SlotSet(segment_prefix(os.getpid(), token, rank), WorkerSettings().slots)
        newest = slots.newest()
        assert newest is not None and newest[1].step == STEPS
        manifests.append(slots.get(newest[0]).manifest(newest[1]))
        slots.close()
    stored = [sum(i["nbytes"] for i in m["items"]
                  if i["kind"] == "tensor" and i.get("replica_of") is None
                  and i["path"][0] in ("model", "optim")) for m in manifests]
    total = sum(v.numel() * v.element_size() for _, v in _flat(expected["model"])) + \
        sum(v.numel() * v.element_size() for _, v in _flat(expected["optim"]))
    assert sum(stored) == total and max(stored) < 0.75 * total, (stored, total)
    owners = {i["fqn"]: (r if i.get("replica_of") is None else i["replica_of"])
              for r, m in enumerate(manifests) for i in m["items"] if i["kind"] == "tensor"}
    assert set(owners.values()) == {0, 1}

    # From shared memory: rank 1 died, its segment did not. In place (restore), then not in
    # place (load(): the replicas are reassembled into new tensors), in the same processes.
    _run("restore+load", tmp_path, token, job_env)
    for rank in (0, 1):
        info = json.loads((tmp_path / f"restore-{rank}.json").read_text())
        assert info == {"step": STEPS, "extra": {"step": STEPS}, "source": "memory",
                        "committed": [STEPS]}
        _assert_same(torch.load(tmp_path / f"restore-{rank}.pt", weights_only=True), expected)

    for rank in (0, 1):
        info = json.loads((tmp_path / f"load-{rank}.json").read_text())
        assert (info["step"], info["extra"], info["source"]) == (STEPS, {"step": STEPS}, "memory")
        _assert_same(torch.load(tmp_path / f"load-{rank}.pt", weights_only=True), expected)

    # Memory gone (a node restart): each rank reads its share from disk and the owners
    # broadcast the rest.
    for rank in (0, 1):
        for path in shm.SHM_DIR.glob(f"{segment_prefix(os.getpid(), token, rank)}-s*"):
            path.unlink()
    _run("restore", tmp_path, token, job_env)
    for rank in (0, 1):
        info = json.loads((tmp_path / f"restore-{rank}.json").read_text())
        assert (info["step"], info["source"]) == (STEPS, "local")
        _assert_same(torch.load(tmp_path / f"restore-{rank}.pt", weights_only=True), expected)

    # The durable checkpoint holds every replicated item once, and dcp.load reads it alone.
    directory = durable.step_dir(tmp_path / "ckpt", STEPS)
    shards = [durable.read_rank_manifest(directory, r) for r in (0, 1)]
    replicated = [{i["fqn"] for i in m["items"] if i["kind"] == "tensor"
                   and i["path"][0] in ("model", "optim") and i["fqn"] in m["storage"]}
                  for m in shards]
    assert replicated[0] and replicated[1] and not replicated[0] & replicated[1]
    assert replicated[0] | replicated[1] == {f for f in owners if not f.startswith("rng.")}
    model_sd = {k: torch.zeros_like(v) for k, v in expected["model"].items()}
    state = {"model": model_sd, "extra": {"step": -1}}
    dcp.load(state, checkpoint_id=str(directory))
    assert state["extra"]["step"] == STEPS
    for key, value in expected["model"].items():
        assert torch.equal(model_sd[key], value), key
