"""Who is in the job, who waits, who leads, who is banned: JSON records in etcd.

The rendezvous rounds' own keys (:mod:`elasticft.rendezvous.rounds`) are what the handlers
need to agree on ranks; elasticft publishes what people and other subsystems need to know next
to them, as JSON (never pickle across machines):

* **members** — one record per live agent (``waiting`` before a round, ``participant`` with its
  round and group rank after), bound to that agent's etcd *lease*: when the agent dies, its
  record disappears within the lease TTL, with no one cleaning up.
* **leader** — the group-rank-0 agent of the latest round writes itself here (also on its
  lease) together with the **round** record. Group ranks are assigned afresh every round, so a
  dead leader is replaced at the next round without a separate election.
* **blacklist** — cluster-wide verdicts ``node_id -> reason``, with no lease: they survive agent
  and etcd restarts until ``elasticft blacklist remove``.

A waiting member is a *standby* when the latest round already has its maximum number of nodes
(it waits for the next round without a join timeout), and *joining* otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any

from elasticft.rendezvous.etcd import (
    EtcdSettings,
    Keys,
    blacklist_prefix,
    connection_error,
    etcd_errors,
    lease_lost,
)

logger = logging.getLogger(__name__)


def _load(value: bytes | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        data = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def dump_record(record: Any) -> bytes:
    """A record (a dataclass) as the JSON bytes kept in etcd."""
    return json.dumps(dataclasses.asdict(record), sort_keys=True).encode()


def parse_record(cls: type, value: bytes | None) -> Any:
    """The record of dataclass ``cls`` kept as JSON ``value`` (None if absent or unreadable)."""
    return _from_dict(cls, _load(value))


def _from_dict(cls: type, data: dict[str, Any] | None) -> Any:
    if data is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError:
        return None


@dataclasses.dataclass(frozen=True)
class BlacklistEntry:
    node_id: str
    reason: str
    added_by: str = ""
    added_at: float = 0.0

    def summary(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.added_at))
        by = f" by {self.added_by}" if self.added_by else ""
        return f"{self.node_id}: {self.reason} (added{by} at {when})"


class Blacklist:
    """Cluster-wide node verdicts under ``<root>/blacklist/``."""

    def __init__(self, client: Any, root: str, settings: EtcdSettings) -> None:
        self._client = client
        self._prefix = blacklist_prefix(root)
        self._settings = settings

    def key(self, node_id: str) -> str:
        return self._prefix + node_id

    @staticmethod
    def parse(value: bytes | None) -> BlacklistEntry | None:
        return _from_dict(BlacklistEntry, _load(value))

    def get(self, node_id: str) -> BlacklistEntry | None:
        with etcd_errors(self._settings, "reading the blacklist from"):
            value, _ = self._client.get(self._prefix + node_id)
        return _from_dict(BlacklistEntry, _load(value))

    def add(self, node_id: str, reason: str, added_by: str = "") -> BlacklistEntry:
        entry = BlacklistEntry(node_id, reason, added_by, time.time())
        with etcd_errors(self._settings, "writing the blacklist to"):
            self._client.put(self._prefix + node_id, dump_record(entry))
        logger.info("node %s blacklisted: %s", node_id, reason)
        return entry

    def remove(self, node_id: str) -> bool:
        with etcd_errors(self._settings, "writing the blacklist to"):
            return bool(self._client.delete(self._prefix + node_id))

    def entries(self) -> list[BlacklistEntry]:
        with etcd_errors(self._settings, "reading the blacklist from"):
            found = list(self._client.get_prefix(self._prefix))
        entries = [_from_dict(BlacklistEntry, _load(value)) for value, _ in found]
        return sorted((e for e in entries if e is not None), key=lambda e: e.node_id)


@dataclasses.dataclass(frozen=True)
class MemberRecord:
    node_id: str
    state: str
    """``waiting`` (before/while joining a round) or ``participant``."""
    addr: str
    pid: int
    round: int = -1
    group_rank: int = -1
    group_world_size: int = 0
    health_ok: bool = True
    health_detail: str = ""
    updated_at: float = 0.0

    @staticmethod
    def parse(value: bytes | None) -> MemberRecord | None:
        return _from_dict(MemberRecord, _load(value))


@dataclasses.dataclass(frozen=True)
class LeaderRecord:
    node_id: str
    round: int
    addr: str
    pid: int
    since: float


@dataclasses.dataclass(frozen=True)
class RoundRecord:
    round: int
    leader: str
    world_size: int
    """Nodes (agents) in the round."""
    min_nodes: int
    max_nodes: int
    completed_at: float


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """A snapshot of one job's membership, read from etcd."""

    run_id: str
    round: RoundRecord | None
    leader: LeaderRecord | None
    members: tuple[MemberRecord, ...]
    blacklist: tuple[BlacklistEntry, ...]

    @property
    def participants(self) -> tuple[MemberRecord, ...]:
        if self.round is None:
            return ()
        found = [
            m for m in self.members if m.state == "participant" and m.round == self.round.round
        ]
        return tuple(sorted(found, key=lambda m: m.group_rank))

    @property
    def waiting(self) -> tuple[MemberRecord, ...]:
        return tuple(m for m in self.members if m.state != "participant"
                     or self.round is None or m.round != self.round.round)

    @property
    def full(self) -> bool:
        return self.round is not None and len(self.participants) >= self.round.max_nodes

    @property
    def standbys(self) -> tuple[MemberRecord, ...]:
        return self.waiting if self.full else ()

    @property
    def joining(self) -> tuple[MemberRecord, ...]:
        return () if self.full else self.waiting

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "round": dataclasses.asdict(self.round) if self.round else None,
            "leader": dataclasses.asdict(self.leader) if self.leader else None,
            "participants": [dataclasses.asdict(m) for m in self.participants],
            "standbys": [dataclasses.asdict(m) for m in self.standbys],
            "joining": [dataclasses.asdict(m) for m in self.joining],
            "blacklist": [dataclasses.asdict(e) for e in self.blacklist],
        }


