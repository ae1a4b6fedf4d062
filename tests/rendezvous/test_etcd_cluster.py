"""Rendezvous rounds over a real 3-member etcd cluster (one process a member, each with its own
data, on loopback): a member restarted while the nodes train, and the etcd leader killed in the
middle of a round. The handlers fail over between the endpoints of ``--rdzv-endpoint``; the
round completes and no lease is lost."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator

import pytest

from elasticft.rendezvous import handler as handler_module
from elasticft.rendezvous.etcd import EtcdSettings, LazyClient
from elasticft.rendezvous.handler import EtcdRendezvousHandler
from elasticft.rendezvous.membership import read_status
from tests.rendezvous.test_rounds import Joiner, handlers_on, wait_until
from tests.servers import EtcdCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.fixture
def make(etcd_cluster: EtcdCluster, monkeypatch: pytest.MonkeyPatch
         ) -> Iterator[Callable[..., EtcdRendezvousHandler]]:
    monkeypatch.setattr(handler_module, "RUNNING_POLL_S", 0.2)
    with handlers_on(etcd_cluster.endpoint, "cluster-job") as make:
        yield make


def test_rounds_survive_a_member_restart_and_the_leader_killed_mid_round(
    etcd_cluster: EtcdCluster, make: Callable[..., EtcdRendezvousHandler]
) -> None:
    nodes = [make(n, (3, 3)) for n in "abc"]
    assert sorted(j.result() for j in [Joiner(h) for h in nodes]) == [
        (0, 3, 0), (1, 3, 0), (2, 3, 0)]

    # A follower restarts while the nodes train: they keep asking etcd, and nothing changes.
    follower = next(m for m in etcd_cluster.members if m is not etcd_cluster.leader())
    follower.stop()
    for _ in range(10):
        assert all(h.num_nodes_waiting() == 0 for h in nodes)
        time.sleep(0.3)
    follower.start()

    # The leader is killed in the middle of round 1: two nodes have joined, the third comes
    # after. The round completes over the two members left, with everyone's lease intact.
    a, b, c = nodes
    first = [Joiner(a), Joiner(b)]
    keys, client = a.keys, a._parts.client
    wait_until(lambda: all(client.get(keys.join(1, n))[0] for n in "ab"))
    leader = etcd_cluster.leader()
    leader.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    late = Joiner(c)
    outcomes = sorted([j.result(60) for j in first] + [late.result(60)])
    assert outcomes == [(0, 3, 1), (1, 3, 1), (2, 3, 1)], outcomes
    print(f"\nMEASURED round 1 completed {time.monotonic() - killed_at:.2f} s after the etcd "
          f"leader ({leader.name}) was killed; new leader {etcd_cluster.leader().name}")

    # The killed member comes back, catches up, and serves the next round's state.
    leader.start()
    assert sorted(j.result(60) for j in [Joiner(h) for h in nodes]) == [
        (0, 3, 2), (1, 3, 2), (2, 3, 2)]
    status = read_status(client, keys, a._parts.settings)
    assert status.round is not None and status.round.round == 2
    assert sorted(m.node_id for m in status.participants) == ["a", "b", "c"]


def test_the_client_stays_off_a_dead_member(etcd_cluster: EtcdCluster) -> None:
    """The member the client uses, a follower, is killed. One request may fail; the ones after
    it, a second apart (longer than the client's pause before it tries a failed endpoint
    again), all succeed. (Killing the leader would add the election's errors.)"""
    leader = etcd_cluster.leader()
    settings = EtcdSettings.from_conf(etcd_cluster.endpoint, {})
    for _ in range(30):  # the client starts on a member picked at random: take a follower
        client = LazyClient(settings)
        client.put("/probe", b"1")
        if client.endpoint_in_use.netloc != leader.endpoint:
            break
        client.close()
    try:
        in_use = client.endpoint_in_use.netloc
        next(m for m in etcd_cluster.members if m.endpoint == in_use).stop(signal.SIGKILL)
        failures = 0
        for _ in range(6):
            try:
                assert client.get("/probe")[0] == b"1"
            except Exception:
                failures += 1
            time.sleep(1.0)
        assert failures <= 1, f"{failures} of 6 requests failed with one member of 3 down"
    finally:
        client.close()
