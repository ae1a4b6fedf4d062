"""The memory tier (``TierLevel.MEMORY``): snapshots in shared memory that outlive the worker
that wrote them.

Design (who owns what)
----------------------
The *agent* owns the files; the *worker* sizes them. At start the agent creates every local
rank's slots as files with no name in /dev/shm (:mod:`elasticft.unnamed`) and gives the worker
their ``/proc/<agent pid>/fd/<n>`` paths (``ELASTICFT_WORKER_CKPT_SHM``). At its first save the
worker, the only process that knows how large its state is, grows them and allocates their pages
once with ``posix_fallocate`` (so later saves never take first-touch page faults), off the training
thread (:class:`SlotMaker`), and maps them. The agent reads them when it persists, flushes or
serves them, keeps the bytes through the worker's death (tmpfs pages belong to the file, not
the process), and the restarted worker maps the same files again. When the agent exits,
however it exits, the kernel frees them. This avoids a size-negotiation protocol and any stall
of the first save on an agent round trip.

Without an agent (plain torchrun, one process) the worker's slots are named
``/dev/shm/<prefix>-s<k>`` after the owning process (torchrun's agent, or the process itself),
so a restarted worker finds them; a later start sweeps the segments of owners that are gone.

Slots and consistency
---------------------
Each local rank has ``slots`` (>= 2, 3 by default) files, so the save in progress never
touches the newest complete snapshot, nor the one a reader (the agent persisting) is copying
out. The writer never waits for a reader: if the slot it wants is being read, it takes the next
oldest, and if all are busy it skips that memory snapshot (the request says so). The oldest
snapshot is always overwritten first (oldest-first eviction under the memory cap, which bounds
``slots``). What a slot file holds, and how a torn or overwritten snapshot is told apart, is
:mod:`elasticft.ckpt.memory.slotformat`; slots are made off the training thread by
:mod:`elasticft.ckpt.memory.slotmaker`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from elasticft import procs
from elasticft.ckpt.api import Snapshot, SnapshotCorrupt, SnapshotMissing, Tier, TierLevel
from elasticft.ckpt.hostcopy import copy_all
from elasticft.ckpt.memory.slot import Slot
from elasticft.ckpt.memory.slotformat import (
    COMPLETE,
    HEADER_BYTES,
    SEAL_SAMPLED,
    WRITING,
    SlotHeader,
    item_offsets,
    seal_of,
)

if TYPE_CHECKING:
    from elasticft.ckpt.memory.slotmaker import SlotMaker

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "elasticft-ckpt"


def segment_prefix(owner_pid: int, token: str, local_rank: int) -> str:
    """Segment names embed their owner's pid, so a dead owner's leftovers can be swept."""
    clean = re.sub(r"[^A-Za-z0-9]", "", token)[:16] or "job"
    return f"{NAME_PREFIX}-{owner_pid}-{clean}-l{local_rank}"


def slot_path(prefix: str, slot: int, shm_dir: Path = SHM_DIR) -> Path:
    return shm_dir / f"{prefix}-s{slot}"


def slot_paths(where: str, count: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    """The paths of one local rank's slots. ``where`` is either the agent's unnamed slot files
    (:func:`elasticft.unnamed.path_of` paths joined by commas; ``count`` is then their number)
    or the name prefix of ``count`` named files a process owns itself (no agent)."""
    if os.sep in where:
        return [Path(p) for p in where.split(",")]
    return [slot_path(where, i, shm_dir) for i in range(count)]


def sweep_orphans(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Removes this user's segments whose owner process is gone (e.g. an agent killed -9)."""
    removed = []
    pattern = re.compile(rf"^{NAME_PREFIX}-(\d+)-")
    for path in shm_dir.glob(f"{NAME_PREFIX}-*"):
        match = pattern.match(path.name)
        if not match:
            continue
        try:
            if path.stat().st_uid != os.getuid() or not procs.gone(int(match.group(1))):
                continue
        except FileNotFoundError:
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    if removed:
        logger.info("removed %d shared-memory segment(s) of dead owners", len(removed))
    return removed


