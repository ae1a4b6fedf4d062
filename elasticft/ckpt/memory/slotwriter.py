"""The save path's writer: a snapshot into a free shared-memory slot, copied in two parts.

``Checkpointer.save`` hands a laid-out state to :class:`SlotWriter`, which picks the oldest
slot that is neither the newest complete snapshot nor held by a reader (the worker never waits
for a reader; with none free it skips the snapshot and says so), writes the header
(``WRITING``) and the manifest, and copies right away only what training could change before
the next optimizer step. The rest (parameters and optimizer state, and CUDA state through the
device copier, :mod:`elasticft.ckpt.memory.device`) goes to the copy thread, which seals the header
``COMPLETE`` once all of it landed (:mod:`elasticft.ckpt.memory.slotformat`), unless the save's
commit gate refuses it then (:attr:`SaveRequest.refusal`): the slot stays ``WRITING``, as a
crash mid-write leaves it, and no reader takes it. The optimizer's
pre-step hook waits for that part (:meth:`SlotWriter.before_optimizer_step`), so the snapshot
is exactly the state after the saved step. A save whose slot is still being made
(:mod:`elasticft.ckpt.memory.slotmaker`) stages its copy and the copy thread writes it once the slot
exists.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

import torch

from elasticft.ckpt.api import StorageFull
from elasticft.ckpt.control import report_skip
from elasticft.ckpt.hostcopy import copy_bytes
from elasticft.ckpt.memory.device import DeviceCopier, PendingCopy
from elasticft.ckpt.memory.shm import SlotSet
from elasticft.ckpt.memory.slotformat import (
    COMPLETE,
    HEADER_BYTES,
    SEAL_NONE,
    SEAL_SAMPLED,
    WRITING,
    SlotHeader,
    seal_of,
)
from elasticft.ckpt.settings import WorkerSettings
from elasticft.ckpt.snapshot import Layout, align_up

logger = logging.getLogger(__name__)


class SaveRequest:
    """One ``save``: complete when the snapshot is whole in shared memory (or was skipped)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.status = "pending"
        """pending | memory (complete in shared memory) | skipped | failed | refused (its
        commit gate refused the seal)."""
        self.skipped: str | None = None
        """Why no snapshot was taken (status ``skipped``), else None."""
        self.error: BaseException | None = None
        self.guarded_done = threading.Event()
        self.device: PendingCopy | None = None
        """The CUDA part of the copy (see :mod:`elasticft.ckpt.memory.device`), if any."""
        self.refusal: Callable[[], BaseException | None] = lambda: None
        """Asked right before the seal, once every byte landed (CUDA copies included): an
        error refuses the commit (:class:`elasticft.ckpt.api.CommitGate`)."""
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveRequest:
        """Blocks until complete; raises the save's error, if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint of step {self.step} not complete after {timeout} s")
        if self.error is not None:
            raise self.error
        return self

    def __await__(self) -> Generator[Any, None, SaveRequest]:
        return asyncio.get_running_loop().run_in_executor(None, self.wait).__await__()

    def _finish(self, status: str, error: BaseException | None = None) -> None:
        self.status, self.error = status, error
        self.guarded_done.set()
        self._done.set()


class SlotWriter:
    """Writes one rank's snapshots into its slots; one save in flight at a time."""

    def __init__(self, settings: WorkerSettings, slots: SlotSet, rank: int, world_size: int,
                 *, device_copier: DeviceCopier | None = None,
                 on_complete: Callable[[int], None] = lambda step: None) -> None:
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self._slots = slots
        self._slot_count = slots.count
        self._on_complete = on_complete
        """Called on the copy thread with each step complete in memory."""
        self.device = device_copier
        """Copies CUDA state (made on the first save that has some, unless injected)."""
        self.device_off: str | None = None
        """Why CUDA state is copied the plain way (synchronously), or None."""
        self._generation = max((h.generation for h in slots.headers().values()), default=0)
        self._manifest_room = 0
        self._view_cache: dict[tuple[Any, ...], tuple[Any, list[torch.Tensor | None]]] = {}
        self.inflight: SaveRequest | None = None
        """The newest save, complete or not."""
        self.snapshots_skipped = 0
        """Saves this process could not take (see :attr:`SaveRequest.skipped`)."""
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._copier = threading.Thread(target=self._copy_loop, name="elasticft-ckpt-copy",
                                        daemon=True)
        self._copier.start()

    def write(self, request: SaveRequest, layout: Layout, guarded: tuple[bool, ...],
              step: int) -> None:
        """Starts the copy of ``layout`` as of ``step`` into a slot (``guarded``: per entry,
        whether only the optimizer step changes it, so the copy thread copies it later)."""
        manifest = layout.manifest_bytes(step, self.rank, self.world_size)
        if len(manifest) > self._manifest_room:
            # Room for the manifest to grow (values such as lr change size) without a move.
            self._manifest_room = align_up(2 * len(manifest) + 4096, 4096)
        payload_at = HEADER_BYTES + self._manifest_room
        size = payload_at + layout.payload_bytes
        usable = self._slot_count
        if self.settings.memory_cap_bytes:
            usable = min(usable, self.settings.memory_cap_bytes // size)
            if usable < 2:
                raise StorageFull(
                    f"two memory slots of {size} bytes exceed the memory cap of "
                    f"{self.settings.memory_cap_bytes} bytes; raise the cap or save less state"
                )
        slot = self._claim_slot(size, usable)
        if slot is None:
            index = self._slot_being_made(usable)
            if index is not None:
                self._start_staged_copy(request, layout, guarded, step, manifest, payload_at,
                                        size, index)
                return
            self._skip(request, usable)
            return
        self._generation += 1
        header = SlotHeader(WRITING, self._generation, step, self.rank, self.world_size,
                            len(manifest), payload_at, layout.payload_bytes, SEAL_NONE, 0, 0.0)
        slot.write_header(header)
        slot.map[HEADER_BYTES : HEADER_BYTES + len(manifest)] = manifest
        later = []
        on_device = []
        device_type = self._device_type()
        views = self._views(slot, payload_at, layout)
        for entry, dst, only_by_step in zip(layout.tensors, views, guarded, strict=True):
            if dst is None:
                continue
            if entry.tensor.device.type == device_type:
                on_device.append((dst, entry.tensor, only_by_step))
            elif only_by_step:
                later.append((dst, entry.tensor))
            else:
                copy_bytes(dst, entry.tensor)  # may change before the next optimizer step
        if on_device:
            request.device = self._begin_device_copy(slot, on_device)
        self.inflight = request
        offsets = [e.offset for e in layout.tensors if e.replica_of is None]
        self._jobs.put((request, slot, header, later, offsets))

    def _skip(self, request: SaveRequest, usable: int) -> None:
        """No slot is free: says so (a lost snapshot is never silent) and tells the agent."""
        if usable < self._slot_count:
            fix = f"the memory cap leaves {usable} slots; raise --ckpt-memory-cap-mb"
        else:
            fix = f"{usable} slots; raise CheckpointConfig.ckpt_memory_slots"
        request.skipped = (f"no free memory slot: one holds the newest snapshot and a reader "
                           f"holds the others ({fix})")
        self.snapshots_skipped += 1
        logger.warning("memory snapshot of step %d skipped: %s", request.step, request.skipped)
        request._finish("skipped")
        if self.settings.control_dir is not None:
            try:
                report_skip(self.settings.control_dir, self.settings.local_rank, self.rank,
                            request.step, request.skipped)
            except OSError:
                logger.debug("could not report the skipped snapshot", exc_info=True)

    def _slot_being_made(self, usable: int) -> int | None:
        """A slot the maker is making for this save (the first save, or a grown state)."""
        assert self._slots.maker is not None
        for index in range(usable):
            if self._slots.maker.pending(self._slots.path(index)):
                return index
        return None

    def _start_staged_copy(self, request: SaveRequest, layout: Layout, guarded: Any, step: int,
                           manifest: bytes, payload_at: int, size: int, index: int) -> None:
        """The save of a step whose slot is still being made: what may change before the next
        optimizer step is cloned now (small: buffers, RNG), and the copy thread writes the
        slot once it exists (the next optimizer step waits for that, as for any copy)."""
        self._generation += 1
        header = SlotHeader(WRITING, self._generation, step, self.rank, self.world_size,
                            len(manifest), payload_at, layout.payload_bytes, SEAL_NONE, 0, 0.0)
        sources = [
            None if entry.tensor.numel() == 0 or entry.replica_of is not None
            else entry.tensor if only_by_step else entry.tensor.detach().clone()
            for entry, only_by_step in zip(layout.tensors, guarded, strict=True)
        ]
        deferred = _DeferredSlot(self._slots.path(index), size, manifest, payload_at, layout,
                                 sources)
        self.inflight = request
        offsets = [e.offset for e in layout.tensors if e.replica_of is None]
        self._jobs.put((request, deferred, header, [], offsets))

    def _resolve(self, deferred: _DeferredSlot, header: SlotHeader) -> tuple[Any, list[Any]]:
        """On the copy thread: the slot of a staged save, once made, locked and headed, and the
        copies into it."""
        assert self._slots.maker is not None
        slot = self._slots.maker.wait(deferred.path, deferred.size, timeout_s=600)
        deadline = time.monotonic() + 60
        while not slot.try_lock(exclusive=True):  # a reader's peek at the new slot
            if time.monotonic() > deadline:
                raise StorageFull(f"{slot.path} stayed locked by a reader")
            time.sleep(0.005)
        try:
            slot.write_header(header)
            slot.map[HEADER_BYTES : HEADER_BYTES + len(deferred.manifest)] = deferred.manifest
            views = self._views(slot, deferred.payload_at, deferred.layout)
        except BaseException:
            slot.unlock()
            raise
        copies = [(dst, src) for dst, src in zip(views, deferred.sources, strict=True)
                  if dst is not None and src is not None]
        return slot, copies

    def _device_type(self) -> str | None:
        """The device type whose tensors go through the device copier (None: no copier)."""
        if self.device_off is not None:
            return None
        return self.device.backend.device_type if self.device is not None else "cuda"

    def _begin_device_copy(
        self, slot: Any, copies: list[tuple[torch.Tensor, torch.Tensor, bool]]
    ) -> PendingCopy | None:
        """Starts the CUDA copies (see :mod:`elasticft.ckpt.memory.device`); if that path fails,
        says so once and copies the plain way from then on, so no snapshot is lost to it."""
        try:
            if self.device is None:
                self.device = DeviceCopier(self.settings.gpu_staging_bytes)
            self.device.pin(slot)
            return self.device.begin(copies)
        except Exception as e:
            self.device_off = f"{type(e).__name__}: {e}".splitlines()[0]
            logger.warning("the CUDA snapshot path failed (%s); CUDA state is copied "
                           "synchronously from now on", self.device_off)
            if self.device is not None:
                self.device.drain()  # no copy it issued may land after the ones below
            for dst, src, _ in copies:
                copy_bytes(dst, src)
            return None

    def _views(self, slot: Any, payload_at: int, layout: Layout) -> list[torch.Tensor | None]:
        """Destination tensors in a slot for a layout, built once per (mapping, placement)."""
        key = (slot.path, payload_at, layout.payload_bytes, layout.tensors_json)
        cached = self._view_cache.get(key)
        if cached is not None and cached[0] is slot.map:
            return cached[1]
        payload = memoryview(slot.map)[payload_at : payload_at + layout.payload_bytes]
        views = [
            torch.frombuffer(payload, dtype=e.tensor.dtype, count=e.tensor.numel(),
                             offset=e.offset).view(e.tensor.shape)
            if e.tensor.numel() and e.replica_of is None else None
            for e in layout.tensors
        ]
        for stale in [k for k in self._view_cache if k[0] == slot.path]:
            del self._view_cache[stale]  # drops views of a mapping that was replaced
        self._view_cache[key] = (slot.map, views)
        return views

    def _claim_slot(self, size: int, usable: int) -> Any:
        """Oldest slot that is not the newest complete snapshot and that no reader holds
        (oldest-first eviction within the ``usable`` slots the memory cap allows)."""
        headers = {i: h for i, h in self._slots.headers().items() if i < usable}
        newest = max((i for i, h in headers.items() if h.state == COMPLETE),
                     key=lambda i: headers[i].generation, default=None)
        order = sorted(range(usable),
                       key=lambda i: headers[i].generation if i in headers else -1)
        for index in order:
            if index == newest:
                continue
            slot = self._slots.ensure(index, size)  # None while the maker makes it
            if slot is not None and slot.try_lock(exclusive=True):
                return slot
        return None

    def _copy_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            request, slot, header, later, offsets = job
            try:
                if isinstance(slot, _DeferredSlot):
                    slot, later = self._resolve(slot, header)
                if request.device is not None:
                    assert self.device is not None
                    self.device.issue_rest(request.device)
                for dst, src in later:
                    copy_bytes(dst, src)
                request.guarded_done.set()
                if request.device is not None:
                    assert self.device is not None
                    self.device.synchronize(request.device)
                refused = request.refusal()
                if refused is not None:
                    slot.unlock()
                    logger.warning("memory snapshot of step %d not sealed: %s", header.step,
                                   refused)
                    request._finish("refused", refused)
                    continue
                manifest = slot.map[HEADER_BYTES : HEADER_BYTES + header.manifest_len]
                seal = seal_of(header, manifest, slot.payload(header), offsets)
                slot.write_header(dataclasses.replace(
                    header, state=COMPLETE, seal_kind=SEAL_SAMPLED, seal=seal,
                    completed_at=time.time()))
                slot.unlock()
                request._finish("memory")
                self._on_complete(header.step)
            except BaseException as e:
                if not isinstance(slot, _DeferredSlot):
                    slot.unlock()
                logger.exception("memory snapshot of step %d failed", header.step)
                request._finish("failed", e)

    def before_optimizer_step(self) -> None:
        """Waits for the part of the save in flight that the optimizer step would change."""
        request = self.inflight
        if request is None or request.done():
            return
        request.guarded_done.wait()
        if request.device is not None and self.device is not None:
            try:
                self.device.before_step(request.device)
            except Exception:
                # Exact snapshot all the same: the step waits on the host for the copy.
                logger.warning("ordering the optimizer step after the snapshot's CUDA copy "
                               "failed; waiting for the copy on the host", exc_info=True)
                request._done.wait()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops the copy thread once the save queued is written."""
        self._jobs.put(None)
        self._copier.join(timeout=timeout_s)


@dataclasses.dataclass
class _DeferredSlot:
    """A staged save's destination: the slot the maker is still making, and what goes in."""

    path: Any
    size: int
    manifest: bytes
    payload_at: int
    layout: Layout
    sources: list[torch.Tensor | None]
    """Per layout entry: a clone taken in ``save()``, or the live tensor (changed only by the
    optimizer step, which waits for the copy), or None (nothing stored here)."""
