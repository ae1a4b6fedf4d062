"""A worker's process groups as in-process recovery sees them: what the script asked of its
default group, and how every group of the process is ended while a call may still wait in it.

**What the script asked for** (:class:`GroupSettings`): the ``timeout``, the ``device_id``
(NCCL's eager init, bound to one device) and the ``pg_options`` the script passed to
``init_process_group``. They are read back from the live default group when recovery arms
(torch keeps them on the group and its backend), so the regroup after a failure makes the same
group again: a hang after a recovery is found within the script's timeout, not torch's default.

**Ending every group** (:func:`end_groups`): the default group, ``new_group`` groups and a
``DeviceMesh``'s groups are all in torch's table of groups. NCCL's are aborted through torch
(``_abort_process_group``), which ends the communicators' kernels without waiting for the
dead peer. Gloo's ``abort`` returns at once but leaves a pending collective waiting (measured on
torch 2.13: an ``allreduce`` with a silent peer returned only when that peer's process ended):
its wait is on the group's TCP connections, so the survivor shuts down its own ends of them
(:func:`end_tcp_connections`). Gloo's connections cannot be told apart from outside gloo, so
every established TCP connection of the process is shut down: the others a worker has are
normally its old group's store connection, which the regroup replaces; a script's own
long-lived TCP client (a metrics exporter, say) sees a reset and has to reconnect. A peer that
died without closing its sockets (they live on in a child of it, or, on NCCL, there is nothing
to close) then costs the survivor nothing: gloo's receive sees its own socket end and the
collective raises "connection closed", which the recovery handles like any peer failure. Only
this process's descriptors are touched.

**Tearing down and regrouping** (:class:`GroupOps`, :func:`tear_down`, :func:`regroup`): torch's
functions behind one seam the tests replace; the regroup joins the next generation's store
(:class:`elasticft.recovery.protocol.Generation`) with what the script asked for.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elasticft.recovery.health import ArmedDevice, device_health
from elasticft.recovery.protocol import Generation

logger = logging.getLogger(__name__)

_ESTABLISHED = "01"
"""The state of an established connection in ``/proc/net/tcp``."""


@dataclasses.dataclass(frozen=True)
class GroupSettings:
    """What the script passed to ``init_process_group`` that torch keeps on the group."""

    timeout: timedelta | None = None
    device_id: torch.device | None = None
    pg_options: Any = None
    """The backend's options (NCCL's ``ProcessGroupNCCL.Options``); None for gloo."""

    @classmethod
    def of_default_group(cls) -> GroupSettings:
        """Read back from the live default group (empty when there is none)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        group = dist.distributed_c10d._get_default_group()
        backend_name = str(dist.get_backend()).lower()
        device_id = getattr(group, "bound_device_id", None)
        timeout = options = None
        for device_type in ("cuda", "cpu"):
            try:
                backend = group._get_backend(torch.device(device_type))
            except (RuntimeError, ValueError):
                continue
            options = getattr(backend, "options", None)
            timeout = getattr(options, "_timeout", None)
            break
        return cls(timeout=timeout if isinstance(timeout, timedelta) else None,
                   device_id=device_id,
                   pg_options=options if "nccl" in backend_name else None)

    def init_kwargs(self) -> dict[str, Any]:
        """The keywords of ``init_process_group`` that make the same group again."""
        kwargs: dict[str, Any] = {}
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        if self.device_id is not None:
            kwargs["device_id"] = self.device_id
        if self.pg_options is not None:
            kwargs["pg_options"] = self.pg_options
        return kwargs


