"""The worker API: ``Checkpointer.save(step, state)`` and ``Checkpointer.load()``.

Saving never waits for storage. ``save`` lays the state out (DCP's names, see
:mod:`elasticft.ckpt.snapshot`), picks the oldest free shared-memory slot, copies right away
only what training could change before the next optimizer step (buffers, RNG, anything the
registered optimizers do not own) and hands the rest (parameters and optimizer state) to a copy
thread. That copy overlaps the next forward and backward; an optimizer *pre-step hook* makes the
next ``optimizer.step()`` wait for whatever part of it is still running, so the snapshot is
exactly the state after the saved step. ``save`` returns a :class:`SaveRequest` (``wait()``,
``done()``, ``await``) that is complete once the snapshot is whole in shared memory. Under
``elasticft-run`` the agent then persists, replicates and, after a crash, flushes it; without an
agent the checkpointer persists every ``persist_every``-th step itself, on a background thread
(:mod:`elasticft.ckpt.persister`).

Loading takes the newest step that *every* rank can restore, each rank from its fastest verified
source (:mod:`elasticft.ckpt.loader`).

``load()`` returns ``(step, state)`` with the state in the nested form it was saved in;
:func:`elasticft.ckpt.state.restore` applies it to a model and optimizer.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elasticft.ckpt import durable
from elasticft.ckpt.api import CheckpointError, StorageFull
from elasticft.ckpt.control import (
    ControlWatcher,
    announce_dir,
    report_loaded,
    report_restored,
    report_skip,
)
from elasticft.ckpt.device import DeviceCopier, PendingCopy
from elasticft.ckpt.hostcopy import copy_bytes
from elasticft.ckpt.loader import SnapshotLoader
from elasticft.ckpt.persister import OwnPersister
from elasticft.ckpt.settings import WorkerSettings
from elasticft.ckpt.shm import SlotSet
from elasticft.ckpt.slotformat import (
    COMPLETE,
    HEADER_BYTES,
    SEAL_NONE,
    SEAL_SAMPLED,
    WRITING,
    SlotHeader,
    seal_of,
)
from elasticft.ckpt.slotmaker import SlotMaker
from elasticft.ckpt.snapshot import (
    Flattener,
    Layout,
    ReplicaPlacement,
    align_up,
    deduplicated,
    place_replicas,
)

logger = logging.getLogger(__name__)
_Loaded = TypeVar("_Loaded", bound=tuple)


class SaveRequest:
    """One ``save``: complete when the snapshot is whole in shared memory (or was skipped)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.status = "pending"
        """pending | memory (complete in shared memory) | skipped | failed."""
        self.skipped: str | None = None
        """Why no snapshot was taken (status ``skipped``), else None."""
        self.error: BaseException | None = None
        self.guarded_done = threading.Event()
        self.device: PendingCopy | None = None
        """The CUDA part of the copy (see :mod:`elasticft.ckpt.device`), if any."""
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


