"""The leader of a new round judges the nodes that left since the round before, even when it is
a standby that took no part in that round: the other nodes tell it who was there. Real round
store (TCPStore behind torch's PrefixStore) and real etcd membership."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elasticft.addon.api import GroupInfo, WorkerInfo
from elasticft.config import RecoveryConfig
from elasticft.recovery.orchestrator import RecoveryOrchestrator
from elasticft.recovery.roster import EtcdRoster
from elasticft.rendezvous.etcd import EtcdSettings, Keys, LazyClient
from elasticft.rendezvous.membership import Blacklist
from elasticft.rendezvous.quarantine import Quarantine
from tests.servers import EtcdServer


def group_of(tmp: Path, node: str, group_rank: int, round_: int) -> GroupInfo:
    return GroupInfo(run_id="job", node_id=node, run_dir=tmp / f"run-{node}", round=round_,
                     group_rank=group_rank, group_world_size=2, restart_count=0,
                     workers=(WorkerInfo(0, group_rank, 2, None),))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_standby_that_now_leads_still_quarantines_the_node_that_vanished(
    tmp_path: Path, round_store, etcd_server: EtcdServer
) -> None:
    settings = EtcdSettings.from_conf(etcd_server.endpoint, {})
    config = RecoveryConfig(recovery_departed_grace_s=0.5)

    def node(name: str) -> RecoveryOrchestrator:
        return RecoveryOrchestrator(config, node_id=name, min_nodes=2,
                                    roster=EtcdRoster(settings, "job"),
                                    event_dir=tmp_path / "events")

    a, b, c = node("a"), node("b"), node("c")
    try:
        # Round 0: a leads, c follows, b waits as a standby. Then a vanishes (no membership
        # record: its agent is dead) and round 1 is b (leading) and c.
        a.on_rendezvous(group_of(tmp_path, "a", 0, 0), round_store(0))
        c.on_rendezvous(group_of(tmp_path, "c", 1, 0), round_store(0))
        deadline = time.monotonic() + 20
        while 0 not in c._round_nodes:
            assert time.monotonic() < deadline, "c never learned round 0"
            time.sleep(0.05)
        b.on_rendezvous(group_of(tmp_path, "b", 0, 1), round_store(1))
        c.on_rendezvous(group_of(tmp_path, "c", 1, 1), round_store(1))
        client = LazyClient(settings)
        try:
            quarantine = Quarantine(client, Keys(settings.root, "job"), settings)
            while quarantine.get("a") is None:
                assert time.monotonic() < deadline, "the new leader never judged node a"
                time.sleep(0.05)
            entry = quarantine.get("a")
            assert entry is not None and entry.reason.startswith("node disappeared")
            assert entry.round == 0
            assert quarantine.get("c") is None
            # A name a job's quarantine holds is no machine verdict: the blacklist stays empty.
            assert Blacklist(client, settings.root, settings).entries() == []
        finally:
            client.close()
    finally:
        for orchestrator in (a, b, c):
            orchestrator.close()
