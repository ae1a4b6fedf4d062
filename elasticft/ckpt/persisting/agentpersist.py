"""The agent's persister: the step every local worker holds, written, committed and backed up.

Every monitor tick the agent peeks at its slots' headers (:mod:`elasticft.ckpt.memory.nodeslots`);
when all local workers hold a complete snapshot of a step due for persistence
(``ckpt_persist_every``), :class:`AgentPersister` runs the persist pipeline
(:mod:`elasticft.ckpt.persisting.pipeline`) for the node on its background thread:

* **Take.** Where a worker keeps three usable slots, its snapshot is read in place and its slot
  stays locked until written: the worker needs only the newest complete snapshot and one slot
  to write, so the slot being written costs it nothing, and the write needs no second copy of
  gigabytes in the agent's memory. With two, each snapshot is copied out first, into a
  staging buffer of its local rank (a worker overwrites its older slot within two steps, long
  before another rank's shard is on disk), and the slot is locked for that copy only. A step
  the workers overwrote since it was picked gives way to the newest one they all hold.
* **Write and commit.** The shards go to the node's local directory and the remote one. The
  local directory commits the step once this node's ranks are durable (every rank on a single
  node); the leader commits the shared remote directory once every node's shards landed,
  looked at again every :data:`REMOTE_RETRY_S`. Only the newest ``ckpt_keep`` steps stay.
* **Back up.** The step's shards go to the node's backup node (:mod:`elasticft.ckpt.backup.peer`).

Every persist is a ``checkpoint`` event (step, bytes, seconds, cause). The failure flush
(:mod:`elasticft.ckpt.persisting.flush`), the final state and "checkpoint now" persist through the
same :meth:`AgentPersister.persist`, one at a time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from elasticft.addon.api import GroupInfo
from elasticft.ckpt.api import CheckpointError, Snapshot, StorageFull
from elasticft.ckpt.memory.nodeslots import NodeSlots
from elasticft.ckpt.persisting import durable, pipeline
from elasticft.ckpt.persisting.places import NodePlaces
from elasticft.config import CheckpointConfig

logger = logging.getLogger(__name__)

REMOTE_RETRY_S = 1.0
"""How often the leader looks again at a step the shared directory waits for other nodes'
shards of."""
COPY_DELAY_ENV = "EFT_TEST_CKPT_COPY_DELAY_S"
"""Test seam: seconds a persist holds the slots it reads, as a copy or a disk write of many
gigabytes would: added to every copy out of a slot (two slots), or once all of a step's slots
are held for a write straight from them (three). Tests make the persister slow with a small
state this way.
Not an ``ELASTICFT_`` name: those are options, and an unknown one is refused."""

Emit = Callable[..., None]
"""Emits an event into the agent's event log: ``emit(group, kind, **payload)``."""


