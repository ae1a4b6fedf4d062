"""The ``etcd-v3`` rendezvous handler: torch's dynamic rendezvous plus the membership features
fault tolerance needs.

It *is* torch's :class:`DynamicRendezvousHandler` (same join/last-call/keep-alive protocol,
same redundancy list), built over :class:`EtcdRendezvousBackend` and :class:`EtcdStore`, with
these additions around each ``next_rendezvous``:

1. **etcd reachable?** Probed until the join deadline (``connect_timeout``); if not, one
   :class:`RendezvousConnectionError` line naming the endpoints.
2. **Blacklist.** A node whose ``node_id`` has a verdict is refused with
   :class:`NodeBlacklistedError`, whose message carries the reason.
3. **Health check** (torch is already imported by then): a failing node is refused with
   :class:`NodeUnhealthyError`. A node that passes and finds the job full waits in torch's
   redundancy list, a *warm standby*, and is admitted at the next round after a loss.
4. **Membership records and the leader** (:mod:`elasticft.rendezvous.membership`): the agent
   with group rank 0 of the round is the leader; ask :meth:`is_leader` or :meth:`leader`.

An etcd outage while training runs costs nothing: :meth:`num_nodes_waiting` answers 0 (no one
can join through an unreachable store) instead of failing the agent's monitor loop, keep-alives
resume when etcd is back, and a rendezvous that meets the outage retries until its deadline.

Registered for ``torchrun --rdzv-backend etcd-v3`` through the ``torchrun.handlers`` entry
point (:mod:`elasticft.rendezvous.registration`); ``elasticft-run`` uses the same one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import time
from datetime import timedelta
from typing import Any

from elasticft.extras import require_etcd
from elasticft.rendezvous.backend import EtcdRendezvousBackend
from elasticft.rendezvous.etcd import (
    EtcdConfigError,
    EtcdSettings,
    Keys,
    LazyClient,
    describe_error,
    etcd_errors,
)
from elasticft.rendezvous.health import HealthCheck, basic_health_check
from elasticft.rendezvous.membership import (
    Blacklist,
    LeaderRecord,
    MemberRecord,
    MembershipPublisher,
    RoundRecord,
    read_leader,
)
from elasticft.rendezvous.store import EtcdStore
from elasticft.torch_compat import (
    DynamicRendezvousHandler,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeout,
    rendezvous_round,
)

logger = logging.getLogger(__name__)

DISABLE_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_OUTAGE_LOG_EVERY_S = 10.0


class NodeBlacklistedError(RendezvousError):
    """This node is on the blacklist; ``reason`` says why."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class NodeUnhealthyError(RendezvousError):
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
class _Membership:
    """The etcd-side companions of one handler (set once by :func:`create_handler`)."""

    client: Any
    settings: EtcdSettings
    keys: Keys
    node_id: str
    blacklist: Blacklist
    publisher: MembershipPublisher
    health_check: HealthCheck
    connect_timeout_s: float


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous over etcd v3 with blacklist, standbys and a leader."""

    _membership: _Membership
    _round_view: RoundView | None = None
    _last_outage_log: float = 0.0

    def attach(self, membership: _Membership) -> None:
        self._membership = membership

    # -- what other subsystems ask ------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self._membership.node_id

    @property
    def keys(self) -> Keys:
        return self._membership.keys

    @property
    def blacklist(self) -> Blacklist:
        """Mark a node bad with ``handler.blacklist.add(node_id, reason, added_by)``."""
        return self._membership.blacklist

    @property
    def round_view(self) -> RoundView | None:
        return self._round_view

    def is_leader(self) -> bool:
        """Whether this agent leads the round it last joined (group rank 0)."""
        return self._round_view is not None and self._round_view.is_leader

    def leader(self) -> LeaderRecord | None:
        """The leader of the latest round as published in etcd (None while it is re-elected)."""
        m = self._membership
        return read_leader(m.client, m.keys, m.settings)

    # -- torch's handler interface ----------------------------------------------------------

    def next_rendezvous(self) -> RendezvousInfo:
        m = self._membership
        # Heartbeats stop before any refusal below, so a refused node drops out of the
        # rendezvous state like a dead one instead of lingering as a participant.
        self._stop_heartbeats()
        join_deadline = time.monotonic() + self.settings.timeout.join.total_seconds()
        self._wait_for_etcd(min(join_deadline, time.monotonic() + m.connect_timeout_s))
        entry = m.blacklist.get(m.node_id)
        if entry is not None:
            raise NodeBlacklistedError(
                f"node {m.node_id!r} is blacklisted: {entry.reason} (added"
                f"{' by ' + entry.added_by if entry.added_by else ''}); after fixing it run "
                f"`elasticft blacklist remove {m.node_id} --rdzv-endpoint "
                f"{m.settings.endpoint_text}`",
                reason=entry.reason,
            )
        report = m.health_check()
        self._publish_member("waiting", health_ok=report.ok, health_detail=report.detail)
        if not report.ok:
            raise NodeUnhealthyError(
                f"node {m.node_id!r} failed its health check: {report.detail}"
            )
        while True:
            try:
                info = super().next_rendezvous()
                break
            except RendezvousConnectionError as e:
                if time.monotonic() >= join_deadline:
                    raise
                logger.warning("rendezvous interrupted by an etcd outage (%s); retrying", e)
                self._wait_for_etcd(join_deadline)
        view = RoundView(rendezvous_round(self, -1), info.rank, info.world_size)
        self._round_view = view
        self._publish_round(view)
        return info

    def num_nodes_waiting(self) -> int:
        try:
            return super().num_nodes_waiting()
        except RendezvousConnectionError as e:
            # Nobody can join through an unreachable etcd; the workers keep training.
            now = time.monotonic()
            if now - self._last_outage_log >= _OUTAGE_LOG_EVERY_S:
                self._last_outage_log = now
                logger.warning("etcd unreachable, training goes on: %s", e)
            return 0

    def shutdown(self) -> bool:
        closed = super().shutdown()
        self.close_membership()
        return closed

    def close_membership(self) -> None:
        """Withdraws this node's records now (they would expire with its lease anyway)."""
        self._membership.publisher.close()

    # -- helpers ----------------------------------------------------------------------------

    def _wait_for_etcd(self, deadline: float) -> None:
        m = self._membership
        started = time.monotonic()
        last_said = -math.inf
        while True:
            try:
                with etcd_errors(m.settings, "connecting to"):
                    m.client.get(m.keys.state)
                if last_said > -math.inf:
                    logger.warning("etcd at %s answers after %.0f s", m.settings.endpoint_text,
                                   time.monotonic() - started)
                return
            except RendezvousConnectionError as e:
                now = time.monotonic()
                cause = describe_error(e.__cause__) if e.__cause__ else str(e)
                if now >= deadline:
                    raise RendezvousConnectionError(
                        f"cannot reach etcd at {m.settings.endpoint_text} within "
                        f"{now - started:.0f} s ({cause}); start etcd or fix "
                        "--rdzv-endpoint / --rdzv-conf (TLS, user, password)"
                    ) from None
                # etcd may legitimately start after the agents, so this waits; but a mistyped
                # endpoint must not look like a silent hang for the whole join timeout.
                if now - last_said >= _OUTAGE_LOG_EVERY_S:
                    last_said = now
                    logger.warning(
                        "waiting for etcd at %s (%s); giving up in %.0f s (set "
                        "--rdzv-conf connect_timeout=SECONDS to wait less or more)",
                        m.settings.endpoint_text, cause, deadline - now)
                time.sleep(min(0.5, max(0.0, deadline - now)))

    def _publish_member(self, state: str, **fields: Any) -> None:
        m = self._membership
        view = self._round_view
        record = MemberRecord(
            node_id=m.node_id,
            state=state,
            addr=self._this_node.addr,
            pid=os.getpid(),
            round=view.round if view else -1,
            group_rank=view.group_rank if view else -1,
            group_world_size=view.group_world_size if view else 0,
            updated_at=time.time(),
            **fields,
        )
        m.publisher.publish(m.keys.member(m.node_id), record)

    def _publish_round(self, view: RoundView) -> None:
        """Records the round; membership records are advisory, so a failure here only logs."""
        m = self._membership
        try:
            self._publish_member("participant")
            if not view.is_leader:
                return
            now = time.time()
            m.publisher.publish(
                m.keys.leader,
                LeaderRecord(m.node_id, view.round, self._this_node.addr, os.getpid(), now),
            )
            record = RoundRecord(
                round=view.round,
                leader=m.node_id,
                world_size=view.group_world_size,
                min_nodes=self.settings.min_nodes,
                max_nodes=self.settings.max_nodes,
                completed_at=now,
            )
            with etcd_errors(m.settings, "recording the round in"):
                m.client.put(m.keys.round, json_bytes(record))
            logger.info("node %s leads round %d (%d nodes)", m.node_id, view.round,
                        view.group_world_size)
        except RendezvousConnectionError as e:
            logger.warning("could not publish round %d membership: %s", view.round, e)


