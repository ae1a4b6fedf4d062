"""News of an ended generation across the nodes of a job: a failure known on one node is known
on every node at once, and the nodes agree on the next generation with no new rendezvous round.

**Why not the rendezvous.** Another node's failure used to reach an agent only through its own
workers (a collective that raises: never, when the dead peer's connections stay open, as a dead
NCCL peer looks from another node) or through the next rendezvous round, which the failed node
joined only after restarting all of its workers. The job's shared store reaches every agent in
milliseconds.

**Ended.** The agent that first knows of a failure (its worker exited, a hang verdict, its
workers' own communication errors) writes the **ended** record of the round's current recovery
(:class:`Ended`: its node, the cause, when) in the job's shared store: the rendezvous round's
store, kept in etcd by the etcd-v3 backend. It is written once (compare-and-set): the first
writer's record is the one every node reads. Every agent of the round watches that key from a
thread blocked on the store (an etcd watch); an agent that sees another node's record writes its
own node's interrupt notice at once, so its workers' monitors end their process groups whether
or not a collective of theirs would ever raise. Every agent records when it heard and from whom
(a ``failure_heard`` event: the node that wrote the record is its ``source``).

**Next.** The agents then agree on the next generation, over the same world with every rank
kept. Each agent, once its workers are interrupted, counts itself in (one counter per recovery).
The first agent that sees every node of the round counted starts the next generation's store (a
TCPStore of its own, on a fresh port) and publishes its address (**next**, compare-and-set
again: exactly one host wins). Every agent writes that address as its node's next generation
(``generation.json``), and the node whose worker died starts only that worker's replacement
there. A node whose agent died with it never counts itself in: an agent that has waited
:data:`PROBE_AFTER_S` probes the other agents' control endpoints (each agent listens on one and
writes it in the round's store; a refused connection is evidence that the agent is gone,
:mod:`elasticft.rendezvous.liveness`), and with such evidence, or when
:data:`COUNT_IN_LIMIT_S` has passed without it, the **next** record says ``round`` instead
(:func:`next_move`): every agent joins the next rendezvous round as before (a standby takes the
lost node's place; the survivors keep their processes).

**The keys** are named by the round and the recovery's index in it (:data:`ENDED_KEY`): every
node of a round starts at index 0 and counts the same recoveries, so the keys agree even where
the nodes' own generation numbers do not (a standby that joined in a later round).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

from elasticft.addon.api import run_ending_errors
from elasticft.events import EventLog
from elasticft.rendezvous import liveness
from elasticft.rendezvous.roundstore import (
    INTERRUPTIBLE_WAKE_S,
    WATCH_WAKE_S,
    interrupter,
    own_connection,
    text,
)

logger = logging.getLogger(__name__)

ENDED_KEY = "elasticft/inprocess/{}/{}/ended"
"""Round, index → the :class:`Ended` record (JSON), written once."""
COUNT_KEY = "elasticft/inprocess/{}/{}/in"
"""Round, index → how many agents have interrupted their workers (a counter)."""
NEXT_KEY = "elasticft/inprocess/{}/{}/next"
"""Round, index → the :class:`NextGeneration` record (JSON), written once."""
ENDPOINT_KEY = "elasticft/inprocess/{}/endpoint/{}"
"""Round, group rank → that node's agent's control endpoint (``host:port``)."""

COUNT_IN_LIMIT_S = 5.0
"""How long the agents wait for every node to count itself in before they take the next
rendezvous round instead, with no evidence that a node is gone (a probe that got no answer: a
machine down, a network cut): a live agent counts itself in within a monitor tick of hearing."""
PROBE_AFTER_S = 0.3
"""An agent that has waited this long for the others probes their control endpoints (then at
most every :data:`~elasticft.rendezvous.liveness.PROBE_EVERY_S`)."""
POLL_S = 0.05
"""How often an agent that waits for the others reads the count and the next record."""


@dataclasses.dataclass(frozen=True)
class Ended:
    """The record that ends the round's current generation on every node."""

    index: int
    node: str
    """The node whose agent knew first (the ``source`` of every other node's hearing)."""
    cause: str
    time: float
    """Wall clock when that agent wrote it."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: Any) -> Ended:
        record = json.loads(text(raw))
        return cls(int(record["index"]), str(record["node"]), str(record["cause"]),
                   float(record["time"]))


@dataclasses.dataclass(frozen=True)
class NextGeneration:
    """What the nodes agreed on: the next generation's store, or the next rendezvous round."""

    round: bool
    reason: str
    host: str = ""
    """The node whose agent hosts the store."""
    master_addr: str = ""
    master_port: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: Any) -> NextGeneration:
        record = json.loads(text(raw))
        return cls(bool(record["round"]), str(record.get("reason", "")),
                   str(record.get("host", "")), str(record.get("master_addr", "")),
                   int(record.get("master_port", 0)))


