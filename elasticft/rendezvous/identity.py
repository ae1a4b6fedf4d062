"""An agent's name in its job: unique among the job's live agents on a host, stable over restarts.

A rendezvous knows each agent by its node id: its join key, its member record, its rank order,
its event log file and its blacklist entry are all named by it. The host name alone is not
unique: people run several agents on one host (local multi-node tests, two jobs splitting one
8-GPU box, CI), and two agents under one name overwrite each other's join key and never meet.
Two jobs that only share a job id but meet at different rendezvous endpoints (two etcd
clusters, two test suites) are different jobs, and claim apart.

The claim is an abstract Unix socket named after the job, its rendezvous endpoint and the id
(Linux only; a name of the kernel's, with no file behind it): binding it succeeds for one live
process only, the kernel drops it when that process dies however it dies, and the socket's
owner can be asked for its pid. The first agent of a job on a host is the host name, exactly as
before (its blacklist entry and its checkpoint directory stay the same from one allocation to
the next); a second live one is ``<host>-2``, a third ``<host>-3``, and so on. An explicit
``--node-id`` is claimed the same way, and a duplicate on the same host is refused at once with
both processes named.
(A duplicate on another host is found by the rendezvous from its member record.)

Claiming is idempotent within one process: the launcher claims before it builds its add-ons,
and the rendezvous handler, built later in the same process, finds the name already its own.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import socket
import struct

from elasticft.config import ConfigError

MAX_AGENTS_PER_HOST = 256
"""How many default names (``<host>``, ``<host>-2``, ...) are tried before giving up."""


class DuplicateNodeIdError(ConfigError):
    """Another live agent of the same job on this host holds the node id asked for."""

    reason = "duplicate_node_id"


@dataclasses.dataclass
class NodeClaim:
    """This process's claim on ``node_id`` in job ``run_id``; released by :meth:`release`
    or when the process exits."""

    node_id: str
    host: str
    """The machine's name: what an operator blacklists to refuse every agent on it."""
    _socket: socket.socket | None = dataclasses.field(default=None, repr=False)

    def release(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _socket_name(run_id: str, node_id: str, endpoint: str = "") -> bytes:
    job = f"{run_id}\0{endpoint.strip()}"
    digest = hashlib.blake2b(f"{job}\0{node_id}".encode(), digest_size=16).hexdigest()
    return b"\0elasticft-node/" + digest.encode()


def _holder_pid(name: bytes) -> int | None:
    """The pid of the process listening on the abstract socket ``name`` (None if unknown)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.setblocking(False)
        probe.connect(name)
        raw = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", raw)[0])
    except OSError:
        return None
    finally:
        probe.close()


def _try_bind(name: bytes) -> socket.socket | int:
    """A listening socket bound to ``name``, or the pid already holding it (-1 if unknown)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name)
    except OSError as e:
        sock.close()
        if e.errno != errno.EADDRINUSE:
            raise
        pid = _holder_pid(name)
        return -1 if pid is None else pid
    sock.listen(64)
    return sock


def claim_node_id(run_id: str, explicit: str | None = None, host: str | None = None,
                  endpoint: str = "") -> NodeClaim:
    """Claims this agent's node id in job ``run_id`` at rendezvous ``endpoint``: ``explicit``
    when given, else the first free one of ``<host>``, ``<host>-2``, ... Raises
    :class:`DuplicateNodeIdError` when another live process on this host holds ``explicit``."""
    host = host or socket.gethostname()
    candidates = [explicit] if explicit else [
        host if n == 1 else f"{host}-{n}" for n in range(1, MAX_AGENTS_PER_HOST + 1)]
    for node_id in candidates:
        held = _try_bind(_socket_name(run_id, node_id, endpoint))
        if isinstance(held, socket.socket):
            return NodeClaim(node_id, host, held)
        if held == os.getpid():
            return NodeClaim(node_id, host)
        if explicit:
            other = f"pid {held}" if held > 0 else "another process"
            raise DuplicateNodeIdError(
                f"node id {explicit!r} of job {run_id!r} is already taken by a live agent on "
                f"this host ({host}, {other}); this agent is ({host}, pid {os.getpid()}): give "
                "each agent its own --node-id, or leave --node-id out for a unique default")
    raise DuplicateNodeIdError(
        f"{MAX_AGENTS_PER_HOST} agents of job {run_id!r} already run on {host}; give this one "
        "a --node-id of its own")