def read_status(client: Any, keys: Keys, settings: EtcdSettings) -> JobStatus:
    with etcd_errors(settings, "reading the job status from"):
        members_raw = list(client.get_prefix(keys.members))
        leader_raw, _ = client.get(keys.leader)
        round_raw, _ = client.get(keys.round)
    members = [MemberRecord.parse(v) for v, _ in members_raw]
    return JobStatus(
        run_id=keys.run_id,
        round=_from_dict(RoundRecord, _load(round_raw)),
        leader=_from_dict(LeaderRecord, _load(leader_raw)),
        members=tuple(sorted((m for m in members if m), key=lambda m: m.node_id)),
        blacklist=tuple(Blacklist(client, keys.root, settings).entries()),
    )


def read_leader(client: Any, keys: Keys, settings: EtcdSettings) -> LeaderRecord | None:
    with etcd_errors(settings, "reading the leader from"):
        value, _ = client.get(keys.leader)
    return _from_dict(LeaderRecord, _load(value))


class MembershipPublisher:
    """Publishes this agent's records on its own lease, and keeps the lease alive.

    The lease TTL is the rendezvous' dead-node time (``keep_alive_interval *
    keep_alive_max_attempt``), so the JSON view and torch's view of who is alive agree. If the
    lease is lost (etcd was down longer than the TTL), a new one is granted and the records are
    written again.
    """

    def __init__(self, client: Any, keys: Keys, settings: EtcdSettings, ttl_s: int) -> None:
        self._client = client
        self._keys = keys
        self._settings = settings
        self.ttl_s = max(2, int(ttl_s))
        self._lease: Any = None
        self._records: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, key: str, record: Any) -> None:
        """Writes ``record`` at ``key`` on this agent's lease (kept until close or death)."""
        data = record if isinstance(record, bytes) else dump_record(record)
        for attempt in (1, 2):
            try:
                with self._lock:
                    self._records[key] = data
                    self._ensure_lease()
                    with etcd_errors(self._settings, f"publishing {key} to"):
                        self._client.put(key, data, lease=self._lease)
                break
            except connection_error() as e:
                if attempt == 2 or not lease_lost(e):
                    raise
                self.lease_lost()
        self._start_refresher()

    def lease_lost(self) -> None:
        """etcd said this agent's lease is gone (it expired while this process could not
        refresh it): the next :meth:`lease` or :meth:`publish` grants a new one and writes the
        records again."""
        with self._lock:
            if self._lease is not None:
                logger.warning("etcd lease %x of this node expired; granting a new one",
                               self._lease.id)
            self._lease = None

    def lease(self) -> Any:
        """This agent's lease (granted now if it has none), kept alive until :meth:`close`."""
        with self._lock:
            self._ensure_lease()
            lease = self._lease
        self._start_refresher()
        return lease

    def remember(self, key: str, data: bytes) -> None:
        """``key`` was written on :meth:`lease` by the caller: write it again with the
        records if the lease is ever lost."""
        with self._lock:
            self._records[key] = data

    def forget(self, key: str) -> None:
        with self._lock:
            self._records.pop(key, None)

    def _ensure_lease(self) -> None:
        """Grants a lease if there is none; records kept from a lost lease are written again
        on the new one (the caller holds the lock)."""
        if self._lease is None:
            if self._stop.is_set():
                from elasticft.torch_compat import RendezvousClosedError

                # Closed (the node left): a new lease would bring its records back.
                raise RendezvousClosedError("this node has left the rendezvous")
            with etcd_errors(self._settings, "granting a lease from"):
                self._lease = self._client.lease(self.ttl_s)
                for key, data in self._records.items():
                    self._client.put(key, data, lease=self._lease)

    def _start_refresher(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._refresh_loop, name="elasticft-etcd-lease", daemon=True
            )
        self._thread.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._refresh_once()
            except Exception as e:
                # etcd down or restarting: keep trying; torch's keep-alive logs the outage.
                logger.debug("lease refresh failed: %s", e)

    def _refresh_once(self) -> None:
        # The refresh runs outside the lock: under load it can take seconds, and the
        # rendezvous asks for the lease on every poll.
        with self._lock:
            lease = self._lease
        if lease is None:
            return
        responses = list(self._client.refresh_lease(lease.id))
        if responses and responses[-1].TTL > 0:
            return
        with self._lock:
            if self._lease is not lease:  # lost and granted again meanwhile
                return
            logger.info("etcd lease %x expired; publishing this node's records again", lease.id)
            self._lease = None
            self._ensure_lease()

    def close(self) -> None:
        """Stops refreshing and revokes the lease, so the records vanish now."""
        self._stop.set()
        with self._lock:
            lease, self._lease = self._lease, None
            self._records.clear()
        if lease is not None:
            try:
                self._client.revoke_lease(lease.id)
            except Exception as e:
                logger.debug("could not revoke lease: %s", e)
