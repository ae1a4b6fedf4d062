"""In-process recovery across nodes of one worker each (real etcd, elasticft-run agents as nodes,
gloo): a node killed with all its processes is replaced by the warm standby. When the lost node
was the leader, the survivor moves to its rank in the new round, and its agent restarts its
worker there instead of regrouping it in process, and the losses are an uninterrupted run's.
(The survivor that keeps its rank regroups in process, and a crashed worker is replaced alone:
:mod:`tests.inprocess.test_inprocess_across_nodes`, on nodes of two workers.)"""

from __future__ import annotations

import pytest

from elasticft import chaos
from tests.conftest import EXAMPLES
from tests.recovery.test_faults import (  # noqa: F401  (fixtures)
    LONG,
    check_replaced,
    make_job,
    with_standby,
)
from tests.servers import EtcdServer

pytestmark = pytest.mark.slow
INPROCESS = EXAMPLES / "train_inprocess.py"


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

