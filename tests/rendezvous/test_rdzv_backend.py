"""The etcd-v3 rendezvous' building blocks against a real etcd server: connection errors, the
etcd store, the blacklist and membership records, and one-line config errors."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elasticft.rendezvous import store as store_module
from elasticft.rendezvous.etcd import EtcdConfigError, EtcdSettings, Keys, LazyClient
from elasticft.rendezvous.factory import create_handler
from elasticft.rendezvous.membership import Blacklist, MemberRecord, MembershipPublisher
from elasticft.rendezvous.rounds import RoundStore
from elasticft.rendezvous.store import EtcdStore
from tests.servers import EtcdServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def connect(server: EtcdServer) -> tuple[LazyClient, EtcdSettings]:
    settings = EtcdSettings.from_conf(server.endpoint, {"rpc_timeout": "3"})
    return LazyClient(settings), settings


def test_unreachable_etcd_is_a_connection_error(etcd_server: EtcdServer) -> None:
    settings = EtcdSettings.from_conf("127.0.0.1:1", {"rpc_timeout": "1"})
    rounds = RoundStore(LazyClient(settings), Keys("/t", "x"), settings, "n1")
    with pytest.raises(RendezvousConnectionError, match=r"etcd at 127\.0\.0\.1:1 failed"):
        rounds.last_round()


# Judges how soon a watch wakes a thread of this process: run alone (scripts/test.sh).
@pytest.mark.serial
def test_store_set_get_add_compare_set_and_watch_wait(
    etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "REREAD_FOR_S", 1.5)
    client, settings = connect(etcd_server)
    store = EtcdStore(client, "/t/store/", settings, timeout=timedelta(seconds=5))
    prefixed = dist.PrefixStore("round.1", store)  # how torch's handler hands it out
    prefixed.set("MASTER_ADDR", "127.0.0.1")
    assert prefixed.get("MASTER_ADDR") == b"127.0.0.1"
    assert prefixed.add("n", 1) == 1 and prefixed.add("n", 2) == 3
    assert prefixed.compare_set("k", "", "v1") == b"v1"
    assert prefixed.compare_set("k", "wrong", "v2") == b"v1"
    assert prefixed.compare_set("k", "v1", "v2") == b"v2"
    assert prefixed.check(["k", "n"]) and not prefixed.check(["missing"])
    assert prefixed.multi_get(["k", "n"]) == [b"v2", b"3"]

    # A blocked get finds a key written soon by a re-read, and one written after the re-reads
    # (1.5 s here) through its watch, at once: the watch's own wake-up would come 5 s later.
    threading.Timer(0.5, lambda: store.set("round.1/soon", b"s")).start()
    assert prefixed.get("soon") == b"s"
    threads_before = threading.active_count()
    writer = threading.Timer(2.5, lambda: store.set("round.1/late", b"x"))
    writer.start()
    started = time.monotonic()
    assert prefixed.get("late") == b"x"
    assert time.monotonic() - started < 4.0
    # ... and the watch's stream and threads end with it (hundreds of agents in a process).
    writer.join()
    settle = time.monotonic() + 2.0
    while threading.active_count() > threads_before and time.monotonic() < settle:
        time.sleep(0.05)
    assert threading.active_count() == threads_before

    # wait (long waits in slices: the JIT watcher) goes to its watch at once.
    threading.Timer(0.5, lambda: store.set("round.1/waited", b"w")).start()
    started = time.monotonic()
    prefixed.wait(["waited"], timedelta(seconds=4))
    assert time.monotonic() - started < 1.5
    with pytest.raises(dist.DistStoreError, match="timed out"):
        prefixed.wait(["never"], timedelta(seconds=0.5))


def test_store_reads_many_keys_in_one_transaction_per_128(etcd_server: EtcdServer) -> None:
    client, settings = connect(etcd_server)

    class Counting:
        """The real client, counting the requests the store sends through it."""

        def __init__(self) -> None:
            self.requests: list[str] = []

        def __getattr__(self, name: str):
            attribute = getattr(client, name)
            if callable(attribute) and name in ("get", "transaction", "put"):
                self.requests.append(name)
            return attribute

    counting = Counting()
    etcd_store = EtcdStore(counting, "/t/many/", settings, timeout=timedelta(seconds=5))
    store = dist.PrefixStore("round.1", etcd_store)  # (the Python object must stay alive)
    keys = [f"k{i}" for i in range(130)]
    for key in keys:
        store.set(key, key.upper())
    counting.requests.clear()
    assert store.check(keys) and not store.check([*keys, "missing"])
    assert store.multi_get(keys) == [k.upper().encode() for k in keys]
    assert counting.requests == ["transaction"] * 6  # 130 keys: 2 per call, no single gets
    # A key written later is waited for, as get waits.
    threading.Timer(0.5, lambda: store.set("late", b"x")).start()
    assert store.multi_get(["k0", "late"]) == [b"K0", b"x"]


def test_blacklist_round_trip_and_members_expire_with_lease(etcd_server: EtcdServer) -> None:
    client, settings = connect(etcd_server)
    blacklist = Blacklist(client, "/t", settings)
    blacklist.add("node-b", "ECC errors on GPU 3", added_by="diag")
    assert blacklist.get("node-b").reason == "ECC errors on GPU 3"
    assert [e.node_id for e in blacklist.entries()] == ["node-b"]
    assert blacklist.remove("node-b") and blacklist.get("node-b") is None

    keys = Keys("/t", "job1")
    publisher = MembershipPublisher(client, keys, settings, ttl_s=2)
    publisher.publish(keys.member("a"), MemberRecord("a", "waiting", "127.0.0.1", 1))
    time.sleep(3)  # refreshed past its TTL
    assert client.get(keys.member("a"))[0] is not None
    publisher.close()  # revoked: gone at once
    assert client.get(keys.member("a"))[0] is None


def test_handler_config_errors_are_one_line() -> None:
    def params(**conf: str) -> RendezvousParameters:
        return RendezvousParameters("etcd-v3", "127.0.0.1:2379", "job", 1, 2, **conf)

    with pytest.raises(EtcdConfigError, match="protocol=https needs ca_cert"):
        create_handler(params(protocol="https"))
    with pytest.raises(EtcdConfigError, match="keep_alive_interval='x'"):
        create_handler(params(keep_alive_interval="x"))
    with pytest.raises(EtcdConfigError, match="not HOST:PORT"):
        create_handler(RendezvousParameters("etcd-v3", "host:notaport", "job", 1, 2))
    handler = create_handler(params(node_id="n1"))  # builds without contacting etcd
    assert handler.get_backend() == "etcd-v3" and handler.node_id == "n1"


# Judges how soon a watch wakes a thread of this process: run alone (scripts/test.sh).
@pytest.mark.serial
def test_store_wait_of_one_thread_is_interrupted_on_demand(etcd_server: EtcdServer) -> None:
    """The JIT watcher waits a whole round on one key; stopping it must not take its timeout,
    nor touch another thread's wait."""
    client, settings = connect(etcd_server)
    etcd_store = EtcdStore(client, "/t/interrupt/", settings, timeout=timedelta(seconds=30))
    store = dist.PrefixStore("round.1", etcd_store)
    outcome: dict[str, str] = {}

    def wait(name: str) -> None:
        try:
            store.wait(["request"], timedelta(seconds=20))
            outcome[name] = "found"
        except Exception as e:  # torch raises its DistStoreError through the C++ store
            outcome[name] = f"{type(e).__name__}: {e}"

    watcher = threading.Thread(target=wait, args=("watcher",))
    other = threading.Thread(target=wait, args=("other",))
    watcher.start()
    other.start()
    time.sleep(1.0)  # both inside their etcd watch
    started = time.monotonic()
    etcd_store.interrupt_waits(watcher)
    watcher.join(timeout=5)
    assert not watcher.is_alive() and time.monotonic() - started < 2.0
    assert "interrupted" in outcome["watcher"]
    assert other.is_alive()  # still waiting, and it finds the key once written
    store.set("request", b"r")
    other.join(timeout=5)
    assert outcome["other"] == "found"

    # Interrupted between two waits: the next one ends at once.
    late = threading.Thread(target=lambda: (time.sleep(0.5), wait("late")))
    late.start()
    etcd_store.interrupt_waits(late)
    late.join(timeout=5)
    assert "interrupted" in outcome["late"]
