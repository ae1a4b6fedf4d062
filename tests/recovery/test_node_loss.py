"""A lost node costs seconds with the rendezvous' default options (real etcd, elasticft-run
agents as nodes, gloo): a standby replaces a node killed with all its processes, a job of
``--nnodes 1:2`` shrinks to its survivor, an agent SIGKILLed alone takes its workers with it,
and a live agent whose membership was ended by mistake rejoins. The survivors end the lost
node's membership on evidence (its control endpoint refuses), not after its lease's TTL."""

from __future__ import annotations

import re
import signal
import time

import psutil
import pytest

from elasticft import chaos
from elasticft.rendezvous.etcd import EtcdSettings, Keys, LazyClient
from elasticft.rendezvous.membership import MemberRecord
from elasticft.rendezvous.quarantine import Quarantine
from tests.cluster import API, PLAIN, Job, losses_of
from tests.recovery.test_faults import (  # noqa: F401  (fixtures)
    FAULT_AFTER,
    LONG,
    before_fault,
    check_replaced,
    finish,
    make_job,
    resumed_from,
    standbys,
)
from tests.servers import EtcdServer

pytestmark = pytest.mark.slow
DEFAULT_RDZV = "join_timeout=120"
"""torch's defaults for everything that decides a node loss: keep-alive 5 s × 3, last call 30 s."""


def descendants(pid: int) -> list[int]:
    root = psutil.Process(pid)
    return [root.pid, *(p.pid for p in root.children(recursive=True))]


def wait_gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in pids if psutil.pid_exists(p)):
        assert time.monotonic() < deadline, f"processes left of the killed agent: {pids}"
        time.sleep(0.1)


def ended_on_evidence(job: Job, lost: str) -> list[dict]:
    return [e for e in job.events("membership_ended") if e["node"] == lost]


def start_with_standby(job: Job) -> str:
    """Starts a, b and c with the default options; returns the one that waits as a standby."""
    for name in ("a", "b", "c"):
        job.start(name, rdzv_conf=DEFAULT_RDZV)
    job.wait_for("two nodes in a round and one standby",
                 lambda: len(job.events("workers_started")) >= 2
                 and standbys(job.endpoint, job.job_id) == 1)
    standby = next(n for n, node in job.nodes.items() if not node.events("workers_started"))
    before_fault(job)
    return standby


@pytest.mark.timeout(300)
def test_a_standby_replaces_a_node_killed_with_all_its_processes(
        etcd_server: EtcdServer, make_job, reference) -> None:  # noqa: F811
    """The worker-API example: the node that is not the leader is killed, the standby takes
    its place and its worker restores the newest step from the leader's node (the healthy
    replica's memory, over the peer channel), not from a disk: at most one step is
    recomputed."""
    job = make_job(etcd_server.endpoint, API, steps=LONG, step_time=0.25)
    standby = start_with_standby(job)
    leader, _ = chaos.leader_agent(etcd_server.endpoint, job.job_id)
    lost = next(n for n in job.nodes if n not in (leader, standby))
    pids = descendants(chaos.node_agent_pid(job.tmp, lost))
    assert len(pids) >= 2  # the agent and its worker (and the worker's warm interpreter)
    chaos.kill_node(job.tmp, lost)
    wait_gone(pids)
    losses = check_replaced(job, etcd_server.endpoint, lost, standby, reference[API, LONG])
    assert ended_on_evidence(job, lost), job.outputs()
    assert losses.recomputed <= 1
    # The standby's worker held nothing of its own: the leader's node served it the step from
    # its worker's memory.
    served = re.findall(r"serving step (\d+) of rank \d+ from the replica",
                        job.nodes[leader].output())
    resumed = re.findall(r"resumed from step (\d+) \(source=(\w+)\)",
                         job.nodes[leader].output() + job.nodes[standby].output())
    assert served and resumed, job.outputs()
    assert int(resumed[-1][0]) == int(served[-1]) >= FAULT_AFTER
    assert resumed[-1][1] in ("memory", "peer")  # rank 0's source: its memory, or a's


