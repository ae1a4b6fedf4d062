"""A worker's process groups as in-process recovery sees them: what the script asked of its
default group, and how every group of the process is ended while a call may still wait in it.

**What the script asked for** (:class:`GroupSettings`): the ``timeout``, the ``device_id``
(NCCL's eager init, bound to one device) and the ``pg_options`` the script passed to
``init_process_group``. They are read back from the live default group when recovery arms
(torch keeps them on the group and its backend), so the regroup after a failure makes the same
group again: a hang after a recovery is found within the script's timeout, not torch's default.

**What the recovery keeps of the group** (:class:`ArmedGroup`): the backend, the rank, the
world size, those settings and the rank's device, taken once when recovery arms and carried
through regroups. After a failure the recovery reads nothing of torch's table of groups, which
an abort of the default group clears.

**Ending every group** (:func:`end_groups`): one sequence of calls on every backend, so the
code a GPU job runs is the code the CPU tests run. Every group in torch's table (the default
group, ``new_group`` groups, a ``DeviceMesh``'s groups) is aborted through torch's
``_abort_process_group``, the default group last, whose abort clears the table
(:func:`abort_groups`). What differs per backend is only what makes a pending wait return. On
NCCL the abort ends the communicators' kernels without waiting for the dead peer. Gloo's abort
returns at once and leaves a pending collective waiting (measured on torch 2.13: an
``allreduce`` with a silent peer returned only when that peer's process ended); its wait is on
the group's TCP connections, so the survivor shuts down its own ends of the connections those
groups made, recorded when they were made (:mod:`elasticft.diag.groupsockets`): gloo's receive
sees end of file and the collective raises "connection closed", which the recovery handles like
any peer failure. The script's other connections are left alone. ``end_groups`` is the one
place where torch's revocation of a group in place can take over once a release has it.

**Tearing down and regrouping** (:class:`GroupOps`, :func:`tear_down`, :func:`regroup`): torch's
functions behind one seam the tests replace; the regroup joins the next generation's store
(:class:`elasticft.inprocess.protocol.Generation`) with what the script asked for.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elasticft.diag import groupsockets
from elasticft.inprocess.device import ArmedDevice, device_health
from elasticft.inprocess.protocol import Generation

logger = logging.getLogger(__name__)

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


@dataclasses.dataclass(frozen=True)
class ArmedGroup:
    """What the in-process path needs of the script's default group, taken from torch once, when
    recovery arms. After a failure torch's table of groups may be gone (an abort of the default
    group clears it), so the recovery reads none of this from torch then."""

    backend: str
    rank: int
    world_size: int
    settings: GroupSettings

    @classmethod
    def of_default_group(cls) -> ArmedGroup | None:
        """Read from the live default group (None when there is none)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        backend = str(dist.get_backend())
        return cls(backend, dist.get_rank(), dist.get_world_size(),
                   GroupSettings.of_default_group())

    def moved(self, rank: int, world_size: int) -> ArmedGroup:
        """The same group's facts after a regroup as ``rank`` of ``world_size``."""
        return dataclasses.replace(self, rank=rank, world_size=world_size)


def process_groups() -> list[Any]:
    """Every process group of this process in torch's table, the default one last."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    default = dist.distributed_c10d._get_default_group()
    others = [g for g in dist.distributed_c10d._world.pg_map if g is not default]
    return [*others, default]


_ended: list[Any] = []
"""The groups :func:`abort_groups` took out of torch's table, held until :func:`release_ended`."""


def abort_groups() -> str:
    """Aborts every process group in torch's table through torch
    (``_abort_process_group``), the others first and the default group last: its abort aborts
    what is left and clears torch's table (``dist.is_initialized()`` is False after it). The
    same calls on every backend: on NCCL they end the communicators' kernels without waiting
    for a dead peer; gloo's abort returns at once and leaves a pending wait in place
    (:func:`end_groups` ends it). The groups are held here until :func:`release_ended`.
    Returns what was done, for the log."""
    groups = process_groups()
    _ended.extend(groups)
    abort = dist.distributed_c10d._abort_process_group
    aborted = 0
    for group in groups:
        try:
            abort(group)
            aborted += 1
        except Exception as e:  # one group's abort must not keep the others alive
            logger.warning("aborting a process group failed: %s", e)
    initialized = dist.is_available() and dist.is_initialized()
    return f"abort({aborted} of {len(groups)} groups, default last; is_initialized() " \
           f"{initialized} after)"


