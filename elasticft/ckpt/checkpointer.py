"""The worker API: ``Checkpointer.save(step, state)`` and ``Checkpointer.load()``.

Saving never waits for storage. ``save`` lays the state out (DCP's names, see
:mod:`elasticft.ckpt.snapshot`), picks the oldest free shared-memory slot, copies right away
only what training could change before the next optimizer step (buffers, RNG, anything the
registered optimizers do not own) and hands the rest (parameters and optimizer state) to a copy
thread (:mod:`elasticft.ckpt.memory.slotwriter`). That copy overlaps the next forward and backward;
an optimizer *pre-step hook* makes the next ``optimizer.step()`` wait for whatever part of it is
still running, so the snapshot is exactly the state after the saved step. ``save`` returns a
:class:`SaveRequest` (``wait()``, ``done()``, ``await``) that is complete once the snapshot is
whole in shared memory. Under ``elasticft-run`` the agent then persists, replicates and, after a
crash, flushes it; without an agent the checkpointer persists every ``persist_every``-th step
itself, on a background thread (:mod:`elasticft.ckpt.persisting.persister`).

A registered commit gate (:meth:`Checkpointer.register_commit_gate`,
:class:`elasticft.ckpt.api.CommitGate`) can refuse a save: ``save`` then raises its error, and
a copy already under way when the gate closes is not sealed, so no tier ever sees it.

Loading takes the newest step that *every* rank can restore, each rank from its fastest verified
source (:mod:`elasticft.ckpt.restoring.loader`).

``load()`` returns ``(step, state)`` with the state in the nested form it was saved in;
:func:`elasticft.ckpt.restoring.state.restore` applies it to a model and optimizer.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from elasticft.ckpt import start_snapshot
from elasticft.ckpt.api import CheckpointError, CommitGate, StateMismatch
from elasticft.ckpt.control import (
    ControlWatcher,
    announce_dir,
    report_flipped,
    report_loaded,
    report_restored,
)
from elasticft.ckpt.memory.device import DeviceCopier
from elasticft.ckpt.memory.shm import SlotSet
from elasticft.ckpt.memory.slotmaker import SlotMaker
from elasticft.ckpt.memory.slotwriter import SaveRequest, SlotWriter
from elasticft.ckpt.persisting import durable
from elasticft.ckpt.persisting.persister import OwnPersister
from elasticft.ckpt.restoring.loader import SnapshotLoader
from elasticft.ckpt.settings import WorkerSettings
from elasticft.ckpt.snapshot import (
    Flattener,
    Layout,
    ReplicaPlacement,
    deduplicated,
    place_replicas,
)

logger = logging.getLogger(__name__)
_Loaded = TypeVar("_Loaded", bound=tuple)


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
        self._open(settings, optimizers=optimizers, rank=rank, world_size=world_size,
                   dedup_replicas=dedup_replicas, device_copier=device_copier)
        Checkpointer._instances.add(self)

    _instances: ClassVar[weakref.WeakSet[Checkpointer]] = weakref.WeakSet()
    """Every checkpointer of this process, weakly held (:meth:`instances`)."""

    _commit_gates: ClassVar[OrderedDict[int, CommitGate]] = OrderedDict()
    """The gates every save of this process asks (:meth:`register_commit_gate`)."""

    @classmethod
    def register_commit_gate(cls, gate: CommitGate) -> RemovableHandle:
        """Makes every checkpointer of this process, made before or after, ask ``gate`` before
        it commits a snapshot; ``.remove()`` on the handle withdraws it. Process-wide, as
        torch's optimizer-step hooks are: the gate's owner (in-process recovery) does not
        know where the script keeps its checkpointers, nor when it makes them."""
        handle = RemovableHandle(Checkpointer._commit_gates)
        Checkpointer._commit_gates[handle.id] = gate
        return handle

    @classmethod
    def instances(cls) -> list[Checkpointer]:
        """Every checkpointer this process made and still holds (closed or not), wherever the
        script keeps it: what a pre-started spare rebinds when it takes a rank (:meth:`rebind`)."""
        return list(Checkpointer._instances)

    def rebind(self, env: Mapping[str, str], *, rank: int, world_size: int) -> None:
        """Points this checkpointer at another rank's memory, in place: closes it and opens it
        again with the settings ``env`` gives (the agent's variables of that rank), as ``rank``
        of ``world_size``, around the same optimizers.

        The process-owned defaults it was made with (``ckpt_dir=``, ``keep=``...) are passed
        on, as :meth:`from_env` would have been given them, and so is the ``dedup_replicas``
        asked for (granted once the world has more than one rank). Memory this process owned
        is no longer removed at its exit: it is no longer this checkpointer's.
        """
        old = self.settings
        self.close()
        atexit.unregister(self._remove_own_segments)
        settings = WorkerSettings.from_env(
            env, ckpt_dir=old.chosen_dir or old.local_dir, remote_dir=old.remote_dir,
            persist_every=old.persist_every, keep=old.keep, slots=old.slots,
            memory=old.shm_slots is not None, gpu_staging_bytes=old.gpu_staging_bytes)
        self._open(settings, optimizers=self.optimizers, rank=rank, world_size=world_size,
                   dedup_replicas=self.dedup_requested, device_copier=None)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Guards ``optimizer`` as the ones given at construction are: its ``step()`` waits
        for a snapshot copy in flight. For an optimizer made after this checkpointer (a
        framework makes a new one each time its training is entered)."""
        if any(optimizer is known for known in self.optimizers):
            return
        self.optimizers = (*self.optimizers, optimizer)
        self._hooks.append(optimizer.register_step_pre_hook(self._before_optimizer_step))

    @property
    def closed(self) -> bool:
        return self._closed

    def renumber(self, rank: int, world_size: int) -> None:
        """This process goes on as ``rank`` of ``world_size`` in the same memory, after a
        reshape renumbered it in process (:mod:`elasticft.inprocess.reshape`): the next saves are
        written as the new rank, and the snapshots written as the old one still count as this
        rank's own (they hold the same state) for the restore that follows."""
        if self._closed or (rank, world_size) == (self.rank, self.world_size):
            return
        held_as = ((self.rank, self.world_size), *self._held_as)
        owned = self._slots is not None and not self.settings.agent_owned
        self.close()
        if owned:
            atexit.unregister(self._remove_own_segments)
        self._open(self.settings, optimizers=self.optimizers, rank=rank, world_size=world_size,
                   dedup_replicas=self.dedup_requested, device_copier=None, held_as=held_as)

    def _open(self, settings: WorkerSettings, *, optimizers: Iterable[torch.optim.Optimizer],
              rank: int | None, world_size: int | None, dedup_replicas: bool,
              device_copier: DeviceCopier | None,
              held_as: tuple[tuple[int, int], ...] = ()) -> None:
        """Binds this checkpointer to ``settings``' memory and starts its threads."""
        self.settings = settings
        self._held_as = held_as
        """(rank, world size) identities this process's memory was written as before
        :meth:`renumber`."""
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        self.world_size = (
            world_size if world_size is not None
            else (dist.get_world_size() if initialized else 1)
        )
        self.optimizers = tuple(optimizers)
        self.dedup_replicas = dedup_replicas and self.world_size > 1
        """Each rank stores only its share of the replicated state (see :meth:`save`)."""
        self.dedup_requested = dedup_replicas
        """What the caller asked for (a spare's one-member world rebinds to the real one,
        :meth:`rebind`)."""
        self._placements: dict[tuple[Any, ...], ReplicaPlacement] = {}
        self._prepared: tuple[Any, set[int], Layout, tuple[bool, ...]] | None = None
        self._host_stall_s = 0.0
        self._slot_count = max(2, settings.slots)
        prefix = settings.shm_slots
        self._loader = SnapshotLoader(settings, self.rank, self.world_size, self._slot_count,
                                      held_as)
        # Slots are made off the training thread (SlotMaker): the first save stages its copy
        # until its slot exists, and never pays for the allocation.
        self._slots = SlotSet(prefix, self._slot_count, maker=SlotMaker()) if prefix else None
        # The persister reads through its own descriptors (flock is per open file).
        self._reader_slots = SlotSet(prefix, self._slot_count) if prefix else None
        self._flatten = Flattener()
        self._writer = SlotWriter(settings, self._slots, self.rank, self.world_size,
                                  device_copier=device_copier,
                                  on_complete=self._persist_if_due) if self._slots else None
        self._persister: OwnPersister | None = None
        if (self._reader_slots is not None and not settings.agent_owned
                and settings.persist_every > 0 and settings.local_dir):
            self._persister = OwnPersister(settings, self._reader_slots, self.rank,
                                           self.world_size)
        self._hooks = [opt.register_step_pre_hook(self._before_optimizer_step)
                       for opt in self.optimizers]
        self._watcher = (
            ControlWatcher(settings.control_dir, settings.local_rank, self._answer_request,
                           on_bitflip=self._take_bitflip)
            if settings.control_dir else None
        )
        if settings.control_dir is not None and settings.chosen_dir is not None:
            announce_dir(settings.control_dir, settings.local_rank, settings.chosen_dir)
        if settings.fresh_launch and settings.local_dir is not None:
            durable.start_fresh(settings.local_dir, settings.fresh_launch)
        self._bitflip: str | None = None
        """A pending ``elasticft chaos bitflip`` request's id, applied at the next save."""
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
    def snapshots_skipped(self) -> int:
        """Saves this process could not take (see :attr:`SaveRequest.skipped`)."""
        return self._writer.snapshots_skipped if self._writer is not None else 0

    @property
    def _device(self) -> DeviceCopier | None:
        """The copier of CUDA state, once a save had some (or injected)."""
        return self._writer.device if self._writer is not None else None

    @property
    def _device_off(self) -> str | None:
        """Why CUDA state is copied the plain way (synchronously), or None."""
        return self._writer.device_off if self._writer is not None else None

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
            request.refusal = _gate_refusal(
                [(gate, gate.current()) for gate in list(Checkpointer._commit_gates.values())])
            if (refused := request.refusal()) is not None:
                logger.warning("save of step %d refused: %s", step, refused)
                raise refused
            self._wait_inflight()
            if self._bitflip is not None:
                self._flip_one_bit(step)
            layout = self._flatten(state)
            if self._writer is None:
                request.skipped = "no shared-memory tier (memory=False)"
                request._finish("skipped")
                return request
            prepared, guarded = self._prepare(layout)
            self._writer.write(request, prepared, guarded, step)
        except BaseException as e:
            request._finish("failed", e)
            if not isinstance(e, CheckpointError):
                raise
            logger.error("checkpoint of step %d failed: %s", step, e)
        finally:
            self._host_stall_s += time.perf_counter() - started
        return request

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
        prepared = dataclasses.replace(
            prepared, guarded_items=tuple(i for i, flag in enumerate(flags) if flag))
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

    def _take_bitflip(self, request_id: str) -> None:
        """On the control thread: a bit flip was asked for (applied at the next save)."""
        self._bitflip = request_id

    def _flip_one_bit(self, step: int) -> None:
        """Fault injection (``elasticft chaos bitflip``): flips one mantissa bit of the first
        element of the first registered optimizer's first parameter, as a device that computed
        a wrong value would leave it, and tells the asker which tensor and step."""
        request_id, self._bitflip = self._bitflip, None
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        if request_id is None or self.settings.control_dir is None:
            return
        if not params:
            report_flipped(self.settings.control_dir, self.settings.local_rank, request_id,
                           error="no registered optimizer holds a parameter")
            return
        local = params[0].to_local() if hasattr(params[0], "to_local") else params[0]
        # A mantissa bit high enough that the next optimizer steps' rounding cannot undo it
        # (bit 16 of a float32): the lowest bit of the second-highest byte of element 0.
        byte = max(0, local.element_size() - 2)
        with torch.no_grad():
            local.detach().view(-1).view(torch.uint8)[byte] ^= 1
        logger.warning("chaos: flipped one bit of parameter 0 (shape %s) before the save of "
                       "step %d", list(local.shape), step)
        report_flipped(self.settings.control_dir, self.settings.local_rank, request_id,
                       step=step, rank=self.rank, shape=list(local.shape))

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

    def _before_optimizer_step(self, *_: Any) -> None:
        if self._writer is None:
            return
        started = time.perf_counter()
        self._writer.before_optimizer_step()
        self._host_stall_s += time.perf_counter() - started

    def _wait_inflight(self) -> None:
        request = self._writer.inflight if self._writer is not None else None
        if request is not None and not request.done():
            started = time.perf_counter()
            request._done.wait()
            self._host_stall_s += time.perf_counter() - started

    def _persist_if_due(self, step: int) -> None:
        """On the copy thread: ``step`` is complete in memory; persisted if due (no agent)."""
        if self._persister is not None:
            self._persister.offer(step)

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
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
        replicas: Any = None, *, keep_start: bool = True,
    ) -> tuple[int, dict[str, Any]] | None:
        """:meth:`load` applied to ``model`` and ``optimizer``; returns (step, extras).

        From shared memory the state is copied straight into the live tensors, with no
        intermediate copy (see :class:`~elasticft.ckpt.restoring.state.LiveState`).
        ``replicas``: the process group of the ranks whose state equals this rank's (its
        data-parallel replicas, not a group FSDP2 shards over); a member that holds no snapshot
        (a rank a growth in process brought) is then healed from a live member's memory
        (:mod:`elasticft.ckpt.restoring.heal`).

        Under in-process recovery a restore that finds nothing snapshots the state training
        starts from (:meth:`save_start`), which a later one puts back, returning None as at the
        start. ``keep_start=False``: not here (a framework that loads its own checkpoint after
        this restore snapshots the start after that load).
        """
        from elasticft.ckpt.restoring.state import LiveState

        self._wait_inflight()

        def load() -> tuple[int, dict[str, Any]] | None:
            live = LiveState(model, optimizer)
            healed = self._loader.heal(live, replicas) if replicas is not None else None
            return healed if healed is not None else self._loader.load(live)

        try:
            restored = self._report_loaded(load)
        except StateMismatch as e:
            # Another model than the checkpoint's (a relaunch whose arguments changed its
            # shapes): the agent stops the run at once (elasticft.addon.policy); say how to go on.
            if not self.settings.agent_owned:
                raise
            run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
            raise StateMismatch(f"run {run_id}: {e}; start this run over with elasticft-run "
                                "--fresh (its checkpoints are removed), or give it another "
                                "--run-dir") from None
        if restored is None:
            if keep_start:
                self.save_start(model, optimizer)
        elif start_snapshot.is_start(restored[1]):
            logger.info("rolled back to the state training started from (step 0)")
            return None  # the start, put back: the script starts from the beginning
        return restored

    def save_start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                   ) -> SaveRequest | None:
        """Snapshots the state training starts from as step 0
        (:mod:`elasticft.ckpt.start_snapshot`) while in-process recovery's keeper says the
        process has not trained yet; None when not taken. :meth:`restore` calls it when it
        finds nothing; a framework that does not restore at its start calls it there."""
        if not start_snapshot.wanted():
            return None
        request = self.save(0, start_snapshot.state(model, optimizer))
        if request.status == "failed":
            logger.warning("no snapshot of the starting state (%s): a peer failing before the "
                           "first checkpoint leaves the survivors' steps in place", request.error)
        return request

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

        After a restart in place the agent holds back its flush of the crash-time snapshot until
        then: beside the restore and the first step it competes for the same memory and cores
        (docs/benchmarks.md, crash recovery with gigabytes of state). A script that never steps
        a ``torch.optim`` optimizer lets the agent start the flush at its next save or after its
        bound.
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
        if self._writer is not None:
            self._writer.close()
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


def _gate_refusal(taken: list[tuple[CommitGate, int]]) -> Callable[[], BaseException | None]:
    """What asks each gate about a snapshot taken in the period it named at the save."""
    def refusal() -> BaseException | None:
        return next((error for gate, period in taken
                     if (error := gate.refusal(period)) is not None), None)
    return refusal


def _storage_key(tensor: torch.Tensor) -> int:
    # Runs for every optimizer tensor on every save: plain tensors skip the hasattr, which
    # costs an AttributeError each.
    plain = type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter
    local = tensor.to_local() if not plain and hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()
