"""The CUDA path of the memory tier: snapshots of GPU state that training does not wait for.

A snapshot of CUDA tensors is a device-to-host copy. Done the plain way (``dst.copy_(src)`` into
pageable shared memory, from a thread of the worker) it runs on the default stream, so it
serialises with training, at pageable speed, and none of it shows in the time ``save()`` takes:
on an H100 a 4.8 GB state cost about 1.2 s of training per save while ``save()`` returned in
2 ms. :class:`DeviceCopier` does it this way instead:

- **Pinned slots.** Each shared-memory slot a CUDA snapshot goes to is registered with
  ``cudaHostRegister`` once and reused (pinned memory is what lets a copy run as an asynchronous
  DMA at full bus speed); it is unregistered before the slot is unmapped.
- **A copy stream, ordered by events.** ``save()`` records an event on the training stream, and
  the copy stream waits for it: the copies see exactly the state after the saved step. Training
  waits for a copy only where it must, and on the device (a stream wait, never a host sync):
  for tensors the next forward may change (buffers) right away, for parameters and optimizer
  state at the next ``optimizer.step()`` (the checkpointer's pre-step hook).
- **Optional device staging** (``--ckpt-gpu-staging-mb``). When the CUDA state fits the bound,
  ``save()`` first copies all of it device to device (HBM speed, about a millisecond a GB) and
  training waits only for that; the DMA from the staging buffer to the slot overlaps the steps
  that follow. A staging buffer that cannot be allocated falls back to the event-ordered copy
  with one warning.
- **Honest accounting.** Every device wait of training is bracketed by two timing events; once
  both have passed, their elapsed time is added to the checkpointer's ``stall_s``. The stall the
  report shows is then what training lost, on the host and on the device.

Every CUDA call that can leave an error behind in the CUDA runtime's per-thread "last error"
(``cudaHostRegister`` on a locked-memory limit, say) runs on a short-lived thread of its own:
torch checks that state after its next kernel launch and would otherwise raise a stale error
into training.

The CUDA primitives sit behind :class:`CudaBackend`, so the ordering this module decides can be
checked, call by call, on a machine without a GPU (``tests/ckpt/memory/test_device_copy.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from elasticft.ckpt.hostcopy import copy_all
from elasticft.ckpt.snapshot import align_up

logger = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1
"""cudaHostRegisterPortable: pinned for every CUDA context of the process."""

Copy = tuple[torch.Tensor, torch.Tensor]
"""(destination, source) of one tensor copy."""


class Backend(Protocol):
    """The device primitives the copier needs (CUDA's, or a recording stand-in in tests)."""

    device_type: str
    """Tensors on devices of this type are copied by the copier."""

    def current_stream(self, device: torch.device) -> Any: ...
    def new_stream(self, device: torch.device) -> Any: ...
    def new_event(self, timing: bool = False) -> Any: ...
    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def register_host(self, address: int, size: int) -> str | None:
        """Pins host memory; None on success, else why not."""
        ...
    def unregister_host(self, address: int) -> None: ...
    def staging_buffer(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor: ...
    def pinned_buffer(self, nbytes: int) -> torch.Tensor:
        """A page-locked host buffer of ``nbytes`` bytes (uint8)."""
        ...


def _on_own_thread(call: Callable[[], Any]) -> Any:
    """``call()`` on a thread that ends right after: CUDA's per-thread error state goes with it."""
    result: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as e:  # handed back to the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name="elasticft-ckpt-cudart", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


class CudaBackend:
    """:class:`Backend` on torch.cuda."""

    device_type = "cuda"

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def new_event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def register_host(self, address: int, size: int) -> str | None:
        def register() -> str | None:
            cudart = torch.cuda.cudart()
            result = cudart.cudaHostRegister(address, size, _HOST_REGISTER_PORTABLE)
            if int(result) == 0:
                return None
            try:
                text = cudart.cudaGetErrorString(result)
            except Exception:  # the code alone still says what happened
                text = "unknown"
            return f"cudaHostRegister error {int(result)}: {text}"

        return _on_own_thread(register)

    def unregister_host(self, address: int) -> None:
        _on_own_thread(lambda: torch.cuda.cudart().cudaHostUnregister(address))

    def pinned_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def staging_buffer(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # Allocated on the training stream, used on the copy stream: freeing it must wait for
        # the copy stream's work too.
        buffer.record_stream(stream)
        return buffer


@dataclasses.dataclass
class PendingCopy:
    """The device part of one save, from ``save()`` until the copy thread saw it complete."""

    streams: dict[torch.device, Any]
    """The copy stream of each device the snapshot reads from."""
    later: list[Copy]
    """Copies the copy thread issues (parameters and optimizer state, or staging to slot)."""
    keep: list[torch.Tensor]
    """Sources that must outlive the copies (released once they completed)."""
    wait_at_step: bool
    """Whether the next optimizer step must wait, on the device, for ``later``."""
    copied: dict[torch.device, Any] = dataclasses.field(default_factory=dict)
    """An event per device, recorded after the last copy."""
    enqueued: threading.Event = dataclasses.field(default_factory=threading.Event)
    step_waited: bool = False


class DeviceCopier:
    """Copies a snapshot's CUDA tensors into pinned shared memory, off the training stream."""

    def __init__(self, staging_limit_bytes: int = 0, backend: Backend | None = None) -> None:
        self.backend: Backend = backend if backend is not None else CudaBackend()
        self.staging_limit_bytes = staging_limit_bytes
        self._streams: dict[torch.device, Any] = {}
        self._pinned: dict[Path, tuple[Any, int]] = {}
        """Slot path -> (the mapping object pinned, its address)."""
        self._pinning: dict[Path, tuple[Any, int, threading.Event]] = {}
        """Registrations under way: slot path -> (mapping, address, set when done)."""
        self._pin_lock = threading.Lock()
        self.pin_refused: str | None = None
        """Why slots are not pinned (copies then run from pageable memory), or None."""
        self.staging_refused: str | None = None
        self._staging: tuple[tuple[Any, ...], list[torch.Tensor]] | None = None
        self._staging_too_big_logged = False
        self._waits: list[tuple[Any, Any]] = []
        self._waits_lock = threading.Lock()

    # -- pinning ---------------------------------------------------------------------------

    def pin(self, slot: Any) -> None:
        """Registers ``slot``'s mapping as pinned memory, once per mapping, on a thread of its
        own: ``cudaHostRegister`` of a 4.8 GB slot took 1.8-2.4 s on an H100, and ``save()``
        must not wait for it. Until it is done, copies into the slot run from pageable memory
        (slower, still off the training stream)."""
        if self.pin_refused is not None:
            return
        with self._pin_lock:
            known = self._pinned.get(slot.path) or self._pinning.get(slot.path)
            if known is not None and known[0] is slot.map:
                return
            address = _address_of(slot.map)
            path = slot.path
            done = threading.Event()
            self._pinning[path] = (slot.map, address, done)
        # Registered before the slot is unmapped: waits for a registration still running.
        slot.before_close.append(lambda: self._unpin(path, address, done))
        thread = threading.Thread(target=self._register, args=(path, slot.map, address,
                                                               slot.size, done),
                                  name="elasticft-ckpt-pin", daemon=True)
        thread.start()

    def _register(self, path: Path, mapping: Any, address: int, size: int,
                  done: threading.Event) -> None:
        try:
            error = self.backend.register_host(address, size)
        except Exception as e:  # said like a refusal: copies go on from pageable memory
            error = f"{type(e).__name__}: {e}".splitlines()[0]
        with self._pin_lock:
            self._pinning.pop(path, None)
            if error is None:
                self._pinned[path] = (mapping, address)
            elif self.pin_refused is None:
                self.pin_refused = error
                logger.warning(
                    "checkpoint memory cannot be pinned (%s); CUDA snapshots are copied from "
                    "pageable memory, several times slower. Raise the locked-memory limit "
                    "(ulimit -l, or the container's memlock) to pin it", error)
        done.set()

    def _unpin(self, path: Path, address: int, registered: threading.Event) -> None:
        registered.wait()
        with self._pin_lock:
            known = self._pinned.get(path)
            if known is None or known[1] != address:
                return
            del self._pinned[path]
        try:
            self.backend.unregister_host(address)
        except Exception:  # the mapping goes away next; the driver drops it with the process
            logger.debug("unregistering pinned checkpoint memory failed", exc_info=True)

    # -- copying ---------------------------------------------------------------------------

    def begin(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor, bool]]) -> PendingCopy:
        """On the training thread, in ``save()``: orders the copies after the saved step.

        ``copies`` are (slot view, live CUDA tensor, only ``optimizer.step()`` changes it).
        Issues now what training may change before its next optimizer step (or, with staging,
        the device-to-device copy of everything) and makes the training stream wait for it.
        """
        devices = _devices(src for _, src, _ in copies)
        streams = {d: self._stream(d) for d in devices}
        training = {d: self.backend.current_stream(d) for d in devices}
        for d in devices:
            ready = self.backend.new_event()
            ready.record(training[d])
            streams[d].wait_event(ready)
        staged = self._staging_views(copies, streams)
        pending = PendingCopy(streams, later=[], keep=[src for _, src, _ in copies],
                              wait_at_step=False)
        if staged is not None:
            now = [(view, src) for (_, src, _), view in zip(copies, staged, strict=True)]
            pending.later = [(dst, view) for (dst, _, _), view in zip(copies, staged, strict=True)]
        else:
            now = [(dst, src) for dst, src, only_by_step in copies if not only_by_step]
            pending.later = [(dst, src) for dst, src, only_by_step in copies if only_by_step]
            pending.wait_at_step = bool(pending.later)
        if now:
            self._issue(now, streams)
            for d in _devices(src for _, src in now):
                issued = self.backend.new_event()
                issued.record(streams[d])
                self._hold(training[d], issued)
        return pending

    def issue_rest(self, pending: PendingCopy) -> None:
        """On the copy thread: issues ``pending.later`` and records its completion events."""
        try:
            self._issue(pending.later, pending.streams)
            for d, stream in pending.streams.items():
                copied = self.backend.new_event()
                copied.record(stream)
                pending.copied[d] = copied
        finally:
            pending.enqueued.set()  # the pre-step hook must never wait for a thread that failed

    def synchronize(self, pending: PendingCopy) -> None:
        """On the copy thread: returns once every copy of ``pending`` has landed in the slot."""
        if len(pending.copied) != len(pending.streams):
            raise RuntimeError("the snapshot's device copies were not all issued")
        for copied in pending.copied.values():
            copied.synchronize()
        pending.keep.clear()
        pending.later.clear()

    def before_step(self, pending: PendingCopy) -> None:
        """On the training thread, before ``optimizer.step()``: the step waits on the device
        for the copies of what it is about to change (once per save)."""
        if not pending.wait_at_step or pending.step_waited:
            return
        pending.enqueued.wait()
        for d, copied in pending.copied.items():
            self._hold(self.backend.current_stream(d), copied)
        pending.step_waited = True

    def drain(self) -> None:
        """Waits on the host for every copy issued so far (before the copier is given up)."""
        for stream in self._streams.values():
            with contextlib.suppress(Exception):
                stream.synchronize()

    def _issue(self, copies: Iterable[Copy], streams: dict[torch.device, Any]) -> None:
        by_device: dict[torch.device, list[Copy]] = {}
        for dst, src in copies:
            by_device.setdefault(src.device, []).append((dst, src))
        for d, pairs in by_device.items():
            with self.backend.on_stream(streams[d]):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = self.backend.new_stream(device)
        return stream

    # -- staging ---------------------------------------------------------------------------

    def _staging_views(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor, bool]],
                       streams: dict[torch.device, Any]) -> list[torch.Tensor] | None:
        """A device view per copy in the staging buffer, or None to copy without staging."""
        if not self.staging_limit_bytes or self.staging_refused is not None:
            return None
        key = tuple((src.device, src.dtype, tuple(src.shape)) for _, src, _ in copies)
        if self._staging is not None and self._staging[0] == key:
            return self._staging[1]
        offsets: list[int] = []
        sizes: dict[torch.device, int] = {}
        for _, src, _ in copies:
            at = sizes.get(src.device, 0)
            offsets.append(at)
            sizes[src.device] = align_up(at + src.numel() * src.element_size())
        needed = sum(sizes.values())
        if needed > self.staging_limit_bytes:
            if not self._staging_too_big_logged:
                self._staging_too_big_logged = True
                logger.info("CUDA snapshot of %d bytes exceeds the staging bound of %d bytes "
                            "(--ckpt-gpu-staging-mb); copying without staging", needed,
                            self.staging_limit_bytes)
            return None
        self._staging = None  # the previous buffer is freed before the new one is taken
        try:
            buffers = {d: self.backend.staging_buffer(n, d, streams[d]) for d, n in sizes.items()}
        except torch.OutOfMemoryError as e:
            self.staging_refused = f"out of device memory for {needed} bytes of staging"
            logger.warning("%s (%s); CUDA snapshots are copied without staging",
                           self.staging_refused, str(e).splitlines()[0])
            return None
        views = [
            buffers[src.device][at : at + src.numel() * src.element_size()]
            .view(src.dtype).view(src.shape)
            for (_, src, _), at in zip(copies, offsets, strict=True)
        ]
        self._staging = (key, views)
        return views

    # -- accounting ------------------------------------------------------------------------

    def _hold(self, stream: Any, event: Any) -> None:
        """``stream`` waits for ``event`` on the device, bracketed by two timing events."""
        before = self.backend.new_event(timing=True)
        before.record(stream)
        stream.wait_event(event)
        after = self.backend.new_event(timing=True)
        after.record(stream)
        with self._waits_lock:
            self._waits.append((before, after))

    def collect_stall_s(self) -> float:
        """Seconds training's streams spent waiting on snapshot copies, over the waits that
        have passed since the last call (the others are counted once they pass)."""
        passed, waiting = [], []
        with self._waits_lock:
            for wait in self._waits:
                (passed if wait[1].query() else waiting).append(wait)
            self._waits = waiting
        return sum(before.elapsed_time(after) for before, after in passed) / 1000.0


