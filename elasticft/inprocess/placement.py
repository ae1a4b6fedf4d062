"""Which GPU each process of a node uses while its workers recover in process: the workers',
the spare's, a replacement's.

torch's agent gives local rank k the k-th GPU the workers see, and the script picks its device
by ``LOCAL_RANK``; a full restart keeps it so. In-process recovery moves processes between GPUs
without a restart:

* a **spare** (:mod:`elasticft.inprocess.spare_keeper`) runs on a GPU no worker uses (the only one
  it sees); when it takes rank k, that GPU becomes k's, and the one k's dead worker used is
  free: the next spare goes there, never on a GPU a worker uses;
* a **replacement** process is rank k's by its environment, so its device is the k-th GPU,
  whatever GPU k's dead worker used. It starts only where that GPU is free of any live
  worker. A spare still in its set-up that holds the GPU gives it up (it is stopped; the next
  one goes on the GPU that was freed); a GPU another rank's worker runs on, since a spare took
  that rank, gets no replacement.
* a GPU whose worker died of a **device fault** (a CUDA error, an uncorrectable ECC error, a
  failed health check) gets no process for the rest of the attempt: the failure is not
  recovered in process on it, and the policy's restart or eviction decides instead, with that
  reason in the event log.

:class:`GpuUse` is the node's state; the decisions (:func:`spare_gpu`, :func:`unplaced`,
:func:`replacement_gpu`) and its changes (:func:`taken`, :func:`restarted`) are pure
functions of it. On a node without GPUs everything is allowed and nothing is tracked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from elasticft.addon.classify import device_fault


@dataclasses.dataclass(frozen=True)
class GpuUse:
    """The GPUs of a node and the processes that use them."""

    gpus: tuple[str, ...]
    """The GPUs the workers see, in order (``CUDA_VISIBLE_DEVICES``); empty: a CPU node."""
    workers: Mapping[int, str]
    """Local rank → the GPU its live worker uses."""
    spare: str | None = None
    """The GPU of the running spare (None: no spare)."""
    faulty: frozenset[str] = frozenset()
    """GPUs whose worker died of a device fault in this attempt."""

    @classmethod
    def start(cls, gpus: Sequence[str], local_ranks: Iterable[int]) -> GpuUse:
        """A (re)start of the workers: local rank k on the k-th GPU."""
        return cls(tuple(gpus), {lr: gpus[lr] for lr in local_ranks if lr < len(gpus)})

    def in_use(self) -> set[str]:
        return {*self.workers.values(), *([self.spare] if self.spare else [])}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a failed rank's replacement process goes."""

    gpu: str | None
    """Its GPU ("" on a CPU node); None: no replacement in process (``reason`` says why)."""
    reason: str
    stop_spare: bool = False
    """The spare, still in its set-up, holds that GPU: it is stopped first."""


def spare_gpu(use: GpuUse) -> tuple[str | None, str]:
    """The GPU a new spare uses, and why (pure): the first GPU that no worker uses and none
    died on, which after a spare took a rank is the one that rank's dead worker freed. None:
    every usable GPU runs a rank; "": a CPU node."""
    if not use.gpus:
        return "", "no GPU on this node"
    free = [g for g in use.gpus if g not in use.workers.values() and g not in use.faulty]
    if not free:
        faulty = f", {len(use.faulty)} failed" if use.faulty else ""
        return None, (f"every GPU of this node runs a rank ({len(use.gpus)} GPUs, "
                      f"{len(use.workers)} workers{faulty}): a spare would hold its copy of a "
                      f"rank's state on that rank's GPU")
    return free[0], f"GPU {free[0]}, which no worker uses"


def replacement_gpu(use: GpuUse, local_rank: int, device_fault: bool) -> Placement:
    """Where the replacement of ``local_rank``, whose worker died (of a fault of its GPU when
    ``device_fault``), may start (pure): the GPU its environment names (the ``local_rank``-th),
    when no live worker of another rank uses it and it is not faulty."""
    if not use.gpus:
        return Placement("", "no GPU on this node")
    dead_gpu = use.workers.get(local_rank)
    faulty = use.faulty | ({dead_gpu} if device_fault and dead_gpu else set())
    if local_rank >= len(use.gpus):
        return Placement(None, f"local rank {local_rank} has no GPU of its own "
                               f"({len(use.gpus)} GPUs)")
    gpu = use.gpus[local_rank]
    if gpu in faulty:
        return Placement(None, f"GPU {gpu}, which local rank {local_rank}'s replacement would "
                               f"use, failed (its worker died of a device fault): no process "
                               f"is started on it in this attempt")
    holders = [lr for lr, g in use.workers.items() if g == gpu and lr != local_rank]
    if holders:
        return Placement(None, f"GPU {gpu}, which local rank {local_rank}'s replacement would "
                               f"use, runs local rank {holders[0]} (a spare took that rank)")
    if use.spare == gpu:
        return Placement(gpu, f"GPU {gpu}, given up by the spare still in its set-up",
                         stop_spare=True)
    return Placement(gpu, f"GPU {gpu}, freed by its dead worker" if dead_gpu == gpu
                     else f"GPU {gpu}, which no process uses")


def taken(use: GpuUse, local_rank: int, device_fault: bool = False) -> GpuUse:
    """The spare took ``local_rank``: its GPU is the rank's now; the dead worker's is free, or
    out of use where it faulted (``device_fault``)."""
    if not use.gpus or use.spare is None:
        return use
    dead_gpu = use.workers.get(local_rank)
    faulty = use.faulty | ({dead_gpu} if device_fault and dead_gpu else set())
    return dataclasses.replace(use, workers={**use.workers, local_rank: use.spare}, spare=None,
                               faulty=frozenset(faulty))


def restarted(use: GpuUse, local_rank: int, device_fault: bool = False) -> GpuUse:
    """A replacement process runs ``local_rank`` (on the GPU its environment names); a dead
    worker's GPU that faulted stays out of use."""
    if not use.gpus:
        return use
    dead_gpu = use.workers.get(local_rank)
    faulty = use.faulty | ({dead_gpu} if device_fault and dead_gpu else set())
    workers = dict(use.workers)
    if local_rank < len(use.gpus):
        workers[local_rank] = use.gpus[local_rank]
    return dataclasses.replace(use, workers=workers, faulty=frozenset(faulty))


def device_faults(failures: Iterable[tuple[int, str]]) -> dict[int, bool]:
    """Local rank → whether its worker died of a fault of its GPU, from what each of its
    failures says (``(local rank, text)``: the error, the message, its ``left`` record)."""
    faults: dict[int, bool] = {}
    for local_rank, text in failures:
        faults[local_rank] = faults.get(local_rank, False) or device_fault(text)
    return faults


def unplaced(use: GpuUse, replace: Sequence[int], faults: Mapping[int, bool],
             spare_takes: int | None = None) -> tuple[int, str] | None:
    """The first of ``replace`` whose replacement has no GPU to start on (its worker's faulted,
    or another rank's worker uses the one its environment names), with why, or None; the rank
    the ready spare takes (``spare_takes``) needs none."""
    for local_rank in replace:
        if local_rank == spare_takes:
            continue
        where = replacement_gpu(use, local_rank, faults.get(local_rank, False))
        if where.gpu is None:
            return local_rank, where.reason
    return None