def json_bytes(record: Any) -> bytes:
    import json

    return json.dumps(dataclasses.asdict(record), sort_keys=True).encode()


def _conf_int(params: RendezvousParameters, key: str, default: int) -> int:
    try:
        value = params.get_as_int(key, default)
    except ValueError:
        raise EtcdConfigError(
            f"--rdzv-conf {key}={params.get(key)!r} is not a whole number of seconds"
        ) from None
    return default if value is None else value


def _timeout(params: RendezvousParameters, name: str) -> timedelta | None:
    key = f"{name}_timeout"
    if params.get(key) is None:
        return None
    return timedelta(seconds=_conf_int(params, key, 0))


def create_handler(
    params: RendezvousParameters, health_check: HealthCheck = basic_health_check
) -> EtcdRendezvousHandler:
    """Builds the handler from torchrun's rendezvous parameters; does not contact etcd yet.

    ``--rdzv-conf`` keys: torch's (``join_timeout``, ``last_call_timeout``, ``close_timeout``,
    ``heartbeat_timeout``, ``keep_alive_interval``, ``keep_alive_max_attempt``), the connection
    keys of :meth:`EtcdSettings.from_conf`, and ``node_id`` (default: the host name; set by
    elasticft-run from ``--node-id``), ``connect_timeout`` (default: the join timeout),
    ``store_timeout`` (agent store reads, default 300 s), ``share_tcp_store`` (default 0).
    """
    require_etcd()
    settings = EtcdSettings.from_conf(params.endpoint, params.config)
    if not params.run_id or params.run_id == "none":
        raise EtcdConfigError("the etcd-v3 rendezvous needs a job id; give --rdzv-id NAME")
    keys = Keys(settings.root, params.run_id)
    node_id = str(params.get("node_id") or socket.gethostname())
    if "/" in node_id or not node_id.strip():
        raise EtcdConfigError(f"node id {node_id!r} is not usable; give a name without '/'")
    if not params.get_as_bool("share_tcp_store", False):
        # Workers then get a fresh store every attempt: the shared one deadlocks when a node
        # (a standby) joins a running job and keeps stale gloo addresses (pytorch#135712).
        os.environ.setdefault(DISABLE_SHARED_STORE_ENV, "1")

    keep_alive_interval = _conf_int(params, "keep_alive_interval", 5)
    keep_alive_max_attempt = _conf_int(params, "keep_alive_max_attempt", 3)
    timeout = RendezvousTimeout(
        _timeout(params, "join"),
        _timeout(params, "last_call"),
        _timeout(params, "close"),
        _timeout(params, "heartbeat"),
    )
    client = LazyClient(settings)
    backend = EtcdRendezvousBackend(client, keys.state, settings)
    store = EtcdStore(
        client, keys.store, settings, timedelta(seconds=_conf_int(params, "store_timeout", 300))
    )
    handler = EtcdRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=keep_alive_interval,
        keep_alive_max_attempt=keep_alive_max_attempt,
    )
    connect_timeout = _conf_int(
        params, "connect_timeout", int(handler.settings.timeout.join.total_seconds())
    )
    handler.attach(
        _Membership(
            client=client,
            settings=settings,
            keys=keys,
            node_id=node_id,
            blacklist=Blacklist(client, settings.root, settings),
            publisher=MembershipPublisher(
                client, keys, settings, ttl_s=keep_alive_interval * keep_alive_max_attempt
            ),
            health_check=health_check,
            connect_timeout_s=float(connect_timeout),
        )
    )
    return handler