@pytest.mark.timeout(300)
def test_a_job_of_one_to_two_nodes_shrinks_to_its_survivor_without_the_last_call(
        etcd_server: EtcdServer, make_job) -> None:  # noqa: F811
    job = make_job(etcd_server.endpoint, PLAIN, steps=LONG, step_time=0.25)
    for name in ("a", "b"):
        job.start(name, nnodes="1:2", rdzv_conf=DEFAULT_RDZV)
    job.wait_for("a and b in one round", lambda: any(
        e["world_size"] == 2 for e in job.events("workers_started")))
    job.wait_step(5)
    pids = descendants(chaos.node_agent_pid(job.tmp, "b"))
    chaos.kill_node(job.tmp, "b")
    wait_gone(pids)
    # One worker from here on (another world size: the losses are not the reference's).
    assert job.nodes["a"].wait(200) == 0, job.outputs()
    assert set(losses_of(job.loss_log).values) == set(range(1, LONG + 1))
    alone = [e for e in job.nodes["a"].events("workers_started") if e["world_size"] == 1]
    assert alone, job.outputs()
    out = job.nodes["a"].output()
    assert "every live participant of round" in out, out[-4000:]
    assert "the last call of 30 s is over" not in out
    assert ended_on_evidence(job, "b"), job.outputs()


@pytest.mark.timeout(300)
def test_an_agent_sigkilled_alone_takes_its_workers_and_the_standby_takes_its_place(
        etcd_server: EtcdServer, make_job, reference) -> None:  # noqa: F811
    job = make_job(etcd_server.endpoint, PLAIN, steps=LONG, step_time=0.25)
    standby = start_with_standby(job)
    leader, _ = chaos.leader_agent(etcd_server.endpoint, job.job_id)
    lost = next(n for n in job.nodes if n not in (leader, standby))
    agent = chaos.node_agent_pid(job.tmp, lost)
    pids = descendants(agent)
    psutil.Process(agent).kill()  # the agent alone: its workers are in sessions of their own
    wait_gone(pids)
    check_replaced(job, etcd_server.endpoint, lost, standby, reference[PLAIN, LONG])


@pytest.mark.timeout(300)
def test_a_live_agent_whose_membership_was_ended_by_mistake_rejoins_and_resumes(
        etcd_server: EtcdServer, make_job, reference) -> None:  # noqa: F811
    job = make_job(etcd_server.endpoint, API, steps=LONG, step_time=0.25)
    for name in ("a", "b"):
        job.start(name, rdzv_conf=DEFAULT_RDZV)
    job.wait_for("a and b in one round", lambda: len(job.events("workers_started")) >= 2)
    job.wait_step(5)
    settings = EtcdSettings.from_conf(etcd_server.endpoint, {})
    client = LazyClient(settings)
    keys = Keys(settings.root, job.job_id)
    try:
        # What a leader does on false evidence: b's lease ends and b is quarantined.
        value, meta = client.get(keys.member("b"))
        record = MemberRecord.parse(value)
        assert record is not None and meta.lease_id
        client.revoke_lease(meta.lease_id)
        Quarantine(client, keys, settings).add("b", "node disappeared (test)", record.round,
                                               "test")
        job.wait_for("b to publish its records again",
                     lambda: client.get(keys.member("b"))[0] is not None, timeout=60)
    finally:
        client.close()
    # A new round (a worker of a dies): b is in the quarantine's round, so it rejoins at once.
    chaos.signal_rank(job.tmp, 0, signal.SIGKILL)
    assert job.nodes["a"].wait(200) == 0, job.outputs()
    resumed = resumed_from(job, "a")
    assert len(resumed) == 1, job.outputs()
    # Rank 0, the loss logger, can be killed after its snapshot of a step was whole (and
    # replicated to b) but before it logged that step's loss: the restart resumes from that
    # snapshot, so that one step's loss is never logged, and is not lost.
    losses = finish(job, reference[API, LONG], "a", "b", timeout=200, unlogged=resumed)
    assert losses.recomputed <= 1
    assert "is quarantined" not in job.nodes["b"].output()
