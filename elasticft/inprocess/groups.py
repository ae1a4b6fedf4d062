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
group, ``new_group`` groups, a ``DeviceMesh``'s groups) is aborted at once, a thread per group
(:func:`abort_groups`): with TP and DP, HSDP or a pipeline, one communicator's
``ncclCommAbort`` can wait (a device-wide synchronisation) behind another communicator's kernel
that still waits for the dead peer, and that kernel ends only when its own abort begins
(NVIDIA/nccl#1013, pytorch#119797); one abort after another would wait for ever. Once every
abort returned, torch's ``_abort_process_group`` of the default group clears torch's table.
What differs per backend is only what makes a pending wait return, decided per group from its
own backends (:func:`waits_on_gloo`: a ``new_group(backend="gloo")`` of an NCCL job, a
``"cpu:gloo,cuda:nccl"`` default group, a default group made with no backend). On NCCL the
abort ends the communicators' kernels without waiting for the dead peer. Gloo's abort returns
at once and leaves a pending collective waiting (measured on torch 2.13: an ``allreduce`` with
a silent peer returned only when that peer's process ended); its wait is on the group's TCP
connections, so the survivor shuts down its own ends of the connections those groups made,
recorded when they were made (:mod:`elasticft.diag.groupsockets`): gloo's receive sees end of
file and the collective raises "connection closed", which the recovery handles like any peer
failure. The script's other connections are left alone. ``end_groups`` is the one place where
torch's revocation of a group in place can take over once a release has it.

**Tearing down and regrouping** (:class:`GroupOps`, :func:`tear_down`, :func:`regroup`): torch's
functions behind one seam the tests replace; the regroup joins the next generation's store
(:class:`elasticft.inprocess.protocol.Generation`) with what the script asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elasticft.diag import groupsockets
from elasticft.inprocess import reconfigure
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
        # The configuration, not get_backend(): a group made with no backend says "undefined"
        # there and "cpu:gloo,cuda:nccl" here.
        backend_name = backend_config(group).lower()
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

ABORT_LIMIT_S = 30.0
"""How long :func:`abort_groups` waits for the groups' aborts unless told (the default of
``--recovery-inprocess-teardown-limit-s``; the worker passes its own)."""


def waits_on_gloo(configs: Iterable[str]) -> bool:
    """Whether any of these groups' backends is gloo, whose abort leaves a pending wait in place
    (pure). ``configs`` are torch's backend configurations of the groups
    (``dist.get_backend_config(group)``: ``"cpu:gloo"``, ``"cuda:nccl"``,
    ``"cpu:gloo,cuda:nccl"``; a default group made with no backend reads ``"cpu:gloo"`` or
    ``"cpu:gloo,cuda:nccl"`` there, while ``get_backend()`` says ``"undefined"``). Decided per
    group, not from the default group's backend string: an NCCL job's
    ``new_group(backend="gloo")`` waits on its sockets too."""
    return any("gloo" in config.lower() for config in configs)


def backend_config(group: Any) -> str:
    """torch's backend configuration of ``group`` (``""`` when torch has none for it)."""
    try:
        return str(dist.get_backend_config(group))
    except Exception:  # a group torch no longer knows
        return ""


def abort_backends(group: Any) -> None:
    """Aborts ``group``'s backends (``ProcessGroup.abort``: on NCCL every communicator of the
    group, without waiting for the dead peer), leaving torch's table to :func:`abort_groups`."""
    group.abort()


@dataclasses.dataclass(frozen=True)
class Aborts:
    """What :func:`abort_concurrently` saw: how many aborts returned, failed, or still ran."""

    returned: int
    failed: int
    running: int

    @property
    def finished(self) -> bool:
        return self.running == 0


def abort_concurrently(groups: Sequence[Any], abort: Callable[[Any], None],
                       limit_s: float) -> Aborts:
    """Calls ``abort(group)`` for every group at once, a daemon thread each, and waits until
    every call returned or ``limit_s`` passed. A call that raises is logged and counted; one
    that still runs at the limit is left to its thread (the caller's hard limit decides what
    becomes of the process)."""
    failed: list[BaseException] = []

    def one(group: Any) -> None:
        try:
            abort(group)
        except Exception as e:  # one group's abort must not keep the others alive
            logger.warning("aborting a process group failed: %s", e)
            failed.append(e)

    threads = [threading.Thread(target=one, args=(group,), daemon=True,
                                name=f"elasticft-abort-{i}") for i, group in enumerate(groups)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + limit_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    running = sum(thread.is_alive() for thread in threads)
    return Aborts(len(threads) - running - len(failed), len(failed), running)


@dataclasses.dataclass(frozen=True)
class Ended:
    """What :func:`end_all` did: the aborts, whether a group waits on gloo, and torch's table."""

    groups: int
    aborts: Aborts
    gloo: bool
    """Whether any of the ended groups has a gloo backend (:func:`waits_on_gloo`)."""
    cleared: bool
    """Whether torch's table was cleared (``dist.is_initialized()`` False after)."""

    def describe(self) -> str:
        running = (f", {self.aborts.running} still aborting at the limit"
                   if self.aborts.running else "")
        return (f"abort({self.aborts.returned} of {self.groups} groups at once{running}; "
                f"is_initialized() {not self.cleared} after)")


def end_all(abort: Callable[[Any], None] = abort_backends,
            limit_s: float = ABORT_LIMIT_S) -> Ended:
    """Aborts every process group in torch's table at once (:func:`abort_concurrently`, the
    default group's backends among them), then, once every abort returned, clears torch's
    table through torch (``_abort_process_group`` of the default group: it aborts each group
    again inside NCCL's group semantics, where torch's ``NCCLComm::abort`` returns at once for a
    communicator it already aborted ("Should not abort twice"), and clears the table:
    ``dist.is_initialized()`` is False after). The default group's own abort must not wait for
    the others (its communicator's kernel may be the one another abort waits behind), and the
    clearing must come after them: ``_abort_process_group`` of a group deletes its entries from
    the table while the default's iterates it. When an abort still runs at the limit the table
    is left as it is (clearing it would wait behind that abort). The same calls on every
    backend; the groups are held until :func:`release_ended`."""
    groups = process_groups()
    configs = [backend_config(group) for group in groups]
    _ended.extend(groups)
    aborts = abort_concurrently(groups, abort, limit_s)
    # A default group in the reconfigure regime is kept in the table: rebuilt in place.
    if aborts.finished and groups and dist.is_initialized() and reconfigure.active() is None:
        try:
            dist.distributed_c10d._abort_process_group(groups[-1])
        except Exception as e:
            logger.warning("clearing torch's table of process groups failed: %s", e)
    cleared = not (dist.is_available() and dist.is_initialized())
    return Ended(len(groups), aborts, waits_on_gloo(configs), cleared)


def abort_groups(abort: Callable[[Any], None] = abort_backends,
                 limit_s: float = ABORT_LIMIT_S) -> str:
    """Aborts every process group (:func:`end_all`); returns what was done, for the log. On
    NCCL the aborts end the communicators' kernels without waiting for a dead peer; gloo's
    abort returns at once and leaves a pending wait in place (:func:`end_groups` ends it)."""
    return end_all(abort, limit_s).describe()


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


def end_groups(backend: str, waiting: Callable[[], bool] = lambda: True,
               abort: Callable[[Any], None] = abort_backends,
               limit_s: float = ABORT_LIMIT_S) -> str:
    """Ends every process group of this process while a call may wait in one; returns how (for
    the log). Safe from a thread other than the one blocked in a collective.

    The groups are aborted the same way on every backend (:func:`end_all`); what makes a
    pending wait return is the backend's part: on NCCL the abort itself, on gloo a shutdown of
    the connections those groups made (:mod:`elasticft.diag.groupsockets`), done when any
    ended group has a gloo backend (:func:`waits_on_gloo`, from the groups' own backends:
    ``backend``, the default group's as armed, is only logged). Nothing is shut down once
    ``waiting()`` says the main thread left the call by itself. This function is the one seam
    where torch's revocation of a group in place can take over once a release has it."""
    ended = end_all(abort, limit_s)
    how = ended.describe()
    if not ended.gloo:
        return how
    recording = groupsockets.installed()
    if recording is None:
        return f"{how}+no sockets recorded"
    if not waiting():
        return f"{how}+nothing shut down (the call returned by itself)"
    shut, recorded = recording.shut_down()
    logger.debug("gloo groups of a %s job: their connections shut down", backend)
    return f"{how}+shutdown({shut} of {recorded} recorded group sockets)"


# ------------------------------------------------------------------------------------------------
# Tearing the groups down and making the generation's group (the seam the tests drive).


def destroy_registered() -> None:
    """Destroys the process groups still in torch's table (none after an abort of the default
    group, which cleared it); a default group in the reconfigure regime stays, the others go."""
    regime = reconfigure.active()
    if regime is not None:
        reconfigure.end_subgroups(regime)
    elif dist.is_available() and dist.is_initialized():
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
    def for_torch(cls, limit_s: float = ABORT_LIMIT_S) -> GroupOps:
        """torch's functions; the groups' aborts wait at most ``limit_s`` (the teardown's hard
        limit)."""
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        return cls(abort=functools.partial(abort_groups, limit_s=limit_s)
                   if callable(abort) else None,
                   end=functools.partial(end_groups, limit_s=limit_s))


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
    # Whatever ``backend`` says ("undefined" for a group made with no backend, an NCCL side
    # group beside a gloo default one): a process with CUDA may hold aborted NCCL kernels.
    if ops.abort is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)  # the rank's: this may run in a helper thread
    return how


TORCH_RANK_HOOK = "_distributed_excepthook"
"""The name of the ``sys.excepthook`` torch's ``init_process_group`` puts on: it writes every
line of a traceback with ``[rank<r>]: `` before it, and calls the hook it found (``old_hook``)."""


def unwrap_rank_excepthook() -> None:
    """Takes torch's rank prefix off ``sys.excepthook``: every ``init_process_group`` wraps the
    hook it finds, so a regroup's would print ``[rank0]: [rank0]:`` (and an old rank after a
    reshape). The hook torch wrapped first is put back."""
    hook = sys.excepthook
    while getattr(hook, "__name__", "") == TORCH_RANK_HOOK:
        code = getattr(hook, "__code__", None)
        cells = dict(zip(code.co_freevars, getattr(hook, "__closure__", None) or (),
                         strict=False)) if code is not None else {}
        if "old_hook" not in cells:
            break
        hook = cells["old_hook"].cell_contents
    sys.excepthook = hook


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
    regime = reconfigure.active()
    if regime is not None:
        took = reconfigure.regroup_in_place(regime, store, rank, generation.world_size,
                                            timeout_s)
        logger.info("rank %d reconfigured in place into generation %d (%d ranks, %.3f s)", rank,
                    generation.generation, generation.world_size, took)
        return
    kwargs = settings.init_kwargs() if settings is not None else {}
    unwrap_rank_excepthook()  # the new group's init puts on one with this rank
    ops.init(backend, store=dist.PrefixStore(reconfigure.STORE_PREFIX, store), rank=rank,
             world_size=generation.world_size, **kwargs)