def _devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    return list(dict.fromkeys(t.device for t in tensors))


def _address_of(buffer: Any) -> int:
    anchor = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # the export would keep the mapping from being closed


# ----------------------------------------------------------------------------------------------
# Restoring.

BOUNCE_BYTES = 256 << 20
"""Size of each of the two pinned buffers a restore copies through."""


def restore_copy(pairs: Sequence[Copy], backend: Backend | None = None,
                 bounce_bytes: int = BOUNCE_BYTES) -> None:
    """Copies (live tensor, snapshot view in shared memory) pairs for a restore.

    Host tensors are copied on every core (:func:`~elasticft.ckpt.hostcopy.copy_all`). A device
    tensor is not copied straight from the slot: from pageable memory the driver stages every
    byte itself, synchronously (4.8 GB took 0.94 s on an H100; 0.57 s more to register the slot
    first). Its bytes go through two reused pinned buffers instead: while the device copies one
    buffer on a stream of its own, the host fills the other (the same 4.8 GB: 0.15 s, measured
    there). The current stream then waits for that stream, so training's first step sees the
    restored state. ``backend``: see :class:`Backend` (None: CUDA, created only when needed).
    """
    device_type = backend.device_type if backend is not None else "cuda"
    host: list[Copy] = []
    by_device: dict[torch.device, list[Copy]] = {}
    for dst, src in pairs:
        if (dst.device.type == device_type and src.device.type == "cpu"
                and dst.dtype == src.dtype and dst.shape == src.shape
                and dst.is_contiguous() and src.is_contiguous() and dst.numel()):
            by_device.setdefault(dst.device, []).append((dst, src))
        else:
            host.append((dst, src))
    copy_all(host)
    if not by_device:
        return
    backend = backend or CudaBackend()
    buffers = [backend.pinned_buffer(bounce_bytes) for _ in range(2)]
    for device, copies in by_device.items():
        stream = backend.new_stream(device)
        landed: list[Any] = [None, None]
        turn = 0
        for dst, src in copies:
            dst_bytes = dst.view(-1).view(torch.uint8)
            src_bytes = src.reshape(-1).view(torch.uint8)
            for start in range(0, dst_bytes.numel(), bounce_bytes):
                length = min(bounce_bytes, dst_bytes.numel() - start)
                buffer = buffers[turn]
                if landed[turn] is not None:
                    landed[turn].synchronize()  # the device is done with this buffer
                ctypes.memmove(buffer.data_ptr(), src_bytes.data_ptr() + start, length)
                with backend.on_stream(stream):
                    dst_bytes[start:start + length].copy_(buffer[:length], non_blocking=True)
                    landed[turn] = backend.new_event()
                    landed[turn].record(stream)
                turn = 1 - turn
        done = backend.new_event()
        done.record(stream)
        backend.current_stream(device).wait_event(done)
        for event in landed:
            if event is not None:
                event.synchronize()  # the buffers go on to the next device, or are freed