def release_ended() -> int:
    """Lets go of the groups :func:`abort_groups` ended; returns how many it held. Called once
    the failed call's frames are cleared, so that this handle is a group's last holder.

    torch's handle of a group releases the GIL while it destroys the group; a DDP's reducer,
    the other holder of a script's group, does not. A gloo group's destructor joins its worker
    threads, and a worker thread freeing a finished collective takes the GIL (its thread-local
    state holds a Python object): destroyed by the reducer, with the GIL held, the two wait on
    each other for ever (seen on torch 2.13, a survivor stuck in ``~ProcessGroupGloo`` under
    ``~Reducer`` until the agent killed it)."""
    held = 0
    while _ended:
        _ended.pop()  # the group dies here, if nothing else holds it
        held += 1
    return held


def end_groups(backend: str, waiting: Callable[[], bool] = lambda: True) -> str:
    """Ends every process group of this process while a call may wait in one; returns how (for
    the log). Safe from a thread other than the one blocked in a collective.

    The groups are aborted the same way on every backend (:func:`abort_groups`); what makes a
    pending wait return is the backend's part: on NCCL the abort itself, on gloo a shutdown of
    the connections those groups made (:mod:`elasticft.diag.groupsockets`). Nothing is shut down
    once ``waiting()`` says the main thread left the call by itself. This function is the one
    seam where torch's revocation of a group in place can take over once a release has it."""
    how = abort_groups()
    if "gloo" not in backend.lower():
        return how
    recording = groupsockets.installed()
    if recording is None:
        return f"{how}+no sockets recorded"
    if not waiting():
        return f"{how}+nothing shut down (the call returned by itself)"
    shut, recorded = recording.shut_down()
    return f"{how}+shutdown({shut} of {recorded} recorded group sockets)"


# ------------------------------------------------------------------------------------------------
# Tearing the groups down and making the generation's group (the seam the tests drive).

_STORE_PREFIX = "default_pg"
"""The prefix torch's ``init_process_group`` puts before the keys of an ``env://`` group: a
survivor's regroup uses the same one, so it meets the replacement's unchanged call."""



def destroy_registered() -> None:
    """Destroys the process groups still in torch's table (none after an abort of the default
    group, which cleared it)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@dataclasses.dataclass
class GroupOps:
    """How a process group is torn down and made: torch's functions, replaceable in tests."""

    abort: Callable[[], str | None] | None = None
    """Aborts every group without waiting for its work (:func:`abort_groups`); None: this torch
    has no ``_abort_process_group``."""
    destroy: Callable[[], None] = destroy_registered
    init: Callable[..., None] = dist.init_process_group
    end: Callable[[str, Callable[[], bool]], str] = end_groups
    """Ends every group of the process from the monitor thread, while the main thread may
    wait in one (:func:`end_groups`: the backend, and whether the main thread still waits);
    returns how."""
    health: Callable[[float, ArmedDevice], str | None] = device_health
    """Why the rank's device is unfit to rejoin, or None
    (:func:`elasticft.inprocess.device.device_health`: the time limit, the armed device)."""

    @classmethod
    def for_torch(cls) -> GroupOps:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        return cls(abort=abort_groups if callable(abort) else None)


def tear_down(backend: str, ops: GroupOps, device: int | None = None) -> str:
    """Ends this process's process groups; returns how (for the log).

    The same calls on every backend: every group still in torch's table is aborted
    (:func:`abort_groups`; none when the monitor's end already did, which cleared the table),
    then what is still registered is destroyed. On NCCL the abort returns while the
    communicators' kernels still wait for the dead peer (a plain destroy would wait for them);
    the CUDA streams then hold no NCCL work, and the caching allocator frees the blocks those
    kernels used once their streams are synchronised. A gloo group closes its sockets once
    nothing holds it (:func:`elasticft.inprocess.worker._release`), which also ends the waits
    of peers that are still inside a collective with this process.
    """
    how = "destroy"
    if ops.abort is not None:
        how = ops.abort() or "abort"
    ops.destroy()
    release_ended()
    if ("nccl" in backend.lower() and ops.abort is not None
            and torch.cuda.is_available() and torch.cuda.is_initialized()):
        torch.cuda.synchronize(device)  # the rank's: this may run in a helper thread
    return how


def regroup(backend: str, rank: int, generation: Generation, timeout_s: float,
            ops: GroupOps, settings: GroupSettings | None = None) -> None:
    """Joins the generation's group (same backend, rank and world size, and the ``timeout``,
    ``device_id`` and ``pg_options`` the script gave its own group: ``settings``), in the
    store an agent hosts, every rank a client of it."""
    os.environ["MASTER_ADDR"] = generation.master_addr
    os.environ["MASTER_PORT"] = str(generation.master_port)
    store = dist.TCPStore(generation.master_addr, generation.master_port,
                          world_size=generation.world_size, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    kwargs = settings.init_kwargs() if settings is not None else {}
    ops.init(backend, store=dist.PrefixStore(_STORE_PREFIX, store), rank=rank,
             world_size=generation.world_size, **kwargs)
