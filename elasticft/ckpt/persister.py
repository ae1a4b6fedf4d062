"""Process-owned persistence: a worker without an agent writes its own snapshots to disk.

Under ``elasticft-run`` the agent persists what its workers put in shared memory
(:mod:`elasticft.ckpt.service`). Under plain ``torchrun`` or in a single process nobody else
will, so the :class:`~elasticft.ckpt.checkpointer.Checkpointer` hands every
``persist_every``-th complete step to an :class:`OwnPersister`. It copies the slot once (holding
the slot's shared lock only for that memory copy), writes the rank's shard to the local and the
remote directory on a background thread at low priority, and rank 0 commits a step once every
rank's shard of it is durable. A step whose other shards are not on disk yet is looked at again
every :data:`COMMIT_RETRY_S` until it commits: the next persist may never come (the run's last
step, or a crash), and a step with every shard durable must not be lost.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from elasticft.ckpt import diskfile, durable
from elasticft.ckpt.api import Snapshot, StorageFull
from elasticft.ckpt.settings import WorkerSettings
from elasticft.ckpt.shm import SlotSet, StagingBuffer, read_slot

logger = logging.getLogger(__name__)

COMMIT_RETRY_S = 0.2
"""How often the committing rank looks again at a step that waits for other ranks' shards."""


class OwnPersister:
    """Writes a rank's complete memory snapshots to disk in the background; rank 0 commits."""

    def __init__(self, settings: WorkerSettings, slots: SlotSet, rank: int,
                 world_size: int) -> None:
        assert settings.local_dir is not None
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        # Its own file descriptors, never the writer's: flock is per open file, so sharing the
        # writer's would let the writer's exclusive lock silently convert this reader's shared one.
        self._slots = slots
        self._staging = StagingBuffer()
        self._jobs: queue.Queue[int | None] = queue.Queue()
        self._uncommitted: set[int] = set()
        self._uncommitted_in: dict[Path, set[int]] = {}
        self._thread = threading.Thread(target=self._loop, name="elasticft-ckpt-persist",
                                        daemon=True)
        self._thread.start()

    def offer(self, step: int) -> None:
        """``step`` is complete in memory: persisted if due and the writer is not busy."""
        every = self.settings.persist_every
        if every <= 0 or step % every:
            return
        if self._jobs.empty():  # one waiting at most: a busy writer skips a step
            self._jobs.put(step)

    def close(self, join_timeout_s: float = 300.0, commit_timeout_s: float = 10.0) -> None:
        """Finishes the writes queued; rank 0 then gives the other ranks' last shards a bounded
        time to land and commits them."""
        self._jobs.put(None)
        self._thread.join(timeout=join_timeout_s)
        if self.rank != 0:
            return
        deadline = time.monotonic() + commit_timeout_s
        while any(self._uncommitted_in.values()) and time.monotonic() < deadline:
            self._commit_pending()
            if any(self._uncommitted_in.values()):
                time.sleep(0.1)

    def _loop(self) -> None:
        diskfile.background_priority()
        while True:
            waiting = any(self._uncommitted_in.values())
            try:
                step = self._jobs.get(timeout=COMMIT_RETRY_S if waiting else None)
            except queue.Empty:
                self._commit_pending()
                continue
            if step is None:
                return
            try:
                self._persist(step)
            except StorageFull as e:
                logger.error("%s", e)
            except Exception:
                logger.exception("persisting step %d failed", step)

    def _persist(self, step: int) -> None:
        snapshot = self._copy_of(step)
        if snapshot is None:
            return
        for root in self._roots():
            durable.write_rank_shard(root, snapshot)
        if self.rank == 0:  # the committer
            self._uncommitted.add(step)
            self._commit_pending()

    def _copy_of(self, step: int) -> Snapshot | None:
        """This rank's snapshot of ``step``, copied out of its slot; None if no slot has it."""
        for index, header in self._slots.complete().items():
            if header.step != step:
                continue
            slot = self._slots.get(index)
            if slot is None:
                continue
            with slot.shared() as locked:
                if not locked:
                    continue
                snapshot = read_slot(slot, verify=False)
                if snapshot.step != step:
                    continue
                # Hold the lock for one memory copy, not for the disk write.
                return Snapshot(snapshot.manifest, self._staging.copy_of(snapshot.payload))
        return None

    def _roots(self) -> list[Path]:
        return [r for r in (self.settings.local_dir, self.settings.remote_dir) if r is not None]

    def _commit_pending(self) -> None:
        for root in self._roots():
            pending = self._uncommitted_in.setdefault(root, set())
            pending.update(self._uncommitted)
            durable.commit_pending(root, pending, self.world_size, range(self.world_size),
                                   self.settings.keep)
        self._uncommitted.clear()
