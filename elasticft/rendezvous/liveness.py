"""Knowing a node is gone in about a second, not a lease TTL.

An agent's etcd lease ends when nobody refreshes it for its TTL (15 s with torch's defaults:
``keep_alive_interval`` 5 s × ``keep_alive_max_attempt`` 3). Until then the rendezvous cannot
tell a dead agent from a slow one, and a round that waits for the previous round's participants
waits that long for a node that will never come. Yet the survivors usually know much sooner:
their workers saw the connection to the dead node's workers close (gloo: "connection closed by
peer") within about half a second, and their agents came back to rendezvous because of it.

What turns that suspicion into evidence is a direct probe of the missing agent:

* Every agent listens on a **control endpoint**: a TCP socket on its rendezvous address whose
  only job is to accept and close connections (:class:`ControlEndpoint`). It is written into the
  agent's join record of each round. A live agent answers even when it is busy (the kernel
  completes the handshake); a dead agent's endpoint is gone with its process, and the kernel of
  its host refuses the connection at once.
* When the previous round is over (one of its participants came back to rendezvous) and the
  coordinator of the new round waits for participants of it that have not joined (a node
  whose death is not known), it reads their join records (one request) and probes each, at
  most every :data:`PROBE_EVERY_S`.
* :func:`judge` (pure, tested with a table) turns what the probe saw into a verdict. Only a
  refused connection is evidence of death (a pid is no evidence: containers on one host have
  pid spaces of their own):
  the coordinator then **ends that node's membership** by revoking its lease (its join key,
  member record and anything else on the lease vanish at once), logs why, and records an
  ``membership_ended`` event. A probe that times out or cannot reach the host (a machine that is
  down, a network cut) is no evidence: the lease TTL decides, as before.
* A live agent that was declared dead all the same finds its lease gone at its next refresh,
  takes a new one and writes its records again (:class:`~elasticft.rendezvous.membership.
  MembershipPublisher`); a quarantine does not refuse it (:mod:`elasticft.rendezvous.quarantine`),
  so it rejoins at the next round and resumes from the newest snapshot.

Steady-state etcd load does not change: nothing here runs while a round trains; the join
record's extra field rides on the join, and the read of the missing nodes' records happens only
while a round waits for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import logging
import socket
import threading
from collections.abc import Callable

from elasticft.decision import Decision
from elasticft.rendezvous.rounds import RoundStore
from elasticft.torch_compat import RendezvousConnectionError

logger = logging.getLogger(__name__)

PROBE_EVERY_S = 1.0
"""The coordinator probes the missing participants of the previous round this often."""
PROBE_TIMEOUT_S = 0.5
"""How long a probe waits for the handshake before it counts as no answer."""


class Probe(enum.Enum):
    ANSWERED = "answered"
    REFUSED = "refused"
    """The host answered that nothing listens there: the agent's process is gone."""
    NO_ANSWER = "no answer"
    """Timed out, unreachable, or the agent has no control endpoint: no evidence either way."""


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What a survivor knows about one missing participant's agent."""

    node_id: str
    probe: Probe
    endpoint: str = ""


class Liveness(enum.Enum):
    DEAD = "dead"
    """Dead on evidence: its membership may be ended now."""
    NOT_KNOWN = "not known"
    """Not known to be dead: its lease's TTL decides."""


def judge(evidence: Evidence) -> Decision[Liveness]:
    """Whether the missing agent is dead on evidence."""
    agent, at = f"agent of node {evidence.node_id}", evidence.endpoint
    if evidence.probe is Probe.REFUSED:
        return Decision(Liveness.DEAD,
                        f"{agent} is gone: its control endpoint {at} refused the connection")
    if evidence.probe is Probe.ANSWERED:
        return Decision(Liveness.NOT_KNOWN, f"{agent} answers at {at}: alive, only late")
    return Decision(Liveness.NOT_KNOWN, f"{agent} did not answer a probe"
                                        f"{' at ' + at if at else ''}: its lease decides")


def probe(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """Connects to ``endpoint`` (``host:port``) and closes at once."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        return Probe.NO_ANSWER
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return Probe.ANSWERED
    except ConnectionRefusedError:
        return Probe.REFUSED
    except OSError as e:
        return Probe.REFUSED if e.errno == errno.ECONNREFUSED else Probe.NO_ANSWER


def gather(node_id: str, endpoint: str) -> Evidence:
    """Probes one missing agent's control endpoint (none: no evidence)."""
    return Evidence(node_id, probe(endpoint) if endpoint else Probe.NO_ANSWER, endpoint)


def end_dead_members(rounds: RoundStore, node_id: str, round_: int,
                     emit: Callable[..., None] | None) -> None:
    """(The coordinator ``node_id``) Probes the agents still in round ``round_`` (it is over;
    the live ones are on their way to the next) and revokes the lease of each that is dead on
    evidence, logging why and recording a ``membership_ended`` event through ``emit``."""
    try:
        found = rounds.join_records(round_)
    except RendezvousConnectionError as e:
        logger.debug("could not read the joins of round %d: %s", round_, e)
        return
    for node, record, lease_id in found:
        if node == node_id:
            continue
        verdict = judge(gather(node, str(record.get("probe") or "")))
        if verdict.kind is not Liveness.DEAD or not lease_id:
            logger.debug("%s", verdict.reason)
            continue
        try:
            rounds.end_lease(lease_id)
        except RendezvousConnectionError as e:  # it ended meanwhile, or etcd is away
            logger.debug("could not end the lease of node %s: %s", node, e)
            continue
        logger.warning("node %s ended the membership of node %s: %s (not waiting for its "
                       "lease's TTL)", node_id, node, verdict.reason)
        if emit is not None:
            emit("membership_ended", node=node, round=round_, reason=verdict.reason,
                 by=node_id)


class ControlEndpoint:
    """A listening socket that accepts and closes connections, for as long as the agent lives
    (closed with it, or by :meth:`close`)."""

    def __init__(self, addr: str) -> None:
        self._socket: socket.socket | None = None
        self.endpoint = ""
        try:
            self._socket = socket.create_server((addr, 0), backlog=64)
        except OSError as e:
            logger.warning("no control endpoint on %s (%s): a node loss is known by its lease "
                           "only", addr, e)
            return
        host, port = self._socket.getsockname()[:2]
        self.endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        threading.Thread(target=self._serve, args=(self._socket,), daemon=True,
                         name="elasticft-control-endpoint").start()

    @staticmethod
    def _serve(server: socket.socket) -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return  # closed
            with contextlib.suppress(OSError):
                connection.close()

    def close(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
            self._socket.close()
            self._socket = None