@dataclasses.dataclass(frozen=True)
class Move:
    """What an agent waiting for the next generation does now (:func:`next_move`)."""

    kind: Literal["wait", "host", "round"]
    reason: str


def next_move(*, counted: int, nodes: int, waited_s: float, limit_s: float,
              gone: tuple[str, ...] = ()) -> Move:
    """What an agent does while no next record exists (pure): ``counted`` of the round's
    ``nodes`` agents have interrupted their workers, ``waited_s`` since this one counted
    itself in; ``gone``: why agents that have not are gone (their probes' verdicts).

    Every node in: host the next generation's store (the first to publish it wins). A node
    gone on evidence, or past the limit with a node missing: the next rendezvous round, where
    the lost node is replaced."""
    if counted >= nodes:
        return Move("host", f"all {nodes} nodes interrupted their workers")
    if gone:
        return Move("round", f"{counted} of {nodes} nodes interrupted their workers and "
                             f"{'; '.join(gone)}: the next rendezvous round replaces it")
    if waited_s >= limit_s:
        return Move("round", f"{counted} of {nodes} nodes interrupted their workers within "
                             f"{limit_s:.0f} s: a node is lost, the next rendezvous round "
                             f"replaces it")
    return Move("wait", f"{counted} of {nodes} nodes in")


