"""A node that disappeared is quarantined in its job only, under its name only: a per-process id
(``<host>-2``) and another job are never refused, a restarted agent under a stable name is, and
``elasticft blacklist list`` shows machines and quarantined nodes apart (real etcd, real
agents)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from elasticft.rendezvous.etcd import EtcdSettings, Keys, LazyClient
from elasticft.rendezvous.identity import claim_node_id
from elasticft.rendezvous.membership import Blacklist
from elasticft.rendezvous.quarantine import (
    Quarantine,
    QuarantineEntry,
    machine_name,
    refuses,
)
from tests.rendezvous.test_rdzv_multinode import elasticft, start_node, train_args
from tests.servers import EtcdServer

HOST = socket.gethostname()


def entry(node_id: str, round_: int = 4) -> QuarantineEntry:
    return QuarantineEntry(node_id, "node disappeared", round_)


@pytest.mark.parametrize(("quarantined", "node_id", "last_round", "refused"), [
    (entry("gpu7"), "gpu7", -1, True),          # an agent started again under the name
    (entry("gpu7"), "gpu7", 3, True),           # one that last took part before round 4
    (entry("gpu7"), "gpu7", 4, False),          # the agent itself, declared gone while alive
    (entry("gpu7"), "gpu8", -1, False),         # another name
    (entry(f"{HOST}-2"), f"{HOST}-2", -1, False),   # a per-process id names no one
    (entry(HOST), HOST, -1, True),              # the host's first agent: the machine's name
    (None, "gpu7", -1, False),
])
@pytest.mark.timeout(10)
def test_whom_a_quarantine_refuses(quarantined: QuarantineEntry | None, node_id: str,
                                   last_round: int, refused: bool) -> None:
    assert refuses(quarantined, node_id, HOST, last_round) is refused


@pytest.mark.parametrize(("node_id", "blacklisted"), [
    (HOST, HOST), (f"{HOST}-2", HOST), (f"{HOST}-17", HOST), ("gpu7", "gpu7"),
    (f"{HOST}-x", f"{HOST}-x"),
])
@pytest.mark.timeout(10)
def test_machine_evidence_blacklists_the_machine_never_a_per_process_id(
        node_id: str, blacklisted: str) -> None:
    assert machine_name(node_id, HOST) == blacklisted


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_quarantined_id_refuses_neither_another_job_nor_another_process_on_the_host(
        etcd_server: EtcdServer, job_env: dict[str, str], tmp_path: Path) -> None:
    endpoint, job = etcd_server.endpoint, "q-job"
    settings = EtcdSettings.from_conf(endpoint, {})
    client = LazyClient(settings)
    quarantine = Quarantine(client, Keys(settings.root, job), settings)
    for name in (f"{HOST}-2", "solo"):
        quarantine.add(name, "node disappeared: in round 3, then no keep-alive", 3, "leader x")
    # This process holds the host's first name in the job, so the next agent there is <host>-2.
    holder = claim_node_id(job, endpoint=endpoint)
    try:
        assert holder.node_id == HOST
        listed = elasticft("blacklist", "list", "--rdzv-endpoint", endpoint, env=job_env)
        assert listed.returncode == 0, listed.stderr
        assert "blacklist is empty" in listed.stdout
        assert f"job {job}: {HOST}-2: node disappeared" in listed.stdout
        assert f"job {job}: solo: node disappeared" in listed.stdout

        args = train_args(tmp_path, steps=3, step_time=0)
        per_process = start_node("per-process", tmp_path, job_env, endpoint, "1", job, args,
                                 nproc=1, node_id=None)
        other_job = start_node("solo", tmp_path, job_env, endpoint, "1", "another-job",
                               train_args(tmp_path / "other", steps=3, step_time=0), nproc=1)
        assert per_process.wait(150) == 0, per_process.output()[-3000:]
        assert f"node {HOST}-2 joined round" in per_process.output()
        assert other_job.wait(150) == 0, other_job.output()[-3000:]

        refused = start_node("solo-again", tmp_path, job_env, endpoint, "1", job, args,
                             nproc=1, node_id="solo",
                             rdzv_conf="join_timeout=5,last_call_timeout=1")
        assert refused.wait(120) != 0
        out = refused.output()
        assert f"node 'solo' is quarantined in job '{job}' for another" in out, out[-3000:]
        assert "Traceback" not in out
        assert not refused.events("workers_started")
        assert Blacklist(client, settings.root, settings).entries() == []
    finally:
        holder.release()
        client.close()
