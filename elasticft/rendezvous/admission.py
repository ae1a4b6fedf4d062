"""Admission: what a node waits for before it may join a round, each until the join deadline.

1. **etcd answers.** etcd may legitimately start after the agents, so a node waits for it, with
   a pause that grows while it does not answer and a log line every few seconds, so that a
   mistyped endpoint does not look like a silent hang.
2. **Its id is its own.** Another agent's member record may hold this node's id: an agent that
   died leaves one until its lease expires, and then the node waits; a live one keeps it, and
   the node stops with an error naming both agents.
3. **It is not quarantined** in this job (:mod:`elasticft.rendezvous.quarantine`).

The probe that answers the first wait also reads what the next ones need (this node's blacklist
entries, the last completed round, its member record) in the same request.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import time

import psutil

from elasticft.rendezvous import quarantine
from elasticft.rendezvous.etcd import describe_error
from elasticft.rendezvous.identity import DuplicateNodeIdError
from elasticft.rendezvous.membership import Blacklist, MemberRecord
from elasticft.rendezvous.rounds import ProbeView, RoundStore
from elasticft.torch_compat import RendezvousConnectionError

logger = logging.getLogger(__name__)

OUTAGE_RETRY_S = (0.5, 4.0)
"""While etcd does not answer, a node asks again after a pause that doubles from the first value
to the second, times a random factor in [0.5, 1]: when etcd is overloaded rather than down
(thousands of nodes at once), nodes retrying at a fixed pace add load exactly when it hurts,
and spread out they let it recover."""
DUPLICATE_POLL_S = 1.0
"""How often a node whose id another agent's member record holds looks again."""
DUPLICATE_GRACE_S = 2.0
"""How long past a lease's TTL a foreign member record may stay before its agent counts as
alive (records of a dead agent vanish when its lease expires)."""
OUTAGE_LOG_EVERY_S = 10.0
"""While etcd does not answer, a waiting node says so this often."""


@dataclasses.dataclass(frozen=True)
class Admission:
    """One node's waits before it joins (see the module docstring)."""

    rounds: RoundStore
    blacklist: Blacklist
    node_id: str
    host: str
    endpoints: str
    """etcd's endpoints as a line names them."""
    ttl_s: float
    """The lease time of a member record."""
    addr: str
    run_id: str

    def duplicate(self, probe: ProbeView, deadline: float) -> ProbeView:
        """Waits while another agent's member record holds this node's id (an agent that died
        leaves one until its lease expires); raises :class:`DuplicateNodeIdError` naming both
        agents when the other is alive (its record outlives a lease) or the join time is up."""
        ttl_deadline = min(deadline, time.monotonic() + self.ttl_s + DUPLICATE_GRACE_S)
        while (other := other_agent(probe.member, self.addr)) is not None:
            if time.monotonic() >= ttl_deadline:
                raise DuplicateNodeIdError(
                    f"node id {self.node_id!r} of job {self.run_id!r} is taken by another live "
                    f"agent ({other.addr}, pid {other.pid}); this agent is ({self.addr}, pid "
                    f"{os.getpid()}): give each agent its own --node-id, or leave --node-id "
                    "out for a unique default")
            logger.info("node id %s is held by the record of (%s, pid %d); waiting for it to "
                        "expire", self.node_id, other.addr, other.pid)
            time.sleep(DUPLICATE_POLL_S)
            probe = self.etcd(deadline)
        return probe

    def quarantine(self, probe: ProbeView, round_: int, deadline: float) -> ProbeView:
        """Waits while this node's id is quarantined in this job
        (:func:`elasticft.rendezvous.quarantine.wait_out`); returns the latest probe."""
        latest = [probe]

        def again() -> bytes | None:
            latest[0] = self.etcd(deadline)
            return latest[0].quarantined

        quarantine.wait_out(probe.quarantined, again, self.node_id, self.host, round_,
                            self.run_id, deadline, self.endpoints)
        return latest[0]

    def etcd(self, deadline: float) -> ProbeView:
        """Waits until etcd answers; returns what the probe read (this node's blacklist
        entries, the last completed round, its member record) in the same request."""
        started = time.monotonic()
        last_said = -math.inf
        pause_s = OUTAGE_RETRY_S[0]
        while True:
            try:
                names = dict.fromkeys((self.node_id, self.host))
                found = self.rounds.probe(tuple(self.blacklist.key(n) for n in names))
                if last_said > -math.inf:
                    logger.warning("etcd at %s answers after %.0f s", self.endpoints,
                                   time.monotonic() - started)
                return found
            except RendezvousConnectionError as e:
                now = time.monotonic()
                cause = describe_error(e.__cause__) if e.__cause__ else str(e)
                if now >= deadline:
                    raise RendezvousConnectionError(
                        f"cannot reach etcd at {self.endpoints} within "
                        f"{now - started:.0f} s ({cause}); start etcd or fix "
                        "--rdzv-endpoint / --rdzv-conf (TLS, user, password)"
                    ) from None
                # etcd may legitimately start after the agents, so this waits; but a mistyped
                # endpoint must not look like a silent hang for the whole join timeout.
                if now - last_said >= OUTAGE_LOG_EVERY_S:
                    last_said = now
                    logger.warning(
                        "waiting for etcd at %s (%s); giving up in %.0f s (set "
                        "--rdzv-conf connect_timeout=SECONDS to wait less or more)",
                        self.endpoints, cause, deadline - now)
                time.sleep(min(pause_s * random.uniform(0.5, 1.0), max(0.0, deadline - now)))
                pause_s = min(2 * pause_s, OUTAGE_RETRY_S[1])


def other_agent(raw_member: bytes | None, addr: str) -> MemberRecord | None:
    """The member record ``raw_member`` when it belongs to another live agent: not this
    process, and not a process of this host that is gone (a killed agent this one replaces)."""
    record = MemberRecord.parse(raw_member)
    if record is None or (record.addr == addr and record.pid == os.getpid()):
        return None
    if record.addr == addr and not psutil.pid_exists(record.pid):
        return None
    return record
