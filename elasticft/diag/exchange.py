"""Cross-node exchange of diagnostic views, so that every agent judges every rank of the job.

A node's monitor reads only its own workers' progress rings. On a job of several nodes that is
not enough: the node whose workers only *wait* in a collective cannot see that the rank they wait
for is stopped on another node, and a slow rank can only be compared with the few peers of its
own node (with one worker per node, with none). So each agent publishes a compact JSON summary of
its ranks into the rendezvous round's store (the store every agent of the round shares), and
reads the other nodes' summaries back:

* per rank: node, pid, process state, heartbeat age, steps, the oldest call in flight per
  communicator (op, communicator key, its number there, age), the newest call number per
  communicator, and the median busy time per step;
* the communicator key is the same number on every member of a group (the recorder hashes the
  group's name and ranks, the NCCL shim the unique id), so positions compare across nodes.

A background thread does all store traffic: it publishes the newest summary the monitor offered
about once per :attr:`ViewExchange.interval_s` (at once when a rank of this node is newly seen
stopped, so the waiting nodes learn it before their own hang timeout), and polls the other
nodes' keys with ``check`` before ``get`` so that nothing ever waits on a missing key. The
monitor's ``check`` only hands over an object and reads a snapshot: it never touches the store.

Freshness is judged without comparing clocks of different machines: a summary carries a counter
its publisher increments, and the reader notes on its own monotonic clock when the counter last
changed. A node whose summary has not changed for :attr:`ViewExchange.stale_after_s` is *silent*:
its ranks are not judged on old facts, and the silence is reported as evidence itself (its agent
or host may be gone). Ages inside a summary are as the publisher measured them; each remote
:class:`~elasticft.diag.detectors.RankView` carries ``view_age_s``, how long ago that was.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from elasticft.diag.detectors import InFlight, RankView
from elasticft.procs import STOPPED_STATES

logger = logging.getLogger(__name__)

SCHEMA = 1
KEY_PREFIX = "elasticft.diag.summary."
"""Store key of a node's summary: this prefix and the node's group rank."""


def summary_key(group_rank: int) -> str:
    return f"{KEY_PREFIX}{group_rank}"


@dataclasses.dataclass(frozen=True)
class NodeSummary:
    """What one node's monitor published about its ranks."""

    node: str
    group_rank: int
    seq: int
    """Incremented by the publisher at every publication (freshness without clocks)."""
    views: tuple[RankView, ...]
    busy: Mapping[int, float]
    """Rank -> median busy seconds per recent step (ranks with enough steps only)."""


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def encode_summary(node: str, group_rank: int, seq: int, views: Iterable[RankView],
                   busy: Mapping[int, float]) -> bytes:
    """The JSON a node publishes (a few hundred bytes per rank)."""
    ranks = []
    for v in views:
        ranks.append({
            "rank": v.rank,
            "pid": v.pid,
            "state": v.process_state,
            "hb": _round(v.heartbeat_age_s),
            "steps": v.steps,
            "step_age": _round(v.step_age_s),
            "in_flight": [[c.op, f"{c.comm:x}", c.comm_seq, round(c.age_s, 3), c.source]
                          for c in v.in_flight],
            "comm_seqs": {f"{comm:x}": n for comm, n in v.comm_seqs.items()},
            "busy": _round(busy.get(v.rank), 6),
        })
    return json.dumps({"v": SCHEMA, "node": node, "group_rank": group_rank, "seq": seq,
                       "ranks": ranks}, separators=(",", ":")).encode()


