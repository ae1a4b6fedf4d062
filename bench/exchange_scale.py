"""Diagnostics exchange at scale: store traffic per node and interval, all-read vs digest.

N simulated nodes (8 ranks each by default, every rank with an in-flight call or not, two
communicators: the job's data-parallel one and one per node) exchange their diagnostics summaries
through one real etcd server (``tests.servers.EtcdServer``) with the project's ``EtcdStore``,
each node with its own store object over a counting proxy of one etcd client. Both designs run in
the same process, one after the other, for the same N:

* ``old``: what the exchange did before the digest, in its steady state: every node publishes its
  summary once per interval and, at each of its two polls per interval, reads every other node's
  summary (``check`` then ``multi_get``; ``EtcdStore`` puts 128 keys in one transaction);
* ``new``: :class:`elasticft.diag.exchange.ViewExchange` itself, driven one poll at a time
  (``poll_once``) on a simulated clock: every node publishes its summary, the leader reads them
  all and publishes the digest, every other node reads the digest; all through etcd (the
  exchange with its hub off);
* ``hub``: the same, as the exchange runs by default: through the hub the leader serves (a
  TCPStore in the bench's process), etcd holding only the hub's address.

The old design's reads are the same at every node, so they are measured at ``--sample`` nodes
(every node publishes); the new design runs every node. Printed per N: etcd requests, keys read,
bytes read and written per node per interval (the leader apart; for ``hub``, calls to the hub
too), the job's totals per interval,
and the ratio old/new. Bytes are the values etcd returned or stored (keys and framing not
counted); time is the wall time of the node's exchange work (etcd round trips, and encoding and
decoding summaries and digests, as each design does at every poll).

Usage: ``nice -n 10 python bench/exchange_scale.py --nodes 64 256 1024``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elasticft.diag.detectors import InFlight, RankView
from elasticft.diag.exchange import ViewExchange
from elasticft.diag.summary import decode_summary, encode_summary, summary_key
from elasticft.rendezvous.etcd import EtcdSettings, LazyClient
from elasticft.rendezvous.store import EtcdStore
from tests.servers import EtcdServer

INTERVAL_S, POLL_S = 1.0, 0.5  # the exchange's defaults: 2 polls per interval
DATA_PARALLEL = 0x5EED0001


@dataclasses.dataclass
class Traffic:
    requests: int = 0
    keys_read: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    hub_calls: float = 0.0

    def add(self, other: Traffic) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def scaled(self, factor: float) -> Traffic:
        return Traffic(*(getattr(self, f.name) * factor for f in dataclasses.fields(self)))


class CountingClient:
    """One node's view of the shared etcd client: counts its requests and the values moved."""

    def __init__(self, client: Any, traffic: Traffic) -> None:
        self._client = client
        self.traffic = traffic

    def put(self, key: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        self.traffic.requests += 1
        self.traffic.bytes_written += len(value)
        return self._client.put(key, value, *args, **kwargs)

    def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self.traffic.requests += 1
        value, meta = self._client.get(key, *args, **kwargs)
        self.traffic.keys_read += 1
        self.traffic.bytes_read += len(value or b"")
        return value, meta

    def get_response(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self.traffic.requests += 1
        return self._client.get_response(key, *args, **kwargs)

    def transaction(self, compare: Any, success: Any, failure: Any) -> Any:
        self.traffic.requests += 1
        ok, responses = self._client.transaction(compare=compare, success=success,
                                                 failure=failure)
        for found in responses:
            self.traffic.keys_read += 1
            if found:
                self.traffic.bytes_read += len(found[0][0])
        return ok, responses

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def node_views(n: int, group_rank: int, ranks_per_node: int, rng: random.Random
               ) -> list[RankView]:
    """One node's ranks in a healthy job: about half in the data-parallel all-reduce."""
    views = []
    local_comm = 0x7C000000 + group_rank
    for local in range(ranks_per_node):
        rank = group_rank * ranks_per_node + local
        waiting = rng.random() < 0.5
        seq = 4000 + waiting
        in_flight = (InFlight("all_reduce", DATA_PARALLEL, seq, round(rng.uniform(0.001, 0.05), 3),
                              "ring"),) if waiting else ()
        views.append(RankView(rank, f"node{group_rank}", pid=10_000 + local, process_state=None,
                              heartbeat_age_s=round(rng.uniform(0.0, 0.1), 3),
                              in_flight=in_flight, comm_seqs={DATA_PARALLEL: seq,
                                                              local_comm: 2000},
                              steps=1000, step_age_s=round(rng.uniform(0.0, 0.3), 3)))
    return views


def timed(traffic: Traffic, call: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    try:
        return call()
    finally:
        traffic.seconds += time.perf_counter() - started


def run_old(client: Any, settings: EtcdSettings, prefix: str, views: list[list[RankView]],
            busy: list[dict[int, float]], intervals: int, sample: int) -> tuple[Traffic, Traffic]:
    """(per reading node per interval, per node per interval for publishing)."""
    n = len(views)
    traffic = [Traffic() for _ in range(n)]
    stores = [EtcdStore(CountingClient(client, traffic[g]), prefix, settings,
                        timedelta(seconds=30)) for g in range(n)]
    readers = list(range(1, min(n, sample + 1)))
    seq = 0

    def one_interval() -> None:
        nonlocal seq
        seq += 1
        for g in range(n):
            payload = encode_summary(f"node{g}", g, seq, views[g], busy[g])
            timed(traffic[g], lambda g=g, payload=payload: stores[g].set(summary_key(g),
                                                                         payload))
        for _ in range(round(INTERVAL_S / POLL_S)):
            for g in readers:
                keys = [summary_key(other) for other in range(n) if other != g]

                def poll(g: int = g, keys: list[str] = keys) -> None:
                    if stores[g].check(keys):
                        for payload in stores[g].multi_get(keys):
                            decode_summary(payload)  # as the old exchange did at every poll
                timed(traffic[g], poll)

    one_interval()  # every key exists from here on: the steady state
    for t in traffic:
        t.__init__()  # type: ignore[misc]
    for _ in range(intervals):
        one_interval()
    reading, publishing = Traffic(), Traffic()
    for g in readers:
        reading.add(traffic[g])
    for g in range(n):
        if g not in readers:
            publishing.add(traffic[g])
    return (reading.scaled(1 / (len(readers) * intervals)),
            publishing.scaled(1 / ((n - len(readers)) * intervals)))


def run_new(client: Any, settings: EtcdSettings, prefix: str, views: list[list[RankView]],
            busy: list[dict[int, float]], intervals: int, hub: bool
            ) -> tuple[Traffic, Traffic, int]:
    """(the leader per interval, every other node per interval, the digest's size in etcd)."""
    n = len(views)
    now = [0.0]
    traffic = [Traffic() for _ in range(n)]
    nodes = [ViewExchange(interval_s=INTERVAL_S, poll_s=POLL_S, clock=lambda: now[0], hub=hub)
             for _ in range(n)]
    for g, exchange in enumerate(nodes):
        exchange.attach(EtcdStore(CountingClient(client, traffic[g]), prefix, settings,
                                  timedelta(seconds=30)), f"node{g}", g, n, background=False,
                        hub_host="127.0.0.1")

    def one_interval() -> None:
        for _ in range(round(INTERVAL_S / POLL_S)):
            now[0] += POLL_S
            for g, exchange in enumerate(nodes):
                exchange.offer(views[g], busy[g])
                timed(traffic[g], exchange.poll_once)

    one_interval()
    one_interval()  # every key exists and every node has read a digest: the steady state
    for t in traffic:
        t.__init__()  # type: ignore[misc]
    hub_before = [sum(e.hub_calls.values()) for e in nodes]
    for _ in range(intervals):
        one_interval()
    for t, e, before in zip(traffic, nodes, hub_before, strict=True):
        t.hub_calls = sum(e.hub_calls.values()) - before
    others = Traffic()
    for t in traffic[1:]:
        others.add(t)
    assert all(len(e.job_view().views) > 0 for e in nodes[1:]), "a node saw no other rank"
    size = len(client.get(prefix + "elasticft.diag.digest")[0] or b"")
    for exchange in nodes:
        exchange.close()
    return traffic[0].scaled(1 / intervals), others.scaled(1 / ((n - 1) * intervals)), size


def fmt(t: Traffic) -> str:
    return (f"requests {t.requests:7.1f}  keys read {t.keys_read:7.1f}  read "
            f"{t.bytes_read / 1e3:9.1f} KB  written {t.bytes_written / 1e3:5.1f} KB  "
            f"time {t.seconds * 1e3:7.1f} ms" +
            (f"  hub calls {t.hub_calls:5.1f}" if t.hub_calls else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--intervals", type=int, default=2)
    parser.add_argument("--sample", type=int, default=16,
                        help="nodes whose reads are measured in the old design (all publish)")
    args = parser.parse_args()
    if min(args.nodes) < 2 or args.intervals < 1 or args.sample < 1:
        print("bench/exchange_scale.py: --nodes must be >= 2, --intervals and --sample >= 1",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="elasticft-exchange-bench-") as tmp:
        server = EtcdServer(Path(tmp) / "data", Path(tmp) / "etcd.log")
        server.start()
        try:
            settings = EtcdSettings.from_conf(server.endpoint, {"rpc_timeout": "30"})
            client = LazyClient(settings)
            print(f"etcd {server.endpoint} (one member), {args.ranks_per_node} ranks per node, "
                  f"interval {INTERVAL_S:g} s, poll {POLL_S:g} s, "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
            for n in args.nodes:
                rng = random.Random(n)
                views = [node_views(n, g, args.ranks_per_node, rng) for g in range(n)]
                busy = [{v.rank: round(rng.uniform(0.09, 0.11), 6) for v in vs} for vs in views]
                summary = len(encode_summary("node0", 0, 1, views[0], busy[0]))
                old_reader, old_publisher = run_old(client, settings, f"/bench/old{n}/", views,
                                                    busy, args.intervals, args.sample)
                leader, other, digest = run_new(client, settings, f"/bench/new{n}/", views,
                                                busy, args.intervals, hub=False)
                hub_leader, hub_other, _ = run_new(client, settings, f"/bench/hub{n}/", views,
                                                   busy, args.intervals, hub=True)
                old_job = old_reader.scaled(n)
                new_job = Traffic()
                new_job.add(leader)
                new_job.add(other.scaled(n - 1))
                print(f"N={n:5d}  summary {summary / 1e3:.1f} KB  digest {digest / 1e3:.1f} KB")
                print(f"  old  every node   {fmt(old_reader)}")
                print(f"  new  other nodes  {fmt(other)}")
                print(f"  new  leader       {fmt(leader)}")
                print(f"  hub  other nodes  {fmt(hub_other)}")
                print(f"  hub  leader       {fmt(hub_leader)}")
                print(f"  job per interval: old requests {old_job.requests:9.0f} read "
                      f"{old_job.bytes_read / 1e6:9.2f} MB   new requests {new_job.requests:7.0f}"
                      f" read {new_job.bytes_read / 1e6:7.2f} MB   ratio old/new: requests "
                      f"{old_job.requests / new_job.requests:6.1f}x  bytes read "
                      f"{old_job.bytes_read / new_job.bytes_read:6.1f}x  keys read "
                      f"{old_job.keys_read / new_job.keys_read:6.1f}x")
                del old_publisher
                sys.stdout.flush()
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