class Checkpointer:
    """Snapshots training state into the memory tier and restores it from the fastest tier."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        rank: int | None = None,
        world_size: int | None = None,
        dedup_replicas: bool = False,
        device_copier: DeviceCopier | None = None,
    ) -> None:
        self.settings = settings
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        self.world_size = (
            world_size if world_size is not None
            else (dist.get_world_size() if initialized else 1)
        )
        self.optimizers = tuple(optimizers)
        self.dedup_replicas = dedup_replicas and self.world_size > 1
        """Each rank stores only its share of the replicated state (see :meth:`save`)."""
        self._placements: dict[tuple[Any, ...], ReplicaPlacement] = {}
        self._prepared: tuple[Any, set[int], Layout, tuple[bool, ...]] | None = None
        self._host_stall_s = 0.0
        self._device = device_copier
        """Copies CUDA state (made on the first save that has some, unless injected)."""
        self._device_off: str | None = None
        """Why CUDA state is copied the plain way (synchronously), or None."""
        self._slot_count = max(2, settings.slots)
        prefix = settings.shm_slots
        self._loader = SnapshotLoader(settings, self.rank, self.world_size, self._slot_count)
        # Slots are made off the training thread (SlotMaker): the first save stages its copy
        # until its slot exists, and never pays for the allocation.
        self._slots = SlotSet(prefix, self._slot_count, maker=SlotMaker()) if prefix else None
        # The persister reads through its own descriptors (flock is per open file).
        self._reader_slots = SlotSet(prefix, self._slot_count) if prefix else None
        self._generation = max((h.generation for h in self._slots.headers().values()),
                               default=0) if self._slots else 0
        self._manifest_room = 0
        self._flatten = Flattener()
        self._view_cache: dict[tuple[Any, ...], tuple[Any, list[torch.Tensor | None]]] = {}
        self._inflight: SaveRequest | None = None
        self.snapshots_skipped = 0
        """Saves this process could not take (see :attr:`SaveRequest.skipped`)."""
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._copier = threading.Thread(target=self._copy_loop, name="elasticft-ckpt-copy",
                                        daemon=True)
        self._copier.start()
        self._persister: OwnPersister | None = None
        if (self._reader_slots is not None and not settings.agent_owned
                and settings.persist_every > 0 and settings.local_dir):
            self._persister = OwnPersister(settings, self._reader_slots, self.rank,
                                           self.world_size)
        self._hooks = [opt.register_step_pre_hook(self._before_optimizer_step)
                       for opt in self.optimizers]
        self._watcher = (
            ControlWatcher(settings.control_dir, settings.local_rank, self._answer_request)
            if settings.control_dir else None
        )
        if settings.control_dir is not None and settings.chosen_dir is not None:
            announce_dir(settings.control_dir, settings.local_rank, settings.chosen_dir)
        if settings.fresh_launch and settings.local_dir is not None:
            durable.start_fresh(settings.local_dir, settings.fresh_launch)
        self._loaded_hook: Any = None
        """The one-shot optimizer-step hook that reports the first step after a load."""
        self._loaded_reported = threading.Event()
        self._closed = False
        # A process that ends (or raises) right after save() still completes the copy in
        # flight, so the snapshot it returned for is not left torn.
        atexit.register(self._wait_inflight)
        owns_memory = not settings.agent_owned and settings.owner_pid == os.getpid()
        if self._slots is not None and owns_memory:
            atexit.register(self._remove_own_segments)

    @classmethod
    def from_env(
        cls, *, optimizers: Iterable[torch.optim.Optimizer] = (), **defaults: Any
    ) -> Checkpointer:
        """Agent-owned memory under elasticft-run, else process-owned; see WorkerSettings.

        ``dedup_replicas=True`` (data parallel: the registered optimizers' parameters and
        state are identical on every rank) makes each rank store only its share of them.
        """
        dedup = bool(defaults.pop("dedup_replicas", False))
        return cls(WorkerSettings.from_env(**defaults), optimizers=optimizers,
                   dedup_replicas=dedup)

    @property
    def stall_s(self) -> float:
        """What checkpointing has cost training so far, in seconds: time inside ``save()`` and
        the pre-step hook, plus the time training's CUDA streams waited for snapshot copies
        (counted once those waits have passed on the device)."""
        if self._device is not None:
            try:
                self._host_stall_s += self._device.collect_stall_s()
            except Exception:  # a figure must never fail training
                logger.debug("reading the device stall failed", exc_info=True)
        return self._host_stall_s

    # ------------------------------------------------------------------------------------------
    # Saving.

    def save(self, step: int, state: Mapping[str, Any]) -> SaveRequest:
        """Snapshots ``state`` as of ``step``; returns at once with the copy under way.

        With ``dedup_replicas`` the plain (not DTensor) tensors the registered optimizers own,
        replicated on every data-parallel rank, are split into ``world_size`` shares by bytes
        and each rank copies and stores only its own share; a load reassembles them
        (collectively) from the other ranks' snapshots of the same step.
        """
        started = time.perf_counter()
        request = SaveRequest(step)
        self._remove_loaded_hook()
        try:
            self._wait_inflight()
            layout = self._flatten(state)
            if self._slots is None:
                request.skipped = "no shared-memory tier (memory=False)"
                request._finish("skipped")
                return request
            self._start_copy(request, layout, step)
        except BaseException as e:
            request._finish("failed", e)
            if not isinstance(e, CheckpointError):
                raise
            logger.error("checkpoint of step %d failed: %s", step, e)
        finally:
            self._host_stall_s += time.perf_counter() - started
        return request

    def _start_copy(self, request: SaveRequest, layout: Layout, step: int) -> None:
        assert self._slots is not None
        layout, guarded = self._prepare(layout)
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
        self._inflight = request
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
        assert self._slots is not None and self._slots.maker is not None
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
        assert self._slots is not None
        deferred = _DeferredSlot(self._slots.path(index), size, manifest, payload_at, layout,
                                 sources)
        self._inflight = request
        offsets = [e.offset for e in layout.tensors if e.replica_of is None]
        self._jobs.put((request, deferred, header, [], offsets))

    def _resolve(self, deferred: _DeferredSlot, header: SlotHeader) -> tuple[Any, list[Any]]:
        """On the copy thread: the slot of a staged save, once made, locked and headed, and the
        copies into it."""
        assert self._slots is not None and self._slots.maker is not None
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
        if self._device_off is not None:
            return None
        return self._device.backend.device_type if self._device is not None else "cuda"

    def _begin_device_copy(
        self, slot: Any, copies: list[tuple[torch.Tensor, torch.Tensor, bool]]
    ) -> PendingCopy | None:
        """Starts the CUDA copies (see :mod:`elasticft.ckpt.device`); if that path fails, says
        so once and copies the plain way from then on, so no snapshot is lost to it."""
        try:
            if self._device is None:
                self._device = DeviceCopier(self.settings.gpu_staging_bytes)
            self._device.pin(slot)
            return self._device.begin(copies)
        except Exception as e:
            self._device_off = f"{type(e).__name__}: {e}".splitlines()[0]
            logger.warning("the CUDA snapshot path failed (%s); CUDA state is copied "
                           "synchronously from now on", self._device_off)
            if self._device is not None:
                self._device.drain()  # no copy it issued may land after the ones below
            for dst, src, _ in copies:
                copy_bytes(dst, src)
            return None

    def _prepare(self, layout: Layout) -> tuple[Layout, tuple[bool, ...]]:
        """The layout to write (deduplicated if asked) and, per entry, whether only
        ``optimizer.step()`` changes it (copied in the background).

        Cached while the entries are the same objects (see ``Flattener``) and the optimizers
        own the same storages: on every step with ``StateCapture`` this skips a storage lookup
        per tensor and rebuilding the deduplicated entries.
        """
        guarded = self._guarded_storages()
        cached = self._prepared
        if cached is not None and cached[0] is layout.tensors and cached[1] == guarded:
            return dataclasses.replace(cached[2], values=layout.values,
                                       values_json=layout.values_json), cached[3]
        prepared = self._deduplicate(layout, guarded) if self.dedup_replicas else layout
        flags = tuple(_storage_key(e.tensor) in guarded for e in prepared.tensors)
        self._prepared = (layout.tensors, guarded, prepared, flags)
        return prepared, flags

    def _deduplicate(self, layout: Layout, guarded: set[int]) -> Layout:
        """``layout`` with each replicated tensor stored by one rank only (placement cached)."""
        replicated = tuple(
            _storage_key(e.tensor) in guarded and e.global_size == tuple(e.tensor.shape)
            and not any(e.chunk_offsets)
            for e in layout.tensors
        )
        key = (layout.tensors_json, replicated)
        placement = self._placements.get(key)
        if placement is None:
            placement = place_replicas(layout, replicated, self.rank, self.world_size)
            self._placements = {key: placement}
        return deduplicated(layout, placement, self.rank)

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
        assert self._slots is not None
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

    def _guarded_storages(self) -> set[int]:
        """Storages only ``optimizer.step()`` changes: copied in the background."""
        keys: set[int] = set()
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    keys.add(_storage_key(p))
            for per_param in opt.state.values():
                for value in per_param.values():
                    if isinstance(value, torch.Tensor):
                        keys.add(_storage_key(value))
        return keys

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
                    assert self._device is not None
                    self._device.issue_rest(request.device)
                for dst, src in later:
                    copy_bytes(dst, src)
                request.guarded_done.set()
                if request.device is not None:
                    assert self._device is not None
                    self._device.synchronize(request.device)
                manifest = slot.map[HEADER_BYTES : HEADER_BYTES + header.manifest_len]
                seal = seal_of(header, manifest, slot.payload(header), offsets)
                slot.write_header(dataclasses.replace(
                    header, state=COMPLETE, seal_kind=SEAL_SAMPLED, seal=seal,
                    completed_at=time.time()))
                slot.unlock()
                request._finish("memory")
                if self._persister is not None:
                    self._persister.offer(header.step)
            except BaseException as e:
                if not isinstance(slot, _DeferredSlot):
                    slot.unlock()
                logger.exception("memory snapshot of step %d failed", header.step)
                request._finish("failed", e)

    def _before_optimizer_step(self, *_: Any) -> None:
        request = self._inflight
        if request is None or request.done():
            return
        started = time.perf_counter()
        request.guarded_done.wait()
        if request.device is not None and self._device is not None:
            try:
                self._device.before_step(request.device)
            except Exception:
                # Exact snapshot all the same: the step waits on the host for the copy.
                logger.warning("ordering the optimizer step after the snapshot's CUDA copy "
                               "failed; waiting for the copy on the host", exc_info=True)
                request._done.wait()
        self._host_stall_s += time.perf_counter() - started

    def _wait_inflight(self) -> None:
        request = self._inflight
        if request is not None and not request.done():
            started = time.perf_counter()
            request._done.wait()
            self._host_stall_s += time.perf_counter() - started

    def newest_step(self) -> int | None:
        """Step of the newest complete memory snapshot of this rank."""
        if self._slots is None:
            return None
        newest = self._slots.newest()
        return newest[1].step if newest else None

    def _answer_request(self, reason: str) -> int | None:
        logger.info("checkpoint requested by the agent (%s)", reason)
        self._wait_inflight()  # the copy thread finishes it even if the main thread is stuck
        return self.newest_step()

    # ------------------------------------------------------------------------------------------
    # Loading.

    @property
    def last_source(self) -> str | None:
        """Tier the last successful load() came from."""
        return self._loader.last_source

    def load(self) -> tuple[int, dict[str, Any]] | None:
        """The newest step every rank can restore, and this rank's state of it; None if none.

        Collective when a process group is initialized: call it on every rank.
        """
        self._wait_inflight()
        return self._report_loaded(self._loader.load)

    def restore(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[int, dict[str, Any]] | None:
        """:meth:`load` applied to ``model`` and ``optimizer``; returns (step, extras).

        From shared memory the state is copied straight into the live tensors, with no
        intermediate copy (see :class:`~elasticft.ckpt.state.LiveState`).
        """
        from elasticft.ckpt.state import LiveState

        self._wait_inflight()
        return self._report_loaded(lambda: self._loader.load(LiveState(model, optimizer)))

    def _report_loaded(self, load: Callable[[], _Loaded | None]) -> _Loaded | None:
        """``load()``; the agent hears of it once the first optimizer step after it is over,
        whatever the load found or raised."""
        step = None
        try:
            result = load()
            step = result[0] if result is not None else None
            self._report_restored(step)
            return result
        finally:
            self._report_after_first_step(step)

    def _report_restored(self, step: int | None) -> None:
        """Tells the agent what was restored and from where (it logs the line)."""
        if self.settings.control_dir is None:
            return
        loader = self._loader
        try:
            report_restored(self.settings.control_dir, self.settings.local_rank, step,
                            loader.last_source if step is not None else None,
                            loader.last_where if step is not None else "", loader.looked)
        except OSError:
            logger.debug("could not tell the agent what was restored", exc_info=True)

    def _report_after_first_step(self, step: int | None) -> None:
        """Tells the agent (``report_loaded``) when the first optimizer step after a load ends.

        After a restart in place the agent holds back its flush of the crash-time snapshot
        until then: beside the restore and the first step it competes for the same memory and
        cores (3 GB on 2 cores: the first step took 6.1 s beside the flush, against 1.7 s for
        the same script under torchrun). A script that never steps a ``torch.optim`` optimizer
        lets the agent start the flush at its next save or after its bound.
        """
        control = self.settings.control_dir
        if control is None or self._loaded_hook is not None:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook

        reported = threading.Event()

        def report(optimizer: Any, args: Any, kwargs: Any) -> None:
            # torch is iterating over the step hooks now: the hook stays registered (removing
            # it would break that loop) and does nothing more; save() and close() remove it.
            if reported.is_set():
                return
            reported.set()
            try:
                report_loaded(control, self.settings.local_rank, step)
            except OSError as e:  # the agent then starts its flush after its own bound
                logger.warning("could not tell the agent the restore is over: %s", e)

        self._loaded_hook = register_optimizer_step_post_hook(report)
        self._loaded_reported = reported

    def _remove_loaded_hook(self) -> None:
        if self._loaded_hook is not None and self._loaded_reported.is_set():
            self._loaded_hook.remove()
            self._loaded_hook = None

    # ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Finishes the save in flight and stops the threads (the agent keeps the memory)."""
        if self._closed:
            return
        self._closed = True
        self._wait_inflight()
        atexit.unregister(self._wait_inflight)
        for hook in self._hooks:
            hook.remove()
        if self._loaded_hook is not None:
            self._loaded_hook.remove()
            self._loaded_hook = None
        if self._watcher is not None:
            self._watcher.close()
        self._jobs.put(None)
        self._copier.join(timeout=10)
        if self._persister is not None:
            self._persister.close()
        if self._slots is not None:
            self._slots.close()
        if self._reader_slots is not None:
            self._reader_slots.close()

    def _remove_own_segments(self) -> None:
        self.close()
        if self._slots is not None:
            self._slots.unlink()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _storage_key(tensor: torch.Tensor) -> int:
    # Runs for every optimizer tensor on every save: plain tensors skip the hasattr, which
    # costs an AttributeError each.
    plain = type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter
    local = tensor.to_local() if not plain and hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()
