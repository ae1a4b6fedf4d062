"""Process-owned persistence: a worker without an agent writes its own snapshots to disk.

Under ``elasticft-run`` the agent persists what its workers put in shared memory
(:mod:`elasticft.ckpt.persisting.agentpersist`). Under plain ``torchrun`` or in a single process
nobody else will, so the :class:`~elasticft.ckpt.checkpointer.Checkpointer` hands every
``persist_every``-th complete step to an :class:`OwnPersister`. It runs the persist pipeline
(:mod:`elasticft.ckpt.persisting.pipeline`) for its own rank: the slot copied once (its shared lock
held for that memory copy only), the rank's shard written to the local and the remote directory,
and rank 0 commits a step once every rank's shard of it is durable, looking again every
:data:`COMMIT_RETRY_S` while one waits.
"""

from __future__ import annotations

import contextlib

from elasticft.ckpt.memory.shm import SlotSet
from elasticft.ckpt.persisting import pipeline
from elasticft.ckpt.settings import WorkerSettings

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
        self._staging = pipeline.StagingBuffer()
        self._roots = [r for r in (settings.local_dir, settings.remote_dir) if r is not None]
        self._commits = pipeline.PendingCommits(settings.keep)
        self._thread = pipeline.PersistThread(self._commits.commit, self._commits.waiting,
                                              COMMIT_RETRY_S)

    def offer(self, step: int) -> None:
        """``step`` is complete in memory: persisted if due and the writer is not busy."""
        every = self.settings.persist_every
        if every <= 0 or step % every:
            return
        self._thread.offer(lambda: self._persist(step))

    def close(self, join_timeout_s: float = 300.0, commit_timeout_s: float = 10.0) -> None:
        """Finishes the writes queued; rank 0 then gives the other ranks' last shards a bounded
        time to land and commits them."""
        self._thread.close(join_timeout_s)
        if self.rank == 0:
            self._commits.drain(commit_timeout_s)

    def _persist(self, step: int) -> None:
        with contextlib.ExitStack() as held:
            taken = pipeline.take(self._slots, step, self.rank, held, lambda: self._staging)
            if taken is None:
                return
            pipeline.write_shards(self._roots, [taken[0]])
        if self.rank == 0:  # the committer
            self._commits.add(step, self._roots, self.world_size)
            self._commits.commit()
