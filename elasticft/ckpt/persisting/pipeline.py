"""The persist pipeline: snapshots out of shared memory, onto disk, committed.

A snapshot in a shared-memory slot becomes durable in three stages, run on one background
thread at low priority (:class:`PersistThread`), so neither training nor the agent's monitor
waits for a disk:

1. **Take** (:func:`take`). A rank's snapshot of the step is read under its slot's shared lock;
   the worker never waits for a reader, it writes another slot. Read in place, the slot stays
   locked until the shard is written; copied out, into a reused staging buffer with the GIL
   released, it is locked for that one memory copy.
2. **Write** (:func:`write_shards`). Each rank's shard goes to every directory (local, remote)
   as checksummed blobs that DCP reads (:func:`elasticft.ckpt.persisting.durable.write_rank_shard`).
3. **Commit** (:class:`PendingCommits`). The committer marks a step committed in a directory
   once every rank's shard of it is durable there, and keeps the newest ``keep``. Other
   writers may still be writing theirs, so a step waits and the thread looks at it again
   every ``retry_s`` until it commits or a newer step does: the next persist may never come
   (the run's last step, or a crash), and a step with every shard durable must not be lost.

Two persisters run it: the agent's (:mod:`elasticft.ckpt.persisting.agentpersist`), for the step all
of a node's workers hold, and a worker's own when no agent runs
(:mod:`elasticft.ckpt.persisting.persister`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy

from elasticft.ckpt.api import CheckpointError, Snapshot, StorageFull
from elasticft.ckpt.memory.shm import SlotSet, read_slot
from elasticft.ckpt.memory.slot import Slot
from elasticft.ckpt.persisting import diskfile, durable

logger = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 30.0
"""How long a take waits for a slot's shared lock (a worker holds it exclusively while it
copies a snapshot in)."""


class StagingBuffer:
    """A reusable private buffer for copying a snapshot out of its slot.

    Readers copy out so they hold a slot's lock for one memory copy only; reusing the buffer
    keeps that copy warm (a fresh allocation of hundreds of MB pays first-touch page faults,
    several times the cost of the copy itself).

    The copy releases the GIL: it runs on the agent's persist thread, and a copy of gigabytes
    holding the GIL (as memoryview slicing does) stalled the agent's monitor loop for seconds,
    so it saw a worker's death that much later. numpy's copy releases it and, unlike torch's,
    stays on one core instead of waking an intra-op thread pool beside training.
    """

    def __init__(self) -> None:
        self._buffer = numpy.empty(0, dtype=numpy.uint8)

    def copy_of(self, data: Any) -> memoryview:
        view = memoryview(data).cast("B")
        if len(self._buffer) < len(view):
            # Not bytearray(n): it zeroes every page holding the GIL (about a second a GB,
            # measured), which stalled the agent's loop in the middle of a failure. numpy's
            # empty buffer is faulted in by the copy below, which releases the GIL.
            self._buffer = numpy.empty(len(view), dtype=numpy.uint8)
        target = memoryview(self._buffer)[: len(view)]
        copy_unlocked(target, view)
        return target


def copy_unlocked(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` for byte views of equal length, without holding the GIL."""
    if len(src) < 1 << 20:
        dst[:] = src  # too short to matter; skips numpy's per-call cost
        return
    numpy.copyto(numpy.frombuffer(dst, dtype=numpy.uint8),
                 numpy.frombuffer(src, dtype=numpy.uint8))


def copy_out(slot: Slot, step: int, staging: StagingBuffer,
             delay_s: float = 0.0) -> Snapshot | None:
    """A private copy of the slot's snapshot of ``step``, taken under the slot's shared lock.

    The lock is held for one memory copy only, not for the disk write: the worker never waits
    for a reader, it takes another slot, so a long hold would tie up a slot. The copy releases
    the GIL and leaves page faults to itself (no ``madvise`` under the GIL), so the agent's
    monitor loop keeps running meanwhile. ``delay_s``: a test seam, seconds the lock is held
    longer (see :data:`elasticft.ckpt.persisting.agentpersist.COPY_DELAY_ENV`).
    """
    with slot.shared(timeout_s=LOCK_TIMEOUT_S) as locked:
        if not locked:
            return None
        snapshot = read_slot(slot, verify=False, prefault=False)
        if snapshot.step != step:
            return None  # overwritten between the peek and the lock
        copy = Snapshot(snapshot.manifest, staging.copy_of(snapshot.payload))
        if delay_s:
            time.sleep(delay_s)
        return copy