class AgentPersister:
    """Persists the local workers' snapshots of a step, one persist at a time."""

    def __init__(self, config: CheckpointConfig, slots: NodeSlots, places: NodePlaces,
                 emit: Emit, replicate: Callable[[int, GroupInfo], None], *,
                 copy_delay_s: float = 0.0) -> None:
        self.config = config
        self.slots = slots
        self.places = places
        self._emit = emit
        self._replicate = replicate
        self.persisted = -1
        """The newest step persisted (-1: none)."""
        self._lock = threading.Lock()
        self._staging: dict[int, pipeline.StagingBuffer] = {}
        self._storage_full_reported = False
        self._remote = pipeline.PendingCommits(config.ckpt_keep)
        self._copy_delay_s = copy_delay_s
        """See :data:`COPY_DELAY_ENV`."""
        self._thread = pipeline.PersistThread(self._commit_remote, self._remote.waiting,
                                              REMOTE_RETRY_S)

    @property
    def busy(self) -> bool:
        """Whether a periodic persist waits or runs."""
        return self._thread.busy

    def tick(self, group: GroupInfo) -> None:
        """Starts a periodic persist in the background when a step is due and none runs."""
        every = self.config.ckpt_persist_every
        if every <= 0 or self._thread.busy:
            return
        step = self.step_to_persist(group, every)
        if step is not None:
            self._thread.offer(lambda: self.persist(step, group, cause="periodic"))

    def step_to_persist(self, group: GroupInfo, every: int) -> int | None:
        """The step due for persistence: a multiple of ``every`` every local worker holds
        (every node picks the same one, so the shared directory's commit completes); else the
        newest step once a multiple was passed unseen (steps faster than the monitor tick)."""
        steps = self.slots.common_steps(group.workers)
        if not steps:
            return None
        newest = max(steps)
        if newest <= self.persisted or newest // every <= max(self.persisted, 0) // every:
            return None
        multiples = [s for s in steps if s % every == 0 and s > self.persisted]
        return max(multiples) if multiples else newest

    def persist(self, step: int, group: GroupInfo, *, cause: str = "") -> bool:
        """Writes the local workers' snapshots of ``step`` to disk, commits, replicates. A
        ``step`` the workers have overwritten since it was picked gives way to the newest one
        they all hold. ``cause`` goes in the event."""
        with self._lock:
            if step <= self.persisted:
                return True
            started = time.monotonic()
            with contextlib.ExitStack() as held:  # slots read in place stay locked till written
                taken = self._take_newest(step, group, held)
                if taken is None:
                    return False
                step, copies = taken
                # One INFO line per periodic persist (below); a flush's steps are told.
                logger.log(logging.DEBUG if cause == "periodic" else logging.INFO,
                           "took step %d out of shared memory in %.2f s (%s)", step,
                           time.monotonic() - started, cause or "persist")
                if not self._write(step, group, copies, started, cause):
                    return False
            self._replicate(step, group)
            return True

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No persist runs while this is held (one in flight ends first)."""
        with self._lock:
            yield

    def forget_pending_after(self, step: int) -> None:
        """Steps after ``step`` waiting for their commit in the remote directory never get
        it: a rollback rejected them."""
        self._remote.forget_after(step)

    def close(self, timeout_s: float = 600.0) -> None:
        """Finishes the persist queued and stops the thread."""
        self._thread.close(timeout_s)

    def drain_remote(self, timeout_s: float) -> None:
        """Gives the other nodes' final shards up to ``timeout_s`` to land in the shared
        directory, committing each step as it completes."""
        self._remote.drain(timeout_s)

    def _write(self, step: int, group: GroupInfo, copies: Mapping[int, Snapshot],
               started: float, cause: str) -> bool:
        """The disk part of :meth:`persist` (under its lock)."""
        roots = [self.places.local_dir(group)]
        if self.config.ckpt_remote_dir is not None:
            roots.append(self.config.ckpt_remote_dir)
        try:
            nbytes = pipeline.write_shards(roots, copies.values())
            self._commit(step, group)
        except StorageFull as e:
            if not self._storage_full_reported:
                logger.error("checkpoint step %d not persisted: %s", step, e)
                self._storage_full_reported = True
            return False
        except (CheckpointError, OSError) as e:
            logger.error("checkpoint step %d not persisted: %s", step, e)
            return False
        self.persisted = max(self.persisted, step)  # a rollback may have raised it
        seconds = time.monotonic() - started
        logger.info("persisted checkpoint step %d (%.1f MB) in %.2f s", step, nbytes / 1e6,
                    seconds)
        self._emit(group, "checkpoint", step=step, bytes=nbytes, seconds=round(seconds, 3),
                   cause=cause or "persist")
        return True

    def _take_newest(self, step: int, group: GroupInfo, held: contextlib.ExitStack
                     ) -> tuple[int, dict[int, Snapshot]] | None:
        """Every local worker's snapshot of ``step`` (see :meth:`_take`), else of the newest
        step they all hold now: with steps faster than a tick the one picked may already be
        overwritten, which is no error. None when no newer step than the last persisted is
        held."""
        for _ in range(3):
            try:
                with contextlib.ExitStack() as attempt:  # an attempt that fails holds nothing
                    copies = self._take(step, group, attempt)
                    held.enter_context(attempt.pop_all())
                return step, copies
            except CheckpointError as e:
                newest = self.slots.newest_common_step(group.workers)
                if newest is None or newest <= self.persisted:
                    logger.debug("step %d not persisted: %s", step, e)
                    return None
                step = newest
        logger.info("no step held by every local worker long enough to copy; trying later")
        return None

    def _take(self, step: int, group: GroupInfo,
              held: contextlib.ExitStack) -> dict[int, Snapshot]:
        """Every local worker's snapshot of ``step`` (by global rank), readable until ``held``
        closes: in place where the worker keeps three usable slots, else copied out."""
        copies = {}
        in_place = False
        for worker in group.workers:
            slots = self.slots.slot_set(worker.local_rank)
            taken = pipeline.take(
                slots, step, worker.global_rank, held,
                lambda rank=worker.local_rank: self._staging.setdefault(
                    rank, pipeline.StagingBuffer()),
                in_place=lambda slot, slots=slots: self.slots.usable(slots, slot) >= 3,
                delay_s=self._copy_delay_s)
            if taken is None:
                raise CheckpointError(
                    f"local rank {worker.local_rank} no longer holds step {step}", "missing")
            copies[worker.global_rank], read_in_place = taken
            in_place |= read_in_place
        if in_place and self._copy_delay_s:
            time.sleep(self._copy_delay_s)
        return copies

    def _commit(self, step: int, group: GroupInfo) -> None:
        world = group.workers[0].world_size if group.workers else 0
        local_ranks = [w.global_rank for w in group.workers]
        local = self.places.local_dir(group)
        single = group.group_world_size <= 1
        durable.try_commit(local, step, world, range(world) if single else local_ranks)
        durable.retain(local, self.config.ckpt_keep)
        remote = self.config.ckpt_remote_dir
        if remote is not None and group.group_rank == 0:
            # The leader commits the shared directory once every node's shards landed; other
            # nodes may still be writing, so this is retried instead of waited for.
            self._remote.add(step, [Path(remote)], world)
            self._remote.commit()

    def _commit_remote(self) -> None:
        with self._lock:
            self._remote.commit()
