"""In-process recovery across nodes (real etcd, elasticft-run agents as nodes, gloo): a node
killed with all its processes is replaced by the warm standby, while the survivor's worker keeps
its process and regroups in the new rendezvous round, and the losses are an uninterrupted
run's, bit for bit. When the lost node was the leader, the survivor moves to its rank in the new
round, and its agent restarts its worker there instead (same losses). A crashed worker is
replaced alone, its node's agent alive: both nodes regroup in process, the other node's worker
keeps its process."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft import chaos
from elasticft.events import read_events
from elasticft.report.status import recoveries
from elasticft.report.tor import analyze
from elasticft.steps import read_steps
from tests.conftest import EXAMPLES, pids_by_rank
from tests.recovery.test_faults import (  # noqa: F401  (fixtures)
    LONG,
    STEPS,
    check_replaced,
    finish,
    make_job,
    with_standby,
)
from tests.servers import EtcdServer

pytestmark = pytest.mark.slow
INPROCESS = EXAMPLES / "train_inprocess.py"


@pytest.mark.timeout(300)
def test_a_lost_node_is_replaced_by_the_standby_and_the_survivor_regroups_in_process(
        etcd_server: EtcdServer, make_job, reference, tmp_path: Path) -> None:  # noqa: F811
    pid_log = tmp_path / "pids.log"
    job = make_job(etcd_server.endpoint, INPROCESS, steps=LONG, step_time=0.25,
                   extra_train=["--pid-log", str(pid_log)])
    standby = with_standby(job)
    survivor, _ = chaos.leader_agent(etcd_server.endpoint, job.job_id)
    lost = next(n for n in job.nodes if n not in (survivor, standby))
    chaos.kill_node(job.tmp, lost)
    losses = check_replaced(job, etcd_server.endpoint, lost, standby, reference[INPROCESS, LONG])
    assert losses.recomputed <= 1

    node = job.nodes[survivor]
    assert not node.events("restart"), job.outputs()
    assert len(node.events("workers_started")) == 1, job.outputs()
    done = node.events("recover_in_process")
    assert len(done) == 1, job.outputs()
    assert done[0]["replaced"] == {}  # the standby's new worker took the lost rank
    assert {"detect_s", "abort_s", "regroup_s", "restore_s", "redo_s", "total_s",
            "agree_s", "rendezvous_s"} <= set(done[0]["phases"])
    assert [e["action"] for e in node.events("decision")] == ["recover_in_process"]
    pids = pids_by_rank(pid_log)
    assert len(pids[0]) == 1, pids  # the survivor (rank 0) never left its process
    assert len(pids[1]) == 2, pids  # the lost node's worker, then the standby's
    assert "1 in-process recoveries in this process" in node.output()
    # The standby's worker held nothing: the survivor's node served it the step from the
    # replica in its worker's memory, over the peer channel.
    restored = job.nodes[standby].events("restore")
    assert restored and restored[-1]["source"] in ("peer", "replica", "node"), restored
    # Counted by `elasticft status` and `elasticft report` over the job's run directories.
    found, restarts = recoveries(job.tmp)
    assert len(found) == 1 and restarts == 0
    analysis = analyze(read_events(job.tmp), read_steps(job.tmp))
    assert [f.action for f in analysis.faults] == ["recover_in_process"]
    assert analysis.faults[0].in_process == done[0]["phases"]


@pytest.mark.timeout(300)
def test_a_survivor_whose_rank_changes_restarts_its_worker_in_the_new_round(
        etcd_server: EtcdServer, make_job, reference) -> None:  # noqa: F811
    job = make_job(etcd_server.endpoint, INPROCESS, steps=LONG, step_time=0.25)
    standby = with_standby(job)
    lost, _ = chaos.leader_agent(etcd_server.endpoint, job.job_id)
    survivor = next(n for n in job.nodes if n not in (lost, standby))
    chaos.kill_node(job.tmp, lost)
    check_replaced(job, etcd_server.endpoint, lost, standby, reference[INPROCESS, LONG])
    node = job.nodes[survivor]
    assert [e["action"] for e in node.events("decision")] == ["recover_in_process"]
    restarts = node.events("restart")
    assert len(restarts) == 1 and not restarts[0]["counted"], job.outputs()
    assert "gives this node's workers (rank, world size) [(0, 2)], not [(1, 2)]" in \
        restarts[0]["cause"]
    assert len(node.events("workers_started")) == 2
    assert not node.events("recover_in_process")


@pytest.mark.timeout(300)
def test_a_worker_crash_replaces_only_that_worker_while_both_nodes_regroup_in_process(
        etcd_server: EtcdServer, make_job, reference, tmp_path: Path) -> None:  # noqa: F811
    pid_log = tmp_path / "pids.log"
    job = make_job(etcd_server.endpoint, INPROCESS, steps=STEPS,
                   extra_train=["--pid-log", str(pid_log), "--fault-rank", "1",
                                "--crash-at-step", "6", "--crash-mode", "after-save"])
    job.start("a")
    job.start("b")
    job.wait_for("a and b in one round", lambda: len(job.events("workers_started")) >= 2)
    crashed = next(n for n, node in job.nodes.items()
                   if node.events("workers_started")[0]["pids"].get("1"))
    other = next(n for n in job.nodes if n != crashed)
    finish(job, reference[INPROCESS, STEPS], "a", "b")
    assert [e["action"] for e in job.nodes[crashed].events("decision")] == [
        "recover_in_process"]
    for name in (crashed, other):
        node = job.nodes[name]
        assert len(node.events("workers_started")) == 1, job.outputs()
        assert len(node.events("recover_in_process")) == 1, job.outputs()
        assert not node.events("restart"), job.outputs()
        assert [e["source"] for e in node.events("failure_heard")] in ([crashed], [other])
    pids = pids_by_rank(pid_log)
    assert len(pids[0]) == 1 and len(pids[1]) == 2, pids