def process_groups() -> list[Any]:
    """Every process group of this process (the default one first), from torch's table."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    default = dist.distributed_c10d._get_default_group()
    others = [g for g in dist.distributed_c10d._world.pg_map if g is not default]
    return [default, *others]


def end_groups(backend: str) -> str:
    """Ends every process group of this process while calls may wait in them; returns how
    (for the log). Safe from a thread other than the one blocked in a collective."""
    groups = process_groups()
    if "nccl" in backend.lower():
        abort = dist.distributed_c10d._abort_process_group
        for group in groups:
            try:
                abort(group)
            except Exception as e:  # one group's abort must not keep the others alive
                logger.warning("aborting a process group failed: %s", e)
        return "abort"
    for group in groups:
        try:
            group.abort()
        except Exception as e:
            logger.debug("gloo abort: %s", e)
    ended = end_tcp_connections()
    return f"abort+shutdown({ended})"


def tcp_connections(pid: int | str = "self") -> list[int]:
    """File descriptors of this process's established TCP connections (IPv4 and IPv6)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == _ESTABLISHED:
                        inodes.add(fields[9])
        except OSError:
            continue
    found = []
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return []
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            found.append(int(name))
    return sorted(found)


def end_tcp_connections() -> int:
    """Shuts down this process's established TCP connections (both directions), which ends
    every wait on them: a pending receive sees end of file. The descriptors stay open (their
    owners close them). Returns how many were shut down."""
    ended = 0
    for fd in tcp_connections():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            ended += 1
        except OSError:
            pass
        finally:
            sock.close()
    return ended


# ------------------------------------------------------------------------------------------------
# Tearing the groups down and making the generation's group (the seam the tests drive).

_STORE_PREFIX = "default_pg"
"""The prefix torch's ``init_process_group`` puts before the keys of an ``env://`` group: a
survivor's regroup uses the same one, so it meets the replacement's unchanged call."""



@dataclasses.dataclass
class GroupOps:
    """How a process group is torn down and made: torch's functions, replaceable in tests."""

    abort: Callable[[], None] | None = None
    """Ends the default group without waiting for its work (NCCL); None: this torch has none."""
    destroy: Callable[[], None] = dist.destroy_process_group
    init: Callable[..., None] = dist.init_process_group
    end: Callable[[str], str] = end_groups
    """Ends every group of the process from the monitor thread, while the main thread may
    wait in one (:func:`end_groups`); returns how."""
    health: Callable[[float, ArmedDevice], str | None] = device_health
    """Why the rank's device is unfit to rejoin, or None
    (:func:`elasticft.recovery.health.device_health`: the time limit, the armed device)."""

    @classmethod
    def for_torch(cls) -> GroupOps:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        return cls(abort=abort if callable(abort) else None)


def tear_down(backend: str, ops: GroupOps, device: int | None = None) -> str:
    """Ends this process's process groups; returns how (for the log).

    NCCL: the communicators are aborted first, which returns while their kernels still wait
    for the dead peer (a plain destroy would wait for them); the CUDA streams then hold no
    NCCL work, and the caching allocator frees the blocks those kernels used once their
    streams are synchronised. Gloo's destroy closes its sockets, which also ends the waits of
    peers that are still inside a collective with this process.
    """
    if "nccl" in backend.lower() and ops.abort is not None:
        ops.abort()
        if dist.is_initialized():
            ops.destroy()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize(device)  # the rank's: this may run in a helper thread
        return "abort"
    ops.destroy()
    return "destroy"


def regroup(backend: str, rank: int, generation: Generation, timeout_s: float,
            ops: GroupOps, settings: GroupSettings | None = None) -> None:
    """Joins the generation's group (same backend, rank and world size, and the ``timeout``,
    ``device_id`` and ``pg_options`` the script gave its own group: ``settings``); rank 0 hosts
    the store when no agent does, and waits there for the others as torch's ``env://`` store
    does."""
    os.environ["MASTER_ADDR"] = generation.master_addr
    os.environ["MASTER_PORT"] = str(generation.master_port)
    hosts = not generation.agent_store and rank == 0
    store = dist.TCPStore(generation.master_addr, generation.master_port,
                          world_size=generation.world_size, is_master=hosts,
                          timeout=timedelta(seconds=timeout_s), multi_tenant=hosts)
    kwargs = settings.init_kwargs() if settings is not None else {}
    ops.init(backend, store=dist.PrefixStore(_STORE_PREFIX, store), rank=rank,
             world_size=generation.world_size, **kwargs)
