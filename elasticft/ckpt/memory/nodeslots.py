"""Slot ownership: the agent holds its workers' shared-memory slots, so a crash loses nothing.

A node's memory tier is a set of slots per local rank (see :mod:`elasticft.ckpt.memory.shm` for a
slot's format). The agent creates them as files with no name (:mod:`elasticft.unnamed`),
empty until the worker sizes them, and holds them open for the job's life: a worker that
crashes loses nothing, a restarted worker finds its snapshots in them (through the
``/proc/<agent pid>/fd/<n>`` paths it is given), and when the agent exits, however it exits,
the kernel frees them, so nothing is left to sweep.

:class:`NodeSlots` is that ownership, and what the agent reads from the slots' headers without
taking a lock: which steps every local worker holds complete, whether a copy is in flight.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from elasticft import unnamed
from elasticft.addon.api import WorkerInfo
from elasticft.ckpt.memory.shm import SHM_DIR, SlotSet
from elasticft.ckpt.memory.slot import Slot


class NodeSlots:
    """Every local rank's slots on this node, owned by the agent."""

    def __init__(self, count: int, memory_cap_bytes: int = 0, shm_dir: Path = SHM_DIR) -> None:
        self.count = count
        """Slots per local rank (``ckpt_memory_slots``)."""
        self.memory_cap_bytes = memory_cap_bytes
        """A worker's cap on its slots' bytes (0: none), which may leave it fewer usable."""
        self.shm_dir = shm_dir
        self._sets: dict[int, SlotSet] = {}
        self._fds: dict[int, list[int]] = {}

    def slot_set(self, local_rank: int) -> SlotSet:
        """A local rank's slots: files with no name in the shared-memory directory, empty
        until its worker sizes them, held open here for the job's life (restarted workers
        find their snapshots in them) and freed by the kernel when the agent exits, however
        it exits."""
        slots = self._sets.get(local_rank)
        if slots is None:
            fds = self._fds.setdefault(local_rank, [])
            while len(fds) < self.count:
                fds.append(unnamed.anonymous_file(self.shm_dir))
            where = ",".join(str(unnamed.path_of(fd)) for fd in fds)
            slots = SlotSet(where, len(fds), self.shm_dir)
            self._sets[local_rank] = slots
        return slots

    def all_sets(self) -> list[SlotSet]:
        """Every slot set made so far, of current local ranks or not."""
        return list(self._sets.values())

    def usable(self, slots: SlotSet, slot: Slot) -> int:
        """How many slots of this size the worker may use (the memory cap may leave fewer)."""
        cap = self.memory_cap_bytes
        return min(slots.count, cap // slot.size) if cap else slots.count

    def common_steps(self, workers: Iterable[WorkerInfo]) -> set[int]:
        """Steps every one of ``workers`` holds complete in shared memory (each for its rank)."""
        common: set[int] | None = None
        for worker in workers:
            slots = self.slot_set(worker.local_rank)
            steps = {h.step for h in slots.complete().values()
                     if h.rank == worker.global_rank and h.world_size == worker.world_size}
            common = steps if common is None else common & steps
            if not common:
                return set()
        return common or set()

    def newest_common_step(self, workers: Iterable[WorkerInfo]) -> int | None:
        """Newest step every one of ``workers`` holds complete in shared memory."""
        return max(self.common_steps(workers), default=None)

    def wait_for_copies(self, local_ranks: Iterable[int], timeout_s: float) -> list[int]:
        """Waits until no worker of ``local_ranks`` copies a snapshot in, at most ``timeout_s``;
        the local ranks still copying then."""
        ranks = list(local_ranks)
        deadline = time.monotonic() + timeout_s
        while True:
            writing = [r for r in ranks if self.slot_set(r).writing()]
            if not writing or time.monotonic() >= deadline:
                return writing
            time.sleep(0.005)

    def close(self) -> None:
        """Lets go of every slot: the kernel frees each once its workers have too."""
        for slots in self._sets.values():
            slots.close()
        for fds in self._fds.values():
            for fd in fds:
                os.close(fd)
        self._fds.clear()
