"""The TCP connections each process group of this process made, recorded when the group is made,
so that a survivor ends a pending gloo wait by shutting down those and nothing else.

**Why.** A gloo collective waits on its group's TCP connections; torch's abort of a gloo group
returns at once but leaves that wait in place (a peer that died without closing its sockets,
because a child of it holds them, never ends it). Shutting down the survivor's own end of the
group's connections does: gloo's receive sees end of file and the collective raises "connection
closed", which the recovery handles like any peer failure. Only the group's own connections may
be touched: the process has others that must live through a recovery (a ``TCPStore`` client the
script made, a metrics or logging service, a download in flight, the store server rank 0 hosts).
Nothing outside gloo tells its connections apart afterwards, so they are told apart when made.

**Recording.** :func:`install` wraps torch's ``_new_process_group_helper``, through which every
group is made (``init_process_group``, ``new_group``, a ``DeviceMesh``'s groups, the regroup's
own ``init_process_group``). Around each call it takes a :func:`snapshot` of the process's TCP
sockets (``/proc/self/net/tcp*`` and the descriptors naming them); the group's sockets are those
established during the call (:func:`made_by_group`), less the connections a server that already
listened accepted meanwhile (a peer joining the store this process hosts). A listening socket is
never recorded: a shutdown of gloo's listener makes its accept loop abort the process. The
bootstrap installs the wrapper when torch is imported
(:mod:`elasticft.diag.autoinstall`), before the script's own ``init_process_group``.

**Ending.** :meth:`GroupSockets.shut_down` shuts down, in both directions, each recorded
socket whose descriptor still names the same socket (its inode, compared on a duplicate of the
descriptor, so a number closed and reused in between is left alone: :func:`still_recorded`).
The descriptors stay open; their owner closes them. Made while another thread of the script
opened a connection, a group's record would hold that connection too; a gloo group made with
``TORCH_GLOO_LAZY_INIT`` connects later and records nothing (its wait is then ended only by the
teardown's hard limit).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import threading
from collections.abc import Iterable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

_ESTABLISHED = "01"
_LISTEN = "0A"
"""States of a socket in ``/proc/net/tcp``."""


@dataclasses.dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of this process as a descriptor names it."""

    fd: int
    inode: int
    local_port: int
    state: str
    """``/proc/net/tcp``'s state: ``01`` established, ``0A`` listening."""

    @property
    def listening(self) -> bool:
        return self.state == _LISTEN


def snapshot(pid: int | str = "self") -> dict[int, TcpSocket]:
    """This process's TCP sockets (IPv4 and IPv6, any state), by descriptor."""
    by_inode: dict[int, tuple[int, str]] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9:
                        port = int(fields[1].rsplit(":", 1)[1], 16)
                        by_inode[int(fields[9])] = (port, fields[3])
        except (OSError, ValueError, IndexError):
            continue
    found: dict[int, TcpSocket] = {}
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            inode = int(target[8:-1])
            if inode in by_inode:
                port, state = by_inode[inode]
                found[int(name)] = TcpSocket(int(name), inode, port, state)
    return found


def made_by_group(before: Mapping[int, TcpSocket], after: Mapping[int, TcpSocket],
                  own_listeners: Iterable[int] = ()) -> list[TcpSocket]:
    """The connections a group made between two snapshots (pure): established, new, and not
    accepted by a server that listened before (those are that server's clients), unless that
    server is the group's own (``own_listeners``, ports: a group reconnected in place accepts
    on the listener it made at its creation)."""
    old = {s.inode for s in before.values()}
    servers = {s.local_port for s in before.values() if s.listening} - set(own_listeners)
    return sorted((s for s in after.values()
                   if s.state == _ESTABLISHED and s.inode not in old
                   and s.local_port not in servers), key=lambda s: s.fd)