class FailureNews:
    """One agent's side of the news: it publishes an ended generation, hears the others', and
    agrees on the next one (the steps in this module's docstring)."""

    def __init__(self, events: EventLog, node_id: str, heard: Callable[[Ended], None],
                 count_in_limit_s: float = COUNT_IN_LIMIT_S) -> None:
        self.events = events
        self.node_id = node_id
        self._heard = heard
        """Called (from the watcher thread) when another node ended the generation: the agent
        writes its interrupt notice."""
        self.count_in_limit_s = count_in_limit_s
        self._lock = threading.Lock()
        self._store: Any = None
        self._round = -1
        self._nodes = 1
        self._index = 0
        self._known: dict[int, tuple[Ended, float]] = {}
        """Index → the ended record this node knows and when it learned it (wall clock)."""
        self._acted = -1
        """The newest index this agent has acted on (its recovery began)."""
        self._stop = threading.Event()
        self._watcher: tuple[threading.Thread, Any] | None = None
        self._endpoint: liveness.ControlEndpoint | None = None
        """This agent's control endpoint, which the others probe while they wait for it."""
        self._group_rank = 0

    @property
    def available(self) -> bool:
        """Whether the round has a shared store and more than one node."""
        return self._store is not None and self._nodes > 1

    @property
    def index(self) -> int:
        return self._index

    def on_rendezvous(self, store: Any, round_: int, nodes: int, group_rank: int, addr: str
                      ) -> None:
        """A new round: its recoveries count from 0, its ended keys are watched, and this
        agent's control endpoint (on ``addr``) is written for the others to probe."""
        self._stop_watcher()
        with self._lock:
            self._store, self._round, self._nodes = store, round_, nodes
            self._index, self._known, self._acted = 0, {}, -1
            self._group_rank = group_rank
        if store is None or nodes <= 1:
            return
        if self._endpoint is None:
            self._endpoint = liveness.ControlEndpoint(addr)
        try:
            store.set(ENDPOINT_KEY.format(round_, group_rank), self._endpoint.endpoint)
        except run_ending_errors():
            raise
        except Exception as e:  # no probe of this node: the others wait for the limit
            logger.warning("could not write this agent's control endpoint: %s", e)
        self._stop = threading.Event()
        watch_store = own_connection(store)
        interrupt = interrupter(watch_store)
        wake_s = INTERRUPTIBLE_WAKE_S if interrupt is not None else WATCH_WAKE_S
        thread = threading.Thread(target=self._watch, args=(watch_store, round_, self._stop,
                                                            wake_s),
                                  daemon=True, name="elasticft-failure-news")
        self._watcher = (thread, interrupt)
        thread.start()

    def close(self) -> None:
        """Stops the watcher and waits for it to leave its store call (a thread must not be in
        one when the interpreter exits: :data:`~elasticft.rendezvous.roundstore.WATCH_WAKE_S`)."""
        thread = self._stop_watcher()
        if thread is not None:
            thread.join(WATCH_WAKE_S + 1.0)
        if self._endpoint is not None:
            self._endpoint.close()

    def _stop_watcher(self) -> threading.Thread | None:
        self._stop.set()
        if self._watcher is None:
            return None
        thread, interrupt = self._watcher
        if interrupt is not None:
            interrupt(thread)
        self._watcher = None
        return thread

    # -- hearing ------------------------------------------------------------------------------

    def heard(self) -> tuple[Ended, float] | None:
        """Another node's ended record of the current recovery that this agent has not acted
        on yet, and when it was heard (None: none)."""
        with self._lock:
            known = self._known.get(self._index)
            if known is None or self._acted >= self._index or known[0].node == self.node_id:
                return None
            return known

    def _learn(self, record: Ended, at: float) -> bool:
        """Records ``record`` as this node's news of its index; True when it is new (and is
        then written to the event log)."""
        with self._lock:
            if record.index in self._known:
                return False
            self._known[record.index] = (record, at)
        self.events.emit("failure_heard", node=self.node_id, source=record.node,
                         index=record.index, round=self._round, cause=record.cause,
                         published=record.time, heard=at,
                         after_s=round(max(at - record.time, 0.0), 4))
        if record.node != self.node_id:
            logger.warning("node %s ended the generation %.3f s ago (%s): interrupting this "
                           "node's workers", record.node, at - record.time, record.cause)
        return True

    def _watch(self, store: Any, round_: int, stop: threading.Event, wake_s: float) -> None:
        """Waits for the ended record of the round's current recovery; another node's is told
        to the agent (:attr:`_heard`) at once."""
        while not stop.is_set():
            index = self._index
            key = ENDED_KEY.format(round_, index)
            started = time.monotonic()
            try:
                store.wait([key], timedelta(seconds=wake_s))
                record = Ended.from_json(store.get(key))
            except Exception:
                if time.monotonic() - started < WATCH_WAKE_S / 2:
                    stop.wait(WATCH_WAKE_S)  # the store is unreachable: do not spin
                continue
            if stop.is_set():
                return
            if self._learn(record, time.time()) and record.node != self.node_id:
                try:
                    self._heard(record)
                except Exception:
                    logger.exception("could not interrupt this node's workers")
            while not stop.is_set() and self._index == index:  # until that recovery is over
                stop.wait(POLL_S)

    # -- the agent's recovery ----------------------------------------------------------------

    def publish_ended(self, cause: str) -> Ended:
        """Ends the round's current generation on every node (unless another node's agent
        already did: its record stands); returns the record that counts."""
        index = self._index
        mine = Ended(index, self.node_id, cause, time.time())
        with self._lock:
            self._acted = index
        winner = Ended.from_json(self._store.compare_set(
            ENDED_KEY.format(self._round, index), "", mine.to_json()))
        self._learn(winner, time.time() if winner != mine else mine.time)
        return winner

    def agree(self, host: Callable[[], tuple[str, int]]) -> NextGeneration:
        """Counts this agent in and waits (at most about :attr:`count_in_limit_s`) for the next
        generation: the first agent to see every node in hosts it (``host`` starts a store:
        its address and port). Blocking; every agent of the round calls it."""
        index, round_, store = self._index, self._round, self._store
        next_key, count_key = NEXT_KEY.format(round_, index), COUNT_KEY.format(round_, index)
        store.add(count_key, 1)
        started = time.monotonic()
        probed_at, gone = -liveness.PROBE_EVERY_S, ()
        while True:
            now = time.monotonic()
            waited = now - started
            try:
                if store.check([next_key]):
                    return NextGeneration.from_json(store.get(next_key))
                counted = store.add(count_key, 0)
                if (counted < self._nodes and waited >= PROBE_AFTER_S
                        and now - probed_at >= liveness.PROBE_EVERY_S):
                    probed_at, gone = now, self._gone()
                move = next_move(counted=counted, nodes=self._nodes, waited_s=waited,
                                 limit_s=self.count_in_limit_s, gone=gone)
            except run_ending_errors():
                raise
            except Exception as e:  # the store itself: the rendezvous judges
                if waited < 2 * self.count_in_limit_s:
                    time.sleep(POLL_S)
                    continue
                return NextGeneration(True, f"the shared store failed: {e}")
            if move.kind == "wait":
                time.sleep(POLL_S)
                continue
            if move.kind == "host":
                addr, port = host()
                proposal = NextGeneration(False, move.reason, self.node_id, addr, port)
            else:
                proposal = NextGeneration(True, move.reason)
            return NextGeneration.from_json(store.compare_set(next_key, "",
                                                              proposal.to_json()))

    def _gone(self) -> tuple[str, ...]:
        """Probes the other agents of the round; why each that is gone on evidence is."""
        found = []
        for rank in range(self._nodes):
            key = ENDPOINT_KEY.format(self._round, rank)
            if rank == self._group_rank or not self._store.check([key]):
                continue
            verdict = liveness.judge(liveness.gather(f"rank {rank}",
                                                     text(self._store.get(key))))
            if verdict.kind is liveness.Liveness.DEAD:
                found.append(verdict.reason)
        return tuple(found)

    def done(self) -> None:
        """The recovery of the current index has its next generation: the next failure is
        the next index's."""
        with self._lock:
            self._acted = self._index
            self._index += 1
