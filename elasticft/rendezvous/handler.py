"""The ``etcd-v3`` rendezvous handler: torch's rendezvous interface over per-node etcd keys,
plus the membership features fault tolerance needs.

A *round* is the set of nodes that train together until the next one. Each node joins a round
by writing its own key, one coordinator closes it by writing the participant list once, and
everyone else polls a few small keys about once a second: a round costs O(1) etcd requests per
node (:mod:`elasticft.rendezvous.protocol` has the decisions, :mod:`elasticft.rendezvous.rounds`
the requests; docs/rendezvous.md the protocol, docs/scale.md what it costs at 1,024 nodes).
torch's own dynamic rendezvous keeps all of this in one blob that every node rewrites by
compare-and-set, O(N²) writes a round.

Around each ``next_rendezvous``:

1. **etcd reachable?** (the waits before a join: :mod:`elasticft.rendezvous.admission`)
   Probed until the join deadline (``connect_timeout``); if not, one
   :class:`RendezvousConnectionError` line naming the endpoints.
2. **Blacklist.** A node whose ``node_id`` has a verdict is refused with
   :class:`NodeBlacklistedError`, whose message carries the reason.
3. **Health check** (torch is already imported by then): a failing node is refused with
   :class:`NodeUnhealthyError`. A node that passes and finds the job full waits for the next
   round, a *warm standby* without join timeout, and is admitted after a loss.
4. **Membership records and the leader** (:mod:`elasticft.rendezvous.membership`): the agent
   with group rank 0 of the round is the leader; ask :meth:`is_leader` or :meth:`leader`.

An etcd outage while training runs costs nothing: :meth:`num_nodes_waiting` answers 0 (no one
can join through an unreachable store) instead of failing the agent's monitor loop, the lease
is kept or granted again when etcd is back, and a rendezvous that meets the outage retries until
its deadline.

Built from torchrun's rendezvous parameters by :func:`elasticft.rendezvous.factory.
create_handler`, registered for ``torchrun --rdzv-backend etcd-v3`` through the
``torchrun.handlers`` entry point (:mod:`elasticft.rendezvous.registration`); ``elasticft-run``
uses the same one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elasticft import torch_compat
from elasticft.rendezvous import liveness
from elasticft.rendezvous.admission import OUTAGE_LOG_EVERY_S, Admission
from elasticft.rendezvous.etcd import (
    EtcdConfigError,
    EtcdSettings,
    Keys,
    etcd_errors,
    lease_lost,
)
from elasticft.rendezvous.health import HealthCheck
from elasticft.rendezvous.identity import NodeClaim
from elasticft.rendezvous.liveness import PROBE_EVERY_S, ControlEndpoint
from elasticft.rendezvous.membership import (
    Blacklist,
    LeaderRecord,
    MemberRecord,
    MembershipPublisher,
    RoundRecord,
    dump_record,
    read_leader,
)
from elasticft.rendezvous.protocol import (
    MoveKind,
    RoundPoll,
    decide,
    restart_needed,
    round_may_close,
    waits_as_standby,
)
from elasticft.rendezvous.rounds import RoundStore
from elasticft.rendezvous.store import EtcdStore

logger = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"
DISABLE_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
COORDINATOR_POLL_S = 0.1
"""The coordinator of a round that may close polls this often (its decision is the latency)."""
WAITER_POLL_S = (1.0, 3.0)
"""Everyone else polls at a random interval in this range, and between two polls watches what
it waits for (the round's result; the coordinator: the previous round's keys), with a stream of
its own closed at the end of the interval (pyetcd's shared watcher would hold a stream per
waiting node whose Python thread wakes ten times a second): a poll and a watch every 2 s, about
one request a second, and the result is seen as soon as it is written."""
RUNNING_POLL_S = 2.0
"""``num_nodes_waiting`` asks etcd at most this often (the agent's monitor asks more often);
with the lease refresh every TTL/3 (5 s) the rendezvous costs a running node 0.7 etcd requests
a second."""


class NodeBlacklistedError(torch_compat.RendezvousError):
    """This node is on the blacklist; ``reason`` says why."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class NodeUnhealthyError(torch_compat.RendezvousError):
    """This node failed its pre-join health check."""


@dataclasses.dataclass(frozen=True)
class RoundView:
    """This node's view of the round it last joined."""

    round: int
    group_rank: int
    group_world_size: int

    @property
    def is_leader(self) -> bool:
        return self.group_rank == 0


@dataclasses.dataclass
class EtcdParts:
    """What one handler holds in etcd, besides its rounds: the client, this node's name and
    claim, the blacklist and the publisher of its member records (set once by
    :func:`create_handler`)."""

    client: Any
    settings: EtcdSettings
    keys: Keys
    node_id: str
    host: str
    """The machine's name: an operator's blacklist entry for it refuses every agent on it."""
    claim: NodeClaim | None
    """Holds ``node_id`` against other live agents of the job on this host."""
    blacklist: Blacklist
    publisher: MembershipPublisher
    health_check: HealthCheck
    connect_timeout_s: float


class EtcdRendezvousHandler(torch_compat.RendezvousHandler):
    """torch's ``RendezvousHandler`` over etcd v3: rounds, blacklist, standbys and a leader."""

    def __init__(
        self,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        addr: str,
        timeout: torch_compat.RendezvousTimeout,
        store: EtcdStore,
        parts: EtcdParts,
        rejoin_timeout: timedelta = timedelta(seconds=60),
    ) -> None:
        if min_nodes < 1 or max_nodes < min_nodes:
            raise EtcdConfigError(
                f"--nnodes {min_nodes}:{max_nodes} is not a valid range; give MIN:MAX with "
                "1 <= MIN <= MAX")
        self._run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.addr = addr
        self.timeout = timeout
        self.rejoin_timeout = rejoin_timeout
        self._store = store
        self._parts = parts
        self._rounds = RoundStore(parts.client, parts.keys, parts.settings, parts.node_id)
        self._admission = Admission(self._rounds, parts.blacklist, parts.node_id, parts.host,
                                    parts.settings.endpoint_text, parts.publisher.ttl_s, addr,
                                    run_id)
        self._round = -1
        self._round_size = 0
        self._joined_round: int | None = None
        self._round_view: RoundView | None = None
        self._last_outage_log = 0.0
        self._waiting_lock = threading.Lock()
        self._waiting_checked = -math.inf
        self._waiting_answer = 0
        self._shared_tcp_store: Any = None
        self._bootstrap: Any = None
        self._left = False
        self._control: ControlEndpoint | None = None
        self._event_sink: Callable[..., None] | None = None

    # -- what other subsystems ask ------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self._parts.node_id

    @property
    def keys(self) -> Keys:
        return self._parts.keys

    @property
    def blacklist(self) -> Blacklist:
        """Mark a node bad with ``handler.blacklist.add(node_id, reason, added_by)``."""
        return self._parts.blacklist

    @property
    def round(self) -> int:
        """The round this node last completed as a participant (-1 before its first)."""
        return self._round

    def set_event_sink(self, emit: Callable[..., None]) -> None:
        """``emit(kind, **payload)`` records membership decisions (the agent's event log)."""
        self._event_sink = emit

    def is_leader(self) -> bool:
        """Whether this agent leads the round it last joined (group rank 0)."""
        return self._round_view is not None and self._round_view.is_leader

    def leader(self) -> LeaderRecord | None:
        """The leader of the latest round as published in etcd (None while it is re-elected)."""
        m = self._parts
        return read_leader(m.client, m.keys, m.settings)

    # -- torch's handler interface ----------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def use_agent_store(self) -> bool:
        return os.getenv(DISABLE_SHARED_STORE_ENV, "0") != "1"

    def next_rendezvous(self) -> torch_compat.RendezvousInfo:
        m = self._parts
        started = time.monotonic()
        join_deadline = started + self.timeout.join.total_seconds()
        if self._control is None:
            self._control = ControlEndpoint(self.addr)
        probe = self._admission.etcd(min(join_deadline, time.monotonic() + m.connect_timeout_s))
        probe = self._admission.duplicate(probe, join_deadline)
        last_round = probe.last_round
        entry = Blacklist.parse(probe.blacklisted)
        if entry is not None:
            raise NodeBlacklistedError(
                f"node {m.node_id!r} is blacklisted: {entry.reason} (added"
                f"{' by ' + entry.added_by if entry.added_by else ''}); after fixing it run "
                f"`elasticft blacklist remove {m.node_id} --rdzv-endpoint "
                f"{m.settings.endpoint_text}`",
                reason=entry.reason,
            )
        probe = self._admission.quarantine(probe, self._round, join_deadline)
        report = m.health_check()
        member = self._member_record("waiting", health_ok=report.ok,
                                     health_detail=report.detail)
        if not report.ok:
            m.publisher.publish(m.keys.member(m.node_id), member)
            raise NodeUnhealthyError(
                f"node {m.node_id!r} failed its health check: {report.detail}"
            )
        previous_round = self._round
        while True:
            try:
                round_, participants = self._join_and_wait(started, join_deadline, last_round,
                                                           dump_record(member))
                break
            except torch_compat.RendezvousConnectionError as e:
                if time.monotonic() >= join_deadline:
                    raise
                if lease_lost(e):
                    m.publisher.lease_lost()
                logger.warning("rendezvous interrupted by an etcd outage (%s); retrying", e)
                last_round = self._admission.etcd(join_deadline).last_round
                if self._joined_round is not None and self._joined_round > previous_round:
                    # Back to the round this node had joined: it may have closed, with this
                    # node in it, during the outage. Joining the round after it would leave
                    # this node waiting alone while the others train without it.
                    last_round = min(last_round, self._joined_round - 1)
        rank, world_size = participants.index(m.node_id), len(participants)
        self._round, self._round_size = round_, world_size
        with self._waiting_lock:
            self._waiting_checked, self._waiting_answer = time.monotonic(), 0
        store = dist.PrefixStore(self._parts.keys.round_store(round_), self._store)
        while True:
            try:
                info = torch_compat.RendezvousInfo(
                    store, rank, world_size, self._store_info(rank, store))
                break
            except torch_compat.RendezvousConnectionError as e:
                # The round is closed; only the workers' address is missing: retry just that.
                if time.monotonic() >= join_deadline:
                    raise
                logger.warning("reading round %d's worker address interrupted (%s); retrying",
                               round_, e)
                self._admission.etcd(join_deadline)
        logger.info("node %s joined round %d of rendezvous %s as rank %d of %d", m.node_id,
                    round_, self._run_id, rank, world_size)
        view = RoundView(round_, rank, world_size)
        self._round_view = view
        self._publish_round(view)
        return info

    def num_nodes_waiting(self) -> int:
        """Above 0 when this node's round should stop and rendezvous again; asks etcd at most
        every :data:`RUNNING_POLL_S` (the agent's monitor calls it far more often)."""
        with self._waiting_lock:
            now = time.monotonic()
            if self._round < 0 or now - self._waiting_checked < RUNNING_POLL_S:
                return self._waiting_answer
            self._waiting_checked = now
            try:
                view = self._rounds.running_view(self._round)
            except torch_compat.RendezvousConnectionError as e:
                # Nobody can join through an unreachable etcd; the workers keep training.
                if now - self._last_outage_log >= OUTAGE_LOG_EVERY_S:
                    self._last_outage_log = now
                    logger.warning("etcd unreachable, training goes on: %s", e)
                return 0
            self._waiting_answer = restart_needed(
                self._round, self._round_size, view.last_round, view.restart_requested,
                view.next_round_joined, self.max_nodes, view.round_remaining)
            return self._waiting_answer

    def is_closed(self) -> bool:
        return self._rounds.is_closed()

    def set_closed(self) -> None:
        self._rounds.set_closed()

    def shutdown(self) -> bool:
        """Closes the job (no more rounds: the run succeeded or failed for good) and leaves."""
        try:
            self.set_closed()
            closed = True
        except torch_compat.RendezvousConnectionError as e:
            logger.warning("could not close the rendezvous: %s", e)
            closed = False
        self.leave()
        return closed

    def leave(self) -> None:
        """This node leaves without closing the job: its lease is revoked, so its join key
        and records vanish now (the others see it gone) instead of after the lease TTL."""
        self._left = True
        self.close_membership()

    def close_membership(self) -> None:
        """Withdraws this node's records now (they would expire with its lease anyway)."""
        self._parts.publisher.close()
        if self._control is not None:
            self._control.close()

    # -- the round protocol -----------------------------------------------------------------

    def _join_and_wait(self, started: float, join_deadline: float, last_round: int,
                       member: bytes) -> tuple[int, tuple[str, ...]]:
        """Joins the round after ``last_round`` (writing the ``member`` record with it) and
        polls until this node is a participant of a closed round."""
        m = self._parts
        round_ = last_round + 1
        previous_size = self._join(round_, {m.keys.member(m.node_id): member})
        coordinating, quorum_since, standby = False, None, False
        announced, next_probe = -1, 0.0
        while True:
            if self._left:
                raise torch_compat.RendezvousClosedError(
                    f"node {m.node_id} left rendezvous {self._run_id}")
            lease = m.publisher.lease()
            view = self._rounds.poll(round_, lease, coordinating)
            now = time.monotonic()
            if (view.previous_restarted and view.previous_remaining
                    and previous_size is not None and now >= next_probe):
                # The previous round is over (a participant came back) and some of its
                # participants have not: dead ones end now, on evidence, instead of after
                # their lease's TTL (elasticft.rendezvous.liveness).
                next_probe = now + PROBE_EVERY_S
                liveness.end_dead_members(self._rounds, m.node_id, round_ - 1,
                                          self._event_sink)
            coordinating = view.coordinator == m.node_id
            quorum_since = (quorum_since or now) if view.joined >= self.min_nodes else None
            standby = waits_as_standby(previous_size, view.previous_restarted, self.max_nodes)
            decision = decide(RoundPoll(
                round=round_, node_id=m.node_id, min_nodes=self.min_nodes,
                max_nodes=self.max_nodes, job_closed=view.job_closed, result=view.result,
                last_round=view.last_round, joined_present=view.joined_present,
                coordinator=view.coordinator, joined=view.joined,
                previous_remaining=view.previous_remaining, previous_size=previous_size,
                may_close=round_may_close(round_, previous_size, view.previous_restarted,
                                          view.previous_remaining, self.max_nodes),
                quorum_for_s=None if quorum_since is None else now - quorum_since,
                last_call_s=self.timeout.last_call.total_seconds(),
                rejoin_s=self.rejoin_timeout.total_seconds(),
                waited_s=now - started, join_timeout_s=join_deadline - started, standby=standby,
            ))
            move = decision.kind
            if move is MoveKind.PARTICIPANT:
                assert view.result is not None
                return round_, view.result
            if move in (MoveKind.STANDBY, MoveKind.LATE):
                logger.info("%s; node %s waits for round %d%s", decision.reason, m.node_id,
                            max(round_, view.last_round) + 1,
                            " as a standby" if move is MoveKind.STANDBY else "")
                round_ = max(round_, view.last_round) + 1
                previous_size = self._join(round_)
                coordinating, quorum_since = False, None
                continue
            if move is MoveKind.REJOIN:
                previous_size = self._join(round_)
                continue
            if move is MoveKind.CLOSE:
                participants = self._rounds.close(round_, self.max_nodes)
                logger.info("node %s closed round %d: %s (%s)", m.node_id, round_,
                            decision.reason, "written" if participants else "already closed")
                continue
            if move is MoveKind.TIMEOUT:
                self._rounds.leave(round_)
                raise torch_compat.RendezvousTimeoutError(
                    f"rendezvous {self._run_id}: {decision.reason}")
            if move is MoveKind.CLOSED:
                self._rounds.leave(round_)
                if standby:
                    raise torch_compat.RendezvousGracefulExitError(
                        f"rendezvous {self._run_id} is closed; standby {m.node_id} leaves")
                raise torch_compat.RendezvousClosedError(f"rendezvous {self._run_id} is closed")
            if decision.announce and announced != round_:
                logger.info("node %s keeps round %d open: %s", m.node_id, round_, decision.reason)
                announced = round_
            pause = COORDINATOR_POLL_S if decision.fast else random.uniform(*WAITER_POLL_S)
            if not standby:
                pause = min(pause, max(0.0, join_deadline - time.monotonic()))
            if decision.fast or (coordinating and round_ <= 0):
                time.sleep(pause)
            else:
                self._rounds.wait_for_change(round_, coordinating, view.revision, pause)

    def _join(self, round_: int, also: dict[str, bytes] | None = None) -> int | None:
        """Writes this node's join key of ``round_`` (leaving its previous round, and saying so
        with that round's ``restart`` key if it was a participant; the keys in ``also`` go on
        the lease in the same request); returns the size of round ``round_ - 1``."""
        m = self._parts
        record = json.dumps({"node_id": m.node_id, "addr": self.addr, "pid": os.getpid(),
                             "joined_at": time.time(),
                             "probe": self._control.endpoint if self._control else ""}).encode()
        leaving = self._joined_round
        was_participant = leaving is not None and leaving == self._round
        previous_size = self._rounds.join(round_, record, m.publisher.lease(), leaving,
                                          was_participant, also)
        if leaving is not None and leaving != round_:
            m.publisher.forget(m.keys.join(leaving, m.node_id))
        m.publisher.remember(m.keys.join(round_, m.node_id), record)
        for key, data in (also or {}).items():
            m.publisher.remember(key, data)
        self._joined_round = round_
        return previous_size

    def _store_info(self, rank: int, store: Any) -> Any:
        """``MASTER_ADDR``/``MASTER_PORT`` for the workers, as torch's dynamic handler makes
        them: a free port on rank 0 per round, or (``share_tcp_store=1``) the port of a TCPStore
        this agent hosts for the workers."""
        if not self.use_agent_store:
            return torch_compat.bootstrap_store_info(rank, store, self.addr)
        if self._bootstrap is None or (rank == 0 and self._shared_tcp_store is None):
            self._bootstrap, hosted = torch_compat.host_worker_store(rank, self.addr, store)
            if hosted is not None:
                self._shared_tcp_store = hosted
        return self._bootstrap

    # -- helpers ----------------------------------------------------------------------------

    def _member_record(self, state: str, **fields: Any) -> MemberRecord:
        m = self._parts
        view = self._round_view
        return MemberRecord(
            node_id=m.node_id,
            state=state,
            addr=self.addr,
            pid=os.getpid(),
            round=view.round if view else -1,
            group_rank=view.group_rank if view else -1,
            group_world_size=view.group_world_size if view else 0,
            updated_at=time.time(),
            **fields,
        )

    def _publish_member(self, state: str, **fields: Any) -> None:
        m = self._parts
        m.publisher.publish(m.keys.member(m.node_id), self._member_record(state, **fields))

    def _publish_round(self, view: RoundView) -> None:
        """Records the round; membership records are advisory, so a failure here only logs."""
        m = self._parts
        try:
            self._publish_member("participant")
            if not view.is_leader:
                return
            now = time.time()
            m.publisher.publish(
                m.keys.leader, LeaderRecord(m.node_id, view.round, self.addr, os.getpid(), now))
            record = RoundRecord(
                round=view.round,
                leader=m.node_id,
                world_size=view.group_world_size,
                min_nodes=self.min_nodes,
                max_nodes=self.max_nodes,
                completed_at=now,
            )
            with etcd_errors(m.settings, "recording the round in"):
                m.client.put(m.keys.round, dump_record(record))
            logger.info("node %s leads round %d (%d nodes)", m.node_id, view.round,
                        view.group_world_size)
        except torch_compat.RendezvousConnectionError as e:
            logger.warning("could not publish round %d membership: %s", view.round, e)