def still_recorded(recorded: Iterable[TcpSocket], now: Mapping[int, int]) -> list[TcpSocket]:
    """The recorded sockets whose descriptor still names the same socket (pure); ``now`` maps a
    descriptor to the inode it names now (absent: closed)."""
    return [s for s in recorded if now.get(s.fd) == s.inode]


class GroupSockets:
    """The sockets of the process groups made since :func:`install`, per group."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_group: list[tuple[str, list[TcpSocket]]] = []

    def record(self, group: str, made: list[TcpSocket]) -> None:
        """Adds a group's sockets; drops the records of sockets closed since (a group that
        was destroyed), so the list holds the live groups' only."""
        with self._lock:
            kept = []
            for name, sockets in self._by_group:
                alive = still_recorded(sockets, _inodes_now(sockets))
                if alive:
                    kept.append((name, alive))
            self._by_group = [*kept, (group, made)]

    def recorded(self) -> list[tuple[str, list[TcpSocket]]]:
        with self._lock:
            return [(name, list(sockets)) for name, sockets in self._by_group]

    def shut_down(self) -> tuple[int, int]:
        """Shuts down every recorded socket its descriptor still names; returns (shut down,
        recorded)."""
        with self._lock:
            sockets = [s for _, group in self._by_group for s in group]
        return sum(_shut_down_if_same(s) for s in sockets), len(sockets)

    def watch(self, c10d: Any) -> bool:
        """Wraps ``c10d._new_process_group_helper`` to record what each group makes (True:
        wrapped now or before)."""
        helper = getattr(c10d, "_new_process_group_helper", None)
        if helper is None:
            return False
        if getattr(helper, "__elasticft_sockets__", None) is not None:
            return True
        recording = self

        @functools.wraps(helper)
        def new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
            before = snapshot()
            result = helper(*args, **kwargs)
            try:
                name = kwargs.get("group_name", args[5] if len(args) > 5 else "?")
                recording.record(str(name), made_by_group(before, snapshot()))
            except Exception:  # the recording never stops a group from being made
                logger.warning("could not record a process group's sockets", exc_info=True)
            return result

        new_process_group_helper.__elasticft_sockets__ = self  # type: ignore[attr-defined]
        c10d._new_process_group_helper = new_process_group_helper
        return True


def _inodes_now(sockets: Iterable[TcpSocket]) -> dict[int, int]:
    """The inode each of the sockets' descriptors names now (closed ones absent)."""
    now = {}
    for s in sockets:
        try:
            now[s.fd] = os.stat(f"/proc/self/fd/{s.fd}").st_ino
        except OSError:
            continue
    return now


def _shut_down_if_same(recorded: TcpSocket) -> bool:
    """Shuts down the socket ``recorded.fd`` names if it is still the recorded one: checked on
    a duplicate of the descriptor, which keeps naming that socket whatever happens to the
    number meanwhile."""
    try:
        duplicate = os.dup(recorded.fd)
    except OSError:
        return False
    sock: socket.socket | None = None
    try:
        if not still_recorded([recorded], {recorded.fd: os.fstat(duplicate).st_ino}):
            return False
        sock = socket.socket(fileno=duplicate)
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        if sock is not None:
            sock.close()
        else:
            os.close(duplicate)


# The one recording of this process: installed by the start-up bootstrap before the script
# runs, found by the in-process recovery when it arms and by the end of the groups.
_installed: GroupSockets | None = None


def install(c10d: Any = None) -> GroupSockets | None:
    """Records from now on the sockets of every process group this process makes (once per
    process); None where torch has no group helper to wrap."""
    global _installed
    if c10d is None:
        import torch.distributed as dist

        if not dist.is_available():
            return None
        c10d = dist.distributed_c10d
    if _installed is None:
        recording = GroupSockets()
        if not recording.watch(c10d):
            return None
        _installed = recording
    else:
        _installed.watch(c10d)
    return _installed


def installed() -> GroupSockets | None:
    """The recording :func:`install` made, if any."""
    return _installed

