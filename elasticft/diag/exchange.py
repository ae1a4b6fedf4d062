"""Cross-node exchange of diagnostic views, so that every agent judges every rank of the job.

A node's monitor reads only its own workers' progress rings. On a job of several nodes that is
not enough: the node whose workers only *wait* in a collective cannot see that the rank they wait
for is stopped on another node, and a slow rank can only be compared with the few peers of its
own node (with one worker per node, with none). So every agent publishes a compact summary of its
ranks (:mod:`elasticft.diag.summary`) for the round, once per
:attr:`ViewExchange.interval_s` and at once when a rank of its node is newly seen stopped.

Reading every summary at every node would be O(N^2) reads and bytes across the job. Instead the
round's leader (group rank 0) reads them all and publishes one job digest
(:mod:`elasticft.diag.digest`) per poll: the ranks that decide a verdict or name a culprit, capped,
whatever N. Every other node reads only the digest. Per node and poll that is one read (two
store calls per interval with the summary's write); the leader's reads grow with N, so the job's
traffic grows with N, not N^2.

**The leader's hub.** That traffic (a write a second and two reads per node) would be most of
what a job asks of etcd. So the leader serves the exchange itself: a TCPStore of its own (the
*hub*), whose address it writes once into the round's store (:data:`HUB_KEY`). The others read
the address once per round and then write and read only through the hub; etcd sees three
requests a node a round. The hub lives and dies with the leader's agent, which is what the
round's membership follows anyway. TCPStore's client waits without end for an answer from a
server that is stopped (SIGSTOP, a frozen host), so every hub call has a deadline
(:mod:`elasticft.diag.hub`). While a call is overdue a node exchanges through the round's
store, and is back on the hub once it answers; a node whose hub call fails gives the
connection up, and reads the address again and connects after
:attr:`ViewExchange.hub_retry_s`. A leader that cannot serve a hub writes an empty address:
everyone exchanges through the round's store.

If the digest stops changing (the leader's agent or host is gone, or stopped; its hub with it,
so the others are on the round's store by then), group rank ``k`` takes the leader's place after
``k`` x :attr:`ViewExchange.stale_after_s` without a new digest, and hands it back as soon as it
reads a digest written by a lower group rank. Meanwhile the others judge on their own ranks and
report the leader's node as silent: nobody is judged on old facts.

A background thread does all store traffic, reading a key with ``check`` until it exists (keys
of a round's store are never removed, so afterwards ``multi_get`` never waits). The monitor's
``check`` only hands over an object and reads a snapshot: it never touches the store.

Freshness is judged without comparing clocks of different machines: a summary and a digest each
carry a counter their publisher increments, and a reader notes on its own monotonic clock when it
last changed. A node whose summary has not changed for :attr:`ViewExchange.stale_after_s` is
*silent*: its ranks are not judged on old facts, and the silence is reported as evidence itself.
Ages inside a summary are as the publisher measured them; each remote
:class:`~elasticft.diag.detectors.RankView` carries ``view_age_s``, how long ago that was (the
leader's age of the summary plus the reader's age of the digest).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from elasticft.diag import digest as job_digest
from elasticft.diag.detectors import RankView
from elasticft.diag.hub import Hub, HubBusy, HubUnavailable, connect, serve
from elasticft.diag.summary import (
    KEY_PREFIX,
    SCHEMA,
    JobView,
    NodeSummary,
    RemoteNode,
    decode_summary,
    encode_summary,
    summary_key,
)
from elasticft.procs import UNRESPONSIVE_STATES

logger = logging.getLogger(__name__)

__all__ = ["HUB_KEY", "KEY_PREFIX", "SCHEMA", "JobView", "NodeSummary", "RemoteNode",
           "ViewExchange", "decode_summary", "encode_summary", "summary_key"]

HUB_KEY = "diag/hub"
"""Key in the round's store: ``host:port`` of the leader's hub, or empty when it serves none."""


@dataclasses.dataclass
class _Round:
    store: Any
    node_id: str
    group_rank: int
    group_world_size: int
    started: float
    hub_host: str | None = None
    hub: Hub | None = None
    hub_address: str | None = None
    """The leader: its hub's (empty: none); the others: the one they read (None: not yet)."""
    hub_written: bool = False
    hub_retry_at: float = 0.0