def decode_summary(data: bytes | str) -> NodeSummary:
    """Parses a published summary; raises ValueError on anything malformed."""
    try:
        doc = json.loads(data)
        if doc.get("v") != SCHEMA:
            raise ValueError(f"summary schema {doc.get('v')!r}, expected {SCHEMA}")
        node = str(doc["node"])
        views, busy = [], {}
        for r in doc["ranks"]:
            rank = int(r["rank"])
            views.append(RankView(
                rank=rank, node=node, pid=r.get("pid"), process_state=r.get("state"),
                heartbeat_age_s=r.get("hb"), steps=int(r.get("steps", 0)),
                step_age_s=float(r.get("step_age") or 0.0),
                in_flight=tuple(InFlight(str(op), int(comm, 16), int(n), float(age), str(src))
                                for op, comm, n, age, src in r.get("in_flight", ())),
                comm_seqs={int(c, 16): int(n) for c, n in r.get("comm_seqs", {}).items()}))
            if r.get("busy") is not None:
                busy[rank] = float(r["busy"])
        return NodeSummary(node, int(doc["group_rank"]), int(doc["seq"]), tuple(views), busy)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed diagnostics summary: {e}") from e


@dataclasses.dataclass(frozen=True)
class RemoteNode:
    """Another node of the round, as this node last read it."""

    group_rank: int
    summary: NodeSummary | None
    """None: nothing read from it yet in this round."""
    age_s: float
    """Seconds since its summary last changed (or since this round began, if none yet)."""
    fresh: bool

    @property
    def node(self) -> str:
        return self.summary.node if self.summary is not None else f"group rank {self.group_rank}"


@dataclasses.dataclass(frozen=True)
class JobView:
    """The other nodes' fresh ranks, and the silent nodes, at one instant."""

    views: tuple[RankView, ...] = ()
    busy: Mapping[int, float] = dataclasses.field(default_factory=dict)
    node_of: Mapping[int, str] = dataclasses.field(default_factory=dict)
    silent: tuple[RemoteNode, ...] = ()
    """Nodes of the round whose summary is missing or older than the staleness limit."""

    def silent_json(self) -> list[dict[str, Any]]:
        return [{"node": n.node, "group_rank": n.group_rank, "silent_s": round(n.age_s, 1),
                 "published": n.summary is not None} for n in self.silent]


@dataclasses.dataclass
class _Round:
    store: Any
    node_id: str
    group_rank: int
    group_world_size: int
    started: float


