"""Rendezvous rounds against a real etcd server: several real etcd-v3 handlers (each with its own
client and lease), run as threads of the test, join, close and leave rounds."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
)

from elasticft.rendezvous import handler as handler_module
from elasticft.rendezvous.factory import create_handler
from elasticft.rendezvous.handler import EtcdRendezvousHandler
from elasticft.rendezvous.health import HealthReport
from elasticft.rendezvous.membership import read_status
from tests.servers import EtcdServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def healthy() -> HealthReport:
    return HealthReport(ok=True, detail="", seconds=0.0)


class Joiner:
    """``handler.next_rendezvous()`` in a thread; its outcome (rank, world, round) or error."""

    def __init__(self, handler: EtcdRendezvousHandler) -> None:
        self.handler = handler
        self.outcome: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=handler.node_id)
        self.thread.start()

    def _run(self) -> None:
        try:
            info = self.handler.next_rendezvous()
            self.outcome = (info.rank, info.world_size, self.handler.round)
        except Exception as e:
            self.outcome = e

    def result(self, timeout: float = 30.0) -> Any:
        self.thread.join(timeout)
        if self.thread.is_alive():  # say where it waits
            frame = sys._current_frames().get(self.thread.ident or 0)
            stack = "".join(traceback.format_stack(frame)) if frame else ""
            raise AssertionError(f"{self.handler.node_id} still waits after {timeout} s:\n{stack}")
        return self.outcome


@contextlib.contextmanager
def handlers_on(endpoint: str, job: str) -> Iterator[Callable[..., EtcdRendezvousHandler]]:
    """``make(node_id, (min, max))`` builds a real handler of ``job``; all leave at the end."""
    made: list[EtcdRendezvousHandler] = []

    def make(node_id: str, nnodes: tuple[int, int], last_call: int = 1) -> EtcdRendezvousHandler:
        params = RendezvousParameters(
            "etcd-v3", endpoint, job, *nnodes, node_id=node_id,
            last_call_timeout=str(last_call), join_timeout="60", keep_alive_interval="2",
            local_addr="127.0.0.1")
        handler = create_handler(params, health_check=healthy)
        made.append(handler)
        return handler

    try:
        yield make
    finally:
        for handler in made:
            handler.leave()


@pytest.fixture
def make(etcd_server: EtcdServer, request: pytest.FixtureRequest,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., EtcdRendezvousHandler]]:
    # The running nodes ask etcd every 0.2 s instead of every 2 s, to keep the test short.
    monkeypatch.setattr(handler_module, "RUNNING_POLL_S", 0.2)
    job = request.node.name[-40:].replace("[", "_").replace("]", "_")
    with handlers_on(etcd_server.endpoint, job) as make:
        yield make


def wait_until(condition: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_late_joiner_waits_for_the_next_round_and_gets_the_running_nodes_to_make_room(
    make: Callable[..., EtcdRendezvousHandler],
) -> None:
    a, b, c = make("a", (2, 3)), make("b", (2, 3)), make("c", (2, 3))
    first = [Joiner(a), Joiner(b)]
    assert sorted(j.result() for j in first) == [(0, 2, 0), (1, 2, 0)]
    assert a.num_nodes_waiting() == 0
    late = Joiner(c)  # round 0 is closed: c waits in round 1
    assert wait_until(a.num_nodes_waiting) == 1  # the job has room and c waits for it
    assert wait_until(b.num_nodes_waiting) == 1
    ranks_before = [j.result()[0] for j in first]
    again = [Joiner(a), Joiner(b)]
    outcomes = [j.result() for j in again] + [late.result()]
    assert [o[1:] for o in outcomes] == [(3, 1)] * 3
    # the running nodes keep their ranks; the newcomer comes after them
    assert [o[0] for o in outcomes] == [*ranks_before, 2]
    assert a.num_nodes_waiting() == 0


def test_round_still_closes_after_its_coordinator_is_lost(
    make: Callable[..., EtcdRendezvousHandler],
) -> None:
    a, b, c, d = (make(n, (3, 4)) for n in "abcd")
    first = Joiner(a)
    keys, client = a.keys, a._parts.client
    wait_until(lambda: client.get(keys.coordinator(0))[0] == b"a")
    waiting_b = Joiner(b)
    wait_until(lambda: client.get(keys.join(0, "b"))[0] is not None)
    a.leave()  # the coordinator is lost: its lease is revoked, its keys vanish
    assert isinstance(first.result(), RendezvousClosedError)
    assert client.get(keys.coordinator(0))[0] in (None, b"b")
    others = [Joiner(c), Joiner(d)]
    outcomes = sorted([waiting_b.result()] + [j.result() for j in others])
    assert outcomes == [(0, 3, 0), (1, 3, 0), (2, 3, 0)]  # closed at min after the last call
    status = read_status(client, keys, a._parts.settings)
    assert sorted(m.node_id for m in status.participants) == ["b", "c", "d"]


def test_a_standby_does_not_restart_a_full_job_and_leaves_when_it_closes(
    make: Callable[..., EtcdRendezvousHandler],
) -> None:
    a, b, c = make("a", (2, 2)), make("b", (2, 2)), make("c", (2, 2))
    joiners = [Joiner(a), Joiner(b)]
    assert sorted(j.result() for j in joiners) == [(0, 2, 0), (1, 2, 0)]
    standby = Joiner(c)
    keys, client = a.keys, a._parts.client
    wait_until(lambda: client.get(keys.join(1, "c"))[0] is not None)
    status = read_status(client, keys, a._parts.settings)
    assert [m.node_id for m in status.standbys] == ["c"]
    for _ in range(8):  # well past the 0.2 s between etcd queries, the standby polling too
        assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)
        time.sleep(0.25)
    assert standby.thread.is_alive()
    assert a.shutdown()  # the job is over: the standby is let go
    assert isinstance(standby.result(), RendezvousGracefulExitError)
    assert b.is_closed()


def test_a_node_whose_lease_expired_while_waiting_joins_again_on_a_new_lease(
    make: Callable[..., EtcdRendezvousHandler],
) -> None:
    a, b = make("a", (2, 2)), make("b", (2, 2))
    waiting = Joiner(a)
    keys, client = a.keys, a._parts.client
    wait_until(lambda: client.get(keys.join(0, "a"))[0] is not None)
    client.revoke_lease(a._parts.publisher.lease().id)  # as if it had expired
    assert client.get(keys.join(0, "a"))[0] is None
    other = Joiner(b)
    assert sorted([waiting.result(), other.result()]) == [(0, 2, 0), (1, 2, 0)]
    status = read_status(client, keys, a._parts.settings)
    assert sorted(m.node_id for m in status.participants) == ["a", "b"]


def test_closing_a_round_deletes_the_keys_and_store_of_the_round_two_before(
    make: Callable[..., EtcdRendezvousHandler],
) -> None:
    a, b = make("a", (2, 2)), make("b", (2, 2))
    keys, client = a.keys, a._parts.client

    def keys_of(round_: int) -> list[str]:
        prefixes = (keys.round_keys(round_), keys.round_store_keys(round_))
        return [meta.key.decode() for prefix in prefixes
                for _, meta in client.get_prefix(prefix, keys_only=True)]

    for round_ in range(4):
        joiners = [Joiner(a), Joiner(b)]
        assert sorted(j.result() for j in joiners) == [(0, 2, round_), (1, 2, round_)]
        # the handler wrote the workers' address in the round's store; the workers would
        # write theirs there too
        assert any(key.endswith("/MASTER_ADDR") for key in keys_of(round_)), keys_of(round_)
        client.put(f"{keys.round_store_keys(round_)}rank0", b"127.0.0.1:1")
        if round_ >= 2:
            assert keys_of(round_ - 2) == [], f"round {round_ - 2} left behind"
        if round_ >= 1:
            assert keys_of(round_ - 1), "the previous round is still read"
    # a key of a later round's store does not share a prefix with round 1's ("...1/" not "...1")
    client.put(f"{keys.round_store_keys(11)}rank0", b"x")
    joiners = [Joiner(a), Joiner(b)]
    assert sorted(j.result() for j in joiners) == [(0, 2, 4), (1, 2, 4)]
    assert keys_of(11) and not keys_of(2)


def test_a_node_whose_round_closed_during_an_etcd_outage_takes_its_rank_in_it(
    make: Callable[..., EtcdRendezvousHandler], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outage is injected at the worst moment: the poll that would have seen the result
    fails. Retrying from the round after the last closed one would leave a waiting alone
    while b trains without it (what a leader change of a 3-member cluster did)."""
    a, b = make("a", (2, 2)), make("b", (2, 2))
    real_poll, failed = a._rounds.poll, []

    def poll_failing_once_the_result_is_out(round_: int, lease: Any, coordinating: bool) -> Any:
        view = real_poll(round_, lease, coordinating)
        if view.result is not None and not failed:
            failed.append(round_)
            raise RendezvousConnectionError("etcd failed while polling (injected)")
        return view

    monkeypatch.setattr(a._rounds, "poll", poll_failing_once_the_result_is_out)
    assert sorted(j.result() for j in [Joiner(a), Joiner(b)]) == [(0, 2, 0), (1, 2, 0)]
    assert failed == [0]