class SlotSet:
    """The slots of one local rank, as seen by a reader (agent) or the writer (worker);
    ``where`` as for :func:`slot_paths`."""

    def __init__(self, where: str, slots: int, shm_dir: Path = SHM_DIR,
                 maker: SlotMaker | None = None) -> None:
        self.where = where
        self.paths = slot_paths(where, slots, shm_dir)
        self.count = len(self.paths)
        self.shm_dir = shm_dir
        self._open: dict[int, Slot] = {}
        self.maker = maker
        """Makes missing slots off the caller's thread (the writer's); None: :meth:`ensure`
        makes them itself."""

    def path(self, index: int) -> Path:
        return self.paths[index]

    def get(self, index: int) -> Slot | None:
        if self.maker is not None:
            made = self.maker.take(self.path(index))
            if made is not None:
                old = self._open.pop(index, None)
                if old is not None and old is not made:
                    old.close()
                self._open[index] = made
        slot = self._open.get(index)
        if slot is not None:
            try:
                # On every save: one stat (not exists() and a stat) tells that it is unchanged.
                if os.stat(slot.path).st_size == slot.size:
                    return slot
            except FileNotFoundError:
                pass
        if slot is not None:
            slot.close()
            del self._open[index]
        slot = Slot.open_existing(self.path(index))
        if slot is not None:
            self._open[index] = slot
        return slot

    def ensure(self, index: int, size: int) -> Slot | None:
        """Slot ``index`` of at least ``size`` bytes; with a :attr:`maker`, None until it is
        made (it is asked for here)."""
        slot = self.get(index)
        if slot is not None and slot.size >= size:
            return slot
        if self.maker is not None:
            self.maker.request(self.path(index), size)
            return None
        if slot is not None:
            slot.close()
            del self._open[index]
        slot = Slot.create_or_grow(self.path(index), size)
        self._open[index] = slot
        return slot

    def headers(self) -> dict[int, SlotHeader]:
        """Header of every existing slot (unlocked peek; confirm under a lock before use)."""
        found = {}
        for index in range(self.count):
            slot = self.get(index)
            header = slot.header() if slot is not None else None
            if header is not None:
                found[index] = header
        return found

    def complete(self) -> dict[int, SlotHeader]:
        return {i: h for i, h in self.headers().items() if h.state == COMPLETE}

    def writing(self) -> bool:
        """Whether a writer is copying a snapshot into one of these slots now: it holds the
        slot's exclusive lock for the whole copy, and the kernel releases it if it dies."""
        for index, header in self.headers().items():
            slot = self.get(index) if header.state == WRITING else None
            if slot is None:
                continue
            if not slot.try_lock(exclusive=False):
                return True
            slot.unlock()
        return False

    def newest(self) -> tuple[int, SlotHeader] | None:
        done = self.complete()
        if not done:
            return None
        index = max(done, key=lambda i: done[i].generation)
        return index, done[index]

    def close(self) -> None:
        for slot in self._open.values():
            slot.close()
        self._open.clear()
        if self.maker is not None:
            self.maker.close()

    def unlink(self) -> None:
        """Removes named slots (an agent's unnamed ones go with their last user)."""
        self.close()
        if os.sep in self.where:
            return
        for index in range(max(self.count, 8)):
            with contextlib.suppress(FileNotFoundError):
                slot_path(self.where, index, self.shm_dir).unlink()


def read_slot(slot: Slot, *, verify: bool = True, prefault: bool = True) -> Snapshot:
    """The snapshot of a slot, its pages mapped; call with the slot's shared lock held.

    ``verify`` checks the writer's seal (see :func:`seal_of`). ``prefault=False`` leaves the
    pages to fault in during the caller's copy: ``madvise`` holds the GIL, which a background
    reader (the agent's persist thread) must not hold for gigabytes.
    """
    header = slot.header()
    if header is None or header.state != COMPLETE:
        state = "torn (a writer died mid-write)" if header and header.state == WRITING else "empty"
        raise SnapshotMissing(f"{slot.path} is {state}")
    raw_manifest = slot.map[HEADER_BYTES : HEADER_BYTES + header.manifest_len]
    manifest = slot.manifest(header)
    payload = slot.payload(header)
    if prefault:
        slot.prefault(header)
    if (verify and header.seal_kind == SEAL_SAMPLED
            and seal_of(header, raw_manifest, payload, item_offsets(manifest)) != header.seal):
        raise SnapshotCorrupt(f"{slot.path}: snapshot of step {header.step} was changed after "
                              "it was complete (seal mismatch)")
    return Snapshot(manifest, payload)


class MemoryTier(Tier):
    """Reads the snapshots of one local rank's slots (the worker's own, or the agent's view)."""

    name = "memory"
    level = TierLevel.MEMORY

    def __init__(self, slots: SlotSet, lock_timeout_s: float = 10.0,
                 held_as: tuple[tuple[int, int], ...] = ()) -> None:
        self.slots = slots
        self.lock_timeout_s = lock_timeout_s
        self.held_as = held_as
        """The (rank, world size) this process wrote its snapshots as before a reshape renumbered
        it (:meth:`elasticft.ckpt.Checkpointer.renumber`): they hold the same state, and count as
        the rank's own after its current identity's."""

    def _identities(self, rank: int, world_size: int) -> list[tuple[int, int]]:
        return [(rank, world_size), *(i for i in self.held_as if i != (rank, world_size))]

    def steps(self, rank: int, world_size: int) -> list[int]:
        identities = set(self._identities(rank, world_size))
        return sorted(
            {
                h.step
                for h in self.slots.complete().values()
                if (h.rank, h.world_size) in identities
            },
            reverse=True,
        )

    def read(self, step: int, rank: int, world_size: int) -> Snapshot:
        with self.open(step, rank, world_size) as snapshot:
            # One private copy, so the slot can be reused as soon as the lock is released;
            # not bytearray(): it zeroes every page first, and copies on one thread.
            payload = torch.empty(len(snapshot.payload), dtype=torch.uint8)
            if len(payload):
                copy_all([(payload, torch.frombuffer(snapshot.payload, dtype=torch.uint8))])
            return Snapshot(snapshot.manifest, memoryview(payload.numpy()))

    @contextlib.contextmanager
    def open(self, step: int, rank: int, world_size: int) -> Iterator[Snapshot]:
        """The snapshot in place (no copy), verified; the slot stays locked while open."""
        order = {identity: n for n, identity in enumerate(self._identities(rank, world_size))}
        candidates = sorted(
            ((i, h) for i, h in self.slots.complete().items()
             if h.step == step and (h.rank, h.world_size) in order),
            key=lambda ih: (order[ih[1].rank, ih[1].world_size], -ih[1].generation),
        )
        for index, _header in candidates:
            slot = self.slots.get(index)
            if slot is None:
                continue
            if not slot.lock_shared(self.lock_timeout_s):
                continue
            try:
                snapshot = read_slot(slot, prefault=False)
                if snapshot.step != step:
                    continue  # overwritten between the peek and the lock
                yield snapshot
                return
            finally:
                slot.unlock()
        raise SnapshotMissing(f"no complete memory snapshot of step {step} for rank {rank}")

    def close(self) -> None:
        self.slots.close()