class ViewExchange:
    """Publishes this node's summary and reads the others' through the round's store."""

    def __init__(
        self,
        *,
        interval_s: float = 1.0,
        poll_s: float = 0.5,
        stale_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.poll_s = poll_s
        self.stale_after_s = stale_after_s if stale_after_s is not None else max(
            3.0, 3 * interval_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._round: _Round | None = None
        self._generation = 0
        self._offer: tuple[tuple[RankView, ...], dict[int, float]] | None = None
        self._offer_alarm: frozenset[int] = frozenset()
        self._published_alarm: frozenset[int] = frozenset()
        self._seq = 0
        self._remote: dict[int, tuple[NodeSummary, float]] = {}
        self._threads: list[threading.Thread] = []
        self._warned: set[str] = set()

    @property
    def active(self) -> bool:
        current = self._round
        return current is not None and current.group_world_size > 1

    def attach(self, store: Any, node_id: str, group_rank: int, group_world_size: int) -> None:
        """A new round: forget the old round's views and exchange through ``store``.

        Every round gets its own thread; a thread still blocked in the old round's store (its
        host gone) exits when it returns, instead of delaying the new round.
        """
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._round = _Round(store, node_id, group_rank, group_world_size, self._clock())
            self._remote = {}
            self._offer = None
            self._offer_alarm = self._published_alarm = frozenset()
        if store is None or group_world_size <= 1:
            return
        thread = threading.Thread(target=self._run, args=(generation,), daemon=True,
                                  name=f"elasticft-diag-exchange-{generation}")
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def offer(self, views: Sequence[RankView], busy: Mapping[int, float]) -> None:
        """The monitor's newest view of this node (cheap: nothing is encoded or sent here)."""
        alarm = frozenset(v.rank for v in views if v.process_state in STOPPED_STATES)
        with self._lock:
            self._offer = (tuple(views), dict(busy))
            self._offer_alarm = alarm
            urgent = bool(alarm - self._published_alarm)
        if urgent:
            self._wake.set()

    def job_view(self) -> JobView:
        """The other nodes' fresh ranks (``view_age_s`` set) and the silent nodes."""
        current = self._round
        if current is None or current.group_world_size <= 1:
            return JobView()
        now = self._clock()
        with self._lock:
            remote = dict(self._remote)
        views: list[RankView] = []
        busy: dict[int, float] = {}
        node_of: dict[int, str] = {}
        silent: list[RemoteNode] = []
        for group_rank in range(current.group_world_size):
            if group_rank == current.group_rank:
                continue
            entry = remote.get(group_rank)
            if entry is None:
                silent.append(RemoteNode(group_rank, None, now - current.started, False))
                continue
            summary, changed = entry
            age = now - changed
            if age > self.stale_after_s:
                silent.append(RemoteNode(group_rank, summary, age, False))
                continue
            for view in summary.views:
                views.append(dataclasses.replace(view, view_age_s=round(age, 3)))
                node_of[view.rank] = summary.node
            busy.update(summary.busy)
        return JobView(tuple(views), busy, node_of, tuple(silent))

    def detach(self, timeout_s: float = 3.0) -> None:
        """Stops using the round's store (the workers stopped) and waits for the thread.

        The store must not be touched once the agent is done with it: the launcher then closes
        the rendezvous, and an etcd client used after its close connects again, leaving a
        channel open that aborts the interpreter at exit. So the thread checks the round before
        every store call, and the agent waits here up to ``timeout_s`` for a call in flight.
        """
        with self._lock:
            self._generation += 1
            self._round = None
        self._wake.set()
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

    def _run(self, generation: int) -> None:
        next_publish = 0.0
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            with self._lock:
                if generation != self._generation or self._round is None:
                    return
                current = self._round
                offer, alarm = self._offer, self._offer_alarm
                now = self._clock()
                due = offer is not None and (now >= next_publish or
                                             bool(alarm - self._published_alarm))
                if due:
                    self._offer = None
                    self._seq += 1
                    self._published_alarm = alarm
                    seq = self._seq
            if due and offer is not None:
                next_publish = now + self.interval_s
                payload = encode_summary(current.node_id, current.group_rank, seq, *offer)
                if generation != self._generation:
                    return
                try:
                    current.store.set(summary_key(current.group_rank), payload)
                except Exception as e:
                    self._warn_once("publishing this node's summary failed", e)
            self._read_others(generation, current)

    def _read_others(self, generation: int, current: _Round) -> None:
        payloads = self._fetch_others(generation, current)
        now = self._clock()
        for group_rank, payload in payloads.items():
            try:
                summary = decode_summary(payload)
            except ValueError as e:
                self._warn_once(f"summary of group rank {group_rank} unreadable", e)
                continue
            with self._lock:
                if generation != self._generation:
                    return
                previous = self._remote.get(group_rank)
                if previous is None or previous[0].seq != summary.seq:
                    self._remote[group_rank] = (summary, now)

    def _fetch_others(self, generation: int, current: _Round) -> dict[int, bytes]:
        """The other nodes' published summaries, by group rank.

        ``get`` waits for a key not written yet, so keys are checked first. Once every node has
        published (the steady state), one check and one ``multi_get`` fetch them all: on etcd
        two requests per poll, whatever the number of nodes (:class:`EtcdStore` batches them).
        """
        keys = {group_rank: summary_key(group_rank)
                for group_rank in range(current.group_world_size)
                if group_rank != current.group_rank}
        if generation != self._generation or not keys:
            return {}
        try:
            if current.store.check(list(keys.values())):
                return dict(zip(keys, current.store.multi_get(list(keys.values())),
                                strict=True))
        except Exception as e:
            self._warn_once("reading the other nodes' summaries at once failed", e)
        payloads = {}
        for group_rank, key in keys.items():
            if generation != self._generation:
                return payloads
            try:
                if current.store.check([key]):
                    payloads[group_rank] = current.store.get(key)
            except Exception as e:
                self._warn_once(f"reading the summary of group rank {group_rank} failed", e)
        return payloads