@dataclasses.dataclass(eq=False)
class ViewExchange:
    """Publishes this node's summary; the leader gathers all of them into the job digest, the
    others read the digest."""

    _: dataclasses.KW_ONLY
    interval_s: float = 1.0
    """Seconds between this node's publications (at once when one of its ranks is newly seen
    stopped)."""
    poll_s: float = 0.5
    """Seconds between the background thread's exchanges."""
    stale_after_s: float = None  # type: ignore[assignment]
    """A node whose summary has not changed for this many seconds is silent (by default
    three intervals, at least 3 s)."""
    clock: Callable[[], float] = time.monotonic
    digest_limits: job_digest.DigestLimits = dataclasses.field(
        default_factory=job_digest.DigestLimits)
    hub: bool = True
    """Whether the leader serves the exchange (off: everyone uses the round's store)."""
    hub_timeout_s: float = 2.0
    """Deadline of every call to the leader's hub."""
    hub_retry_s: float = 10.0
    """Seconds after a failed hub call before the hub's address is read again."""

    def __post_init__(self) -> None:
        if self.stale_after_s is None:
            self.stale_after_s = max(3.0, 3 * self.interval_s)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._round: _Round | None = None
        self._generation = 0
        self._offer: tuple[tuple[RankView, ...], dict[int, float]] | None = None
        self._offer_alarm: frozenset[int] = frozenset()
        self._published_alarm: frozenset[int] = frozenset()
        self._seq = 0
        self._next_publish = 0.0
        self._digest_seq = 0
        # Gatherer only: every node's summary and when it last changed; keys seen to exist.
        self._remote: dict[int, tuple[NodeSummary, float]] = {}
        self._present: set[int] = set()
        self._payloads: dict[int, bytes] = {}
        # The newest digest (read, or built here) and when its token last changed.
        self._digest: tuple[job_digest.Digest, float] | None = None
        self._digest_present = False
        self._names: dict[int, str] = {}  # group rank -> node, as digests named them
        self._acting = False
        self._via: Any = None  # the store the last poll exchanged through
        self._threads: list[threading.Thread] = []
        self._warned: set[str] = set()

    @property
    def active(self) -> bool:
        current = self._round
        return current is not None and current.group_world_size > 1

    @property
    def hub_calls(self) -> collections.Counter[str]:
        """This round's calls to the hub by kind (``set``, ``check1``, ``multi_get4``...)."""
        current = self._round
        return collections.Counter() if current is None or current.hub is None else \
            current.hub.calls

    def attach(self, store: Any, node_id: str, group_rank: int, group_world_size: int, *,
               background: bool = True, hub_host: str | None = None) -> None:
        """A new round: forget the old round's views and exchange for it, through the leader's
        hub or ``store`` (the round's).

        Every round gets its own thread; a thread still blocked in the old round's store (its
        host gone) exits when it returns, instead of delaying the new round. The new round's
        group rank 0 leads, whoever led before, and serves the hub at ``hub_host`` (default:
        this host's name), an address the other nodes reach it at.
        """
        with self._lock:
            self._generation += 1
            generation = self._generation
            previous = self._round
            self._round = _Round(store, node_id, group_rank, group_world_size, self.clock(),
                                 hub_host)
            self._remote, self._present, self._payloads = {}, set(), {}
            self._digest, self._digest_present, self._acting = None, False, False
            self._via, self._names = None, {}
            self._offer = None
            self._offer_alarm = self._published_alarm = frozenset()
            self._next_publish = 0.0
        _close_hub(previous)
        if store is None or group_world_size <= 1 or not background:
            return
        thread = threading.Thread(target=self._run, args=(generation,), daemon=True,
                                  name=f"elasticft-diag-exchange-{generation}")
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def offer(self, views: Sequence[RankView], busy: Mapping[int, float]) -> None:
        """The monitor's newest view of this node (cheap: nothing is encoded or sent here)."""
        alarm = frozenset(v.rank for v in views if v.process_state in UNRESPONSIVE_STATES)
        with self._lock:
            self._offer = (tuple(views), dict(busy))
            self._offer_alarm = alarm
            urgent = bool(alarm - self._published_alarm)
        if urgent:
            self._wake.set()

    def job_view(self) -> JobView:
        """The other nodes' fresh ranks (``view_age_s`` set) and the silent nodes, from the
        newest digest."""
        current = self._round
        if current is None or current.group_world_size <= 1:
            return JobView()
        now = self.clock()
        with self._lock:
            entry = self._digest
        if entry is None:  # nothing yet this round: every other node is silent since its start
            return JobView(silent=tuple(
                RemoteNode(g, None, now - current.started, False)
                for g in range(current.group_world_size) if g != current.group_rank))
        digest, changed = entry
        age = now - changed
        if age <= self.stale_after_s:
            return job_digest.job_view(digest, current.group_rank, round(age, 3))
        # The digest went stale: its publisher is silent, and nobody's old facts are judged.
        if digest.publisher != current.group_rank:
            return JobView(silent=(RemoteNode(digest.publisher, None, age, False,
                                              name=digest.publisher_node, published=True),))
        return JobView(silent=tuple(
            RemoteNode(g, None, age, False) for g in range(current.group_world_size)
            if g != current.group_rank))

    def detach(self, timeout_s: float = 3.0) -> None:
        """Stops using the round's store (the workers stopped) and waits for the thread.

        The store must not be touched once the agent is done with it: the launcher then closes
        the rendezvous, and an etcd client used after its close connects again, leaving a
        channel open that aborts the interpreter at exit. So the thread checks the round before
        every store call, and the agent waits here up to ``timeout_s`` for a call in flight.
        """
        with self._lock:
            self._generation += 1
            previous, self._round = self._round, None
        self._wake.set()
        _close_hub(previous)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("diagnostics exchange thread %s is still in a store call",
                               thread.name)
        self._threads = [t for t in self._threads if t.is_alive()]

    def close(self) -> None:
        self._stop.set()
        self.detach()

    # -- the background thread ------------------------------------------------------------------

    def _warn_once(self, what: str, error: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("diagnostics exchange: %s: %s (further failures logged at debug)",
                           what, error)
        else:
            logger.debug("diagnostics exchange: %s: %s", what, error)

    def _current(self, generation: int) -> bool:
        return generation == self._generation and self._round is not None

    def _run(self, generation: int) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if not self._poll(generation):
                return

    def poll_once(self) -> None:
        """One poll of the store, as the background thread does every :attr:`poll_s` (for a
        round attached with ``background=False``: benches drive many nodes from one thread)."""
        self._poll(self._generation)

    def _poll(self, generation: int) -> bool:
        """Publishes this node's summary when due, then gathers or reads the digest; False when
        the round is over."""
        with self._lock:
            if not self._current(generation):
                return False
            current = self._round
            assert current is not None
        store = self._exchange_store(generation, current)
        if store is None:  # the leader's address is not known yet: nowhere to publish
            return self._current(generation)
        with self._lock:
            if not self._current(generation):
                return False
            offer, alarm = self._offer, self._offer_alarm
            now = self.clock()
            due = offer is not None and (now >= self._next_publish or
                                         bool(alarm - self._published_alarm))
            if due:
                self._offer = None
                self._seq += 1
                self._published_alarm = alarm
                seq = self._seq
                self._next_publish = now + self.interval_s
        if due and offer is not None:
            payload = encode_summary(current.node_id, current.group_rank, seq, *offer)
            if not self._current(generation):
                return False
            try:
                store.set(summary_key(current.group_rank), payload)
            except Exception as e:
                self._failed(current, "publishing this node's summary failed", e)
        if current.group_rank == 0:
            self._gather(generation, current, store)
            return True
        self._read_digest(generation, current, store)
        if self._acting:
            self._gather(generation, current, store)
        return True

    # -- where to exchange: the leader's hub, or the round's store ------------------------------

    def _exchange_store(self, generation: int, current: _Round) -> Any:
        """The store this poll exchanges through: the leader's hub when this node has it, else
        the round's store; None while the leader's address is still unknown (for up to the
        staleness limit after the round began)."""
        if not self.hub:
            return self._switch(current.store)
        if current.group_rank == 0:
            return self._switch(self._served_hub(generation, current) or current.store)
        if current.hub is not None:
            return self._switch(current.store if current.hub.busy else current.hub)
        now = self.clock()
        if now < current.hub_retry_at:
            return self._switch(current.store)
        if current.hub_address is None:
            try:
                if self._current(generation) and current.store.check([HUB_KEY]):
                    current.hub_address = current.store.multi_get([HUB_KEY])[0].decode()
            except Exception as e:
                self._warn_once("reading the leader's hub address failed", e)
            if current.hub_address is None:
                waited = now - current.started > self.stale_after_s
                return self._switch(current.store) if waited else None
        if not current.hub_address:
            return self._switch(current.store)  # the leader serves no hub this round
        hub = connect(current.hub_address, self.hub_timeout_s)
        with self._lock:
            if not self._current(generation):  # detached meanwhile: nobody would close it
                hub.close()
                return None
            current.hub = hub
        logger.info("diagnostics exchange through the leader's hub at %s", current.hub_address)
        return self._switch(hub)

    def _served_hub(self, generation: int, current: _Round) -> Hub | None:
        """The leader's hub, served once per round; its address (empty when it cannot serve
        one) is written to the round's store until that succeeds."""
        if current.hub_address is None:
            try:
                # The host name is looked up here, on the exchange's thread: a DNS lookup can
                # take seconds, and only the leader needs it.
                current.hub, current.hub_address = serve(current.hub_host or socket.getfqdn())
            except Exception as e:
                self._warn_once("serving the diagnostics hub failed; the exchange goes through "
                                "the round's store", e)
                current.hub_address = ""
        if not current.hub_written and self._current(generation):
            try:
                current.store.set(HUB_KEY, current.hub_address.encode())
                current.hub_written = True
            except Exception as e:
                self._warn_once("writing the diagnostics hub's address failed", e)
        return current.hub

    def _switch(self, store: Any) -> Any:
        """``store``, forgetting what the last poll learnt of another store's keys."""
        if store is not self._via:
            self._via = store
            self._present, self._payloads, self._digest_present = set(), {}, False
        return store

    def _failed(self, current: _Round, what: str, error: BaseException) -> None:
        """A store call failed. A busy hub is kept (the next polls use the round's store until
        it answers); a failed one is given up until :attr:`hub_retry_s` from now, when the
        address is read again (a leader attached again serves a new hub)."""
        self._warn_once(what, error)
        if isinstance(error, HubUnavailable) and not isinstance(error, HubBusy) \
                and current.group_rank != 0:
            hub, current.hub, current.hub_address = current.hub, None, None
            current.hub_retry_at = self.clock() + self.hub_retry_s
            if hub is not None:
                hub.close()

    # -- every node but the gatherer: the digest --------------------------------------------------

    def _read_digest(self, generation: int, current: _Round, store: Any) -> None:
        """Reads the digest (one store call once it exists); takes the leader's place when it
        has been stale for ``group rank`` x the staleness limit, hands it back when a lower
        group rank publishes again."""
        payload = None
        if self._current(generation):
            try:
                if self._digest_present or store.check([job_digest.DIGEST_KEY]):
                    self._digest_present = True
                    payload = store.multi_get([job_digest.DIGEST_KEY])[0]
            except Exception as e:
                self._failed(current, "reading the job digest failed", e)
        now = self.clock()
        with self._lock:
            if not self._current(generation):
                return
            if payload is not None:
                try:
                    digest = job_digest.decode_digest(payload)
                except ValueError as e:
                    self._warn_once("the job digest is unreadable", e)
                else:
                    previous = self._digest
                    self._names[digest.publisher] = digest.publisher_node
                    self._names.update((n.group_rank, n.node) for n in digest.nodes)
                    if previous is None or previous[0].token != digest.token:
                        if self._acting and digest.publisher < current.group_rank:
                            logger.info("diagnostics digest: group rank %d publishes again; "
                                        "group rank %d stops gathering", digest.publisher,
                                        current.group_rank)
                            self._acting = False
                        if not (self._acting and digest.publisher == current.group_rank):
                            self._digest = (digest, now)
            changed = self._digest[1] if self._digest is not None else current.started
            if not self._acting and now - changed > current.group_rank * self.stale_after_s:
                logger.warning("diagnostics digest unchanged for %.1f s: group rank %d gathers "
                               "the nodes' summaries in the leader's place", now - changed,
                               current.group_rank)
                self._acting = True

    # -- the gatherer (the leader, or a successor standing in) ------------------------------------

    def _gather(self, generation: int, current: _Round, store: Any) -> None:
        """Reads every node's summary (its own included) and publishes the job digest."""
        payloads = self._fetch_summaries(generation, current, store)
        now = self.clock()
        with self._lock:
            if not self._current(generation):
                return
            for group_rank, payload in payloads.items():
                if self._payloads.get(group_rank) == payload:
                    continue  # not republished since the last poll: nothing to decode
                self._payloads[group_rank] = payload
                try:
                    summary = decode_summary(payload)
                except ValueError as e:
                    self._warn_once(f"summary of group rank {group_rank} unreadable", e)
                    continue
                previous = self._remote.get(group_rank)
                if previous is None or previous[0].seq != summary.seq:
                    self._remote[group_rank] = (summary, now)
            nodes = []
            for group_rank in range(current.group_world_size):
                entry = self._remote.get(group_rank)
                if entry is None:  # named when a digest named it (a successor, the hub gone)
                    name = self._names.get(group_rank, "")
                    nodes.append(RemoteNode(group_rank, None, now - current.started, False,
                                            name=name, published=True if name else None))
                else:
                    age = now - entry[1]
                    nodes.append(RemoteNode(group_rank, entry[0], age, age <= self.stale_after_s))
            self._digest_seq += 1
            digest = job_digest.build_digest(nodes, current.group_rank, self._digest_seq,
                                             self.digest_limits, current.node_id)
            self._digest = (digest, now)
        try:
            if self._current(generation):
                store.set(job_digest.DIGEST_KEY, job_digest.encode_digest(digest))
        except Exception as e:
            self._failed(current, "publishing the job digest failed", e)

    def _fetch_summaries(self, generation: int, current: _Round, store: Any
                         ) -> dict[int, bytes]:
        """Every node's published summary, by group rank.

        ``get`` waits for a key not written yet, so a key is checked until it exists; keys of a
        round's store are never removed, so from then on one ``multi_get`` reads them all (on
        etcd one transaction per 128 keys).
        """
        for group_rank in range(current.group_world_size):
            if group_rank in self._present or not self._current(generation):
                continue
            try:
                if store.check([summary_key(group_rank)]):
                    self._present.add(group_rank)
            except Exception as e:
                self._failed(current, f"checking the summary of group rank {group_rank} failed",
                             e)
                return {}
        present = sorted(self._present)
        if not present or not self._current(generation):
            return {}
        try:
            values = store.multi_get([summary_key(g) for g in present])
        except Exception as e:
            self._failed(current, "reading the nodes' summaries failed", e)
            return {}
        return dict(zip(present, values, strict=True))


def _close_hub(current: _Round | None) -> None:
    """Gives up a round's hub: a connection is closed, a served hub stops once no call holds
    it."""
    if current is not None and current.hub is not None:
        hub, current.hub = current.hub, None
        hub.close()