def hold(slot: Slot, step: int, held: contextlib.ExitStack) -> Snapshot | None:
    """The slot's snapshot of ``step`` in place, its shared lock held until ``held`` closes."""
    with contextlib.ExitStack() as locked:  # released here unless handed to ``held``
        if not locked.enter_context(slot.shared(timeout_s=LOCK_TIMEOUT_S)):
            return None
        snapshot = read_slot(slot, verify=False, prefault=False)
        if snapshot.step != step:
            return None  # overwritten between the peek and the lock
        held.enter_context(locked.pop_all())
        return snapshot


def take(slots: SlotSet, step: int, rank: int, held: contextlib.ExitStack,
         staging: Callable[[], StagingBuffer], *,
         in_place: Callable[[Slot], bool] = lambda slot: False,
         delay_s: float = 0.0) -> tuple[Snapshot, bool] | None:
    """``rank``'s snapshot of ``step`` from whichever of ``slots`` holds it complete, and
    whether it was read in place (then readable until ``held`` closes) rather than copied into
    ``staging()``. None when no slot holds it any more."""
    for index, header in slots.complete().items():
        slot = slots.get(index) if header.step == step and header.rank == rank else None
        if slot is None:
            continue
        read_in_place = in_place(slot)
        snapshot = (hold(slot, step, held) if read_in_place
                    else copy_out(slot, step, staging(), delay_s))
        if snapshot is not None:
            return snapshot, read_in_place
    return None


def write_shards(roots: Sequence[Path], copies: Iterable[Snapshot]) -> int:
    """Writes every snapshot's shard to every directory; the bytes of one copy of them."""
    total = 0
    for snapshot in copies:
        for root in roots:
            durable.write_rank_shard(root, snapshot)
        total += len(snapshot.payload)
    return total


class PendingCommits:
    """Steps written to a directory and not committed there yet, until every rank's shard is."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.world_size = 0
        self._pending: dict[Path, set[int]] = {}
        self._lock = threading.Lock()  # the persist thread asks; a flush or a request adds

    def add(self, step: int, roots: Iterable[Path], world_size: int) -> None:
        with self._lock:
            self.world_size = world_size
            for root in roots:
                self._pending.setdefault(root, set()).add(step)

    def waiting(self) -> bool:
        with self._lock:
            return any(self._pending.values())

    def forget_after(self, step: int) -> None:
        """Drops every pending step after ``step``."""
        with self._lock:
            for steps in self._pending.values():
                steps.difference_update([s for s in steps if s > step])

    def commit(self) -> None:
        """Commits every pending step whose ranks are all durable now; never waits."""
        with self._lock:
            world = self.world_size
            for root, steps in self._pending.items():
                if not steps:
                    continue
                try:
                    durable.commit_pending(root, steps, world, range(world), self.keep)
                except (CheckpointError, OSError) as e:
                    logger.error("committing in %s failed: %s", root, e)

    def drain(self, timeout_s: float) -> None:
        """Gives the other writers' last shards up to ``timeout_s`` to land, committing each
        step as it completes."""
        deadline = time.monotonic() + timeout_s
        while self.waiting() and time.monotonic() < deadline:
            self.commit()
            if self.waiting():
                time.sleep(0.1)


class PersistThread:
    """The background thread a persister writes on, at low priority, one job at a time.

    At most one job waits, the newest offered: a persister that is still writing skips the
    steps in between, never the newest (every rank then writes the last step it was offered,
    and the shared directory's commit of it completes). While ``waiting()`` says commits wait
    for other writers, ``retry`` runs every ``retry_s``.
    """

    def __init__(self, retry: Callable[[], None], waiting: Callable[[], bool],
                 retry_s: float) -> None:
        self._retry = retry
        self._waiting = waiting
        self._retry_s = retry_s
        self._jobs: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self._busy = threading.Event()
        self._offering = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="elasticft-ckpt-persist",
                                        daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a job waits or runs."""
        return self._busy.is_set()

    def offer(self, job: Callable[[], object]) -> None:
        """Queues ``job`` in place of one still waiting (a newer step supersedes it)."""
        with self._offering:
            try:
                if self._jobs.get_nowait() is None:  # closing: the stop stays, nothing more
                    self._jobs.put(None)
                    return
            except queue.Empty:
                pass
            self._busy.set()
            self._jobs.put(job)

    def close(self, timeout_s: float) -> None:
        """Finishes the job queued, then stops."""
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        diskfile.background_priority()
        while True:
            try:
                job = self._jobs.get(timeout=self._retry_s if self._waiting() else None)
            except queue.Empty:
                self._run(self._retry)
                continue
            if job is None:
                return
            self._run(job)
            if self._jobs.empty():
                self._busy.clear()

    @staticmethod
    def _run(job: Callable[[], object]) -> None:
        try:
            job()
        except StorageFull as e:
            logger.error("%s", e)
        except Exception:
            logger.exception("persisting failed")
