"""The JIT request across nodes, on a real round store (TCPStore behind torch's PrefixStore, as
the c10d rendezvous hands it out) and the real control channel: the node whose worker failed
asks, every other node's watcher thread takes its own workers' JIT checkpoint and reports the
step. Each "node" is a RecoveryOrchestrator in this process; each "worker" is a ControlWatcher
thread, which is what answers a JIT request in a real worker too (its main thread is stuck)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from elasticft.addon.api import GroupInfo, WorkerInfo
from elasticft.addon.classify import FailureClass, FailureRecord
from elasticft.addon.policy import FailureFacts, decide
from elasticft.ckpt.control import ControlWatcher
from elasticft.config import RecoveryConfig
from elasticft.events import read_events
from elasticft.recovery.orchestrator import RecoveryOrchestrator


@dataclasses.dataclass
class NodeCheckpoints:
    """The part of the checkpoint service the orchestrator asks: where the control channel of
    this node's workers is, and the newest step they all hold."""

    root: Path
    step: int

    def control_dir(self, group: GroupInfo) -> Path:
        return self.root / f"control-{group.node_id}"

    def newest_common_step(self, group: GroupInfo) -> int:
        return self.step


def group_of(tmp: Path, node: str, group_rank: int, round_: int, pid: int | None) -> GroupInfo:
    return GroupInfo(run_id="job", node_id=node, run_dir=tmp / f"run-{node}", round=round_,
                     group_rank=group_rank, group_world_size=2, restart_count=0,
                     workers=(WorkerInfo(0, group_rank, 2, pid),))


def crash(rank: int) -> FailureRecord:
    return FailureRecord(rank=rank, local_rank=0, pid=-1, exitcode=-9,
                         failure_class=FailureClass.SIGNAL_CRASH, signal="SIGKILL")


@pytest.mark.timeout(60)
def test_failure_on_one_node_makes_the_other_node_take_its_jit_checkpoint(tmp_path: Path,
                                                                         round_store):
    config = RecoveryConfig(recovery_jit_timeout_s=5.0)
    ckpt_a = NodeCheckpoints(tmp_path, step=7)
    ckpt_b = NodeCheckpoints(tmp_path, step=7)
    a = RecoveryOrchestrator(config, node_id="a", min_nodes=2, checkpoints=ckpt_a,
                             event_dir=tmp_path / "events")
    b = RecoveryOrchestrator(config, node_id="b", min_nodes=2, checkpoints=ckpt_b,
                             event_dir=tmp_path / "events")
    group_a = group_of(tmp_path, "a", 0, 3, os.getpid())  # a live worker that can answer
    group_b = group_of(tmp_path, "b", 1, 3, None)  # its only worker crashed
    asked: list[str] = []
    answered = threading.Event()

    def respond(reason: str) -> int:
        asked.append(reason)
        answered.set()
        return 7  # the step after the last completed one, complete in memory

    control_a = ckpt_a.control_dir(group_a)
    control_a.mkdir(parents=True)
    worker_a = ControlWatcher(control_a, 0, respond, poll_s=0.02)
    try:
        store = round_store(3)
        # As in the agent: at the rendezvous the workers have no pids yet, at their start they do.
        a.on_rendezvous(group_of(tmp_path, "a", 0, 3, None), store)
        a.on_workers_started(group_a)
        b.on_rendezvous(group_b, round_store(3))
        # As in the agent: the failure, its facts, the policy's decision, then the checkpoint
        # the decision chose.
        b.on_failure(group_b, (crash(1),))
        known = b.failure_facts(group_b, ())
        assert known["jit_available"] is True
        action = decide(FailureFacts((crash(1),), 0, 3, nodes=2, **known))
        assert action.takes_jit, action
        assert not asked, "a JIT checkpoint taken before the decision"
        b.on_decision(group_b, action)
        assert answered.wait(10), "node a's worker was never asked"
        store.wait(["elasticft/recovery/jit/done/0"], timedelta(seconds=10))
        report = json.loads(store.get("elasticft/recovery/jit/done/0"))
        assert report["node"] == "a" and report["step"] == 7
        assert asked and "requested by node b" in asked[0]
        # The membership change that follows stops a's workers: no second JIT checkpoint.
        a.before_restart(group_a, "membership change: 1 node(s) waiting", counted=False)
        assert len(asked) == 1
        deadline = time.monotonic() + 20
        while not [e for e in read_events(tmp_path / "events") if e["kind"] == "jit_request"]:
            assert time.monotonic() < deadline, read_events(tmp_path / "events")
            time.sleep(0.05)
    finally:
        worker_a.close()
        a.close()
        b.close()
    events = read_events(tmp_path / "events")
    jit = [e for e in events if e["kind"] == "jit_checkpoint"]
    assert [(e["node"], e["ranks"]) for e in jit] == [("a", {"0": 7})]
    request = [e for e in events if e["kind"] == "jit_request"]
    assert request[0]["node"] == "b" and request[0]["newest_common_step"] == 7


@pytest.mark.timeout(60)
def test_a_request_of_an_earlier_round_is_not_answered(tmp_path: Path, round_store):
    config = RecoveryConfig(recovery_jit_timeout_s=2.0)
    ckpt = NodeCheckpoints(tmp_path, step=4)
    a = RecoveryOrchestrator(config, node_id="a", min_nodes=2, checkpoints=ckpt,
                             event_dir=tmp_path / "events")
    group = group_of(tmp_path, "a", 0, 5, os.getpid())
    ckpt.control_dir(group).mkdir(parents=True)
    asked: list[str] = []
    worker = ControlWatcher(ckpt.control_dir(group), 0, lambda r: asked.append(r) or 4,
                            poll_s=0.02)
    try:
        round_store(5).set("elasticft/recovery/node/1", "b")  # b is in the round too
        round_store(4).set("elasticft/recovery/jit/request", json.dumps({"by": "b"}))
        a.on_rendezvous(group, round_store(5))
        a.on_workers_started(group)
        time.sleep(1.0)
        assert asked == []
        round_store(5).set("elasticft/recovery/jit/request", json.dumps({"by": "b"}))
        deadline = time.monotonic() + 10
        while not asked:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        worker.close()
        a.close()
