"""The CUDA path's ordering, checked call by call without a GPU.

:class:`~elasticft.ckpt.memory.device.DeviceCopier` decides which copies go when, on which stream,
and what training waits for. Here its backend is a recording stand-in whose "device" is the CPU:
streams and events write what they are asked to do into a trace, copies run at once on real
tensors. The tables below fix the trace of each case; ``tests/ckpt/memory/test_ckpt_cuda.py``
(marked ``gpu``) runs the same code on CUDA, where the ordering is enforced by the device.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticft.ckpt import Checkpointer, WorkerSettings, capture
from elasticft.ckpt.memory.device import DeviceCopier, restore_copy
from elasticft.ckpt.memory.shm import SlotSet
from elasticft.ckpt.memory.slot import Slot
from tests.ckpt.helpers import (
    pinned_slots,
    remove_segments,
    trained_model,
    unique_prefix,
    wait_pinned,
    waits_pending,
)

TRAIN = "train"


class Stream:
    def __init__(self, name: str, trace: list[str]) -> None:
        self.name, self._trace = name, trace

    def wait_event(self, event: Event) -> None:
        self._trace.append(f"{self.name} waits {event.name}")

    def synchronize(self) -> None:
        self._trace.append(f"sync {self.name}")


class Event:
    def __init__(self, name: str, trace: list[str], clock: list[float],
                 release: threading.Event) -> None:
        self.name, self._trace, self._clock, self._release = name, trace, clock, release
        self.passed = True
        self.at = 0.0

    def record(self, stream: Stream) -> None:
        self.at = self._clock[0]
        self._trace.append(f"{self.name} on {stream.name}")

    def synchronize(self) -> None:
        self._release.wait(30)  # a copy "in flight" until the test lets it land
        self._trace.append(f"sync {self.name}")

    def query(self) -> bool:
        return self.passed

    def elapsed_time(self, other: Event) -> float:
        return (other.at - self.at) * 1000.0


class RecordingBackend:
    """A CPU "device": what would be CUDA calls become lines of ``trace``."""

    device_type = "cpu"

    def __init__(self, refuse_pin: str | None = None, staging_fails: bool = False) -> None:
        self.trace: list[str] = []
        self.events: list[Event] = []
        self.clock = [0.0]
        self.refuse_pin = refuse_pin
        self.staging_fails = staging_fails
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.copies_land = threading.Event()
        self.copies_land.set()

    def current_stream(self, device: torch.device) -> Stream:
        return Stream(TRAIN, self.trace)

    def new_stream(self, device: torch.device) -> Stream:
        self.trace.append("new copy stream")
        return Stream("copy", self.trace)

    def new_event(self, timing: bool = False) -> Event:
        event = Event(f"{'t' if timing else 'e'}{len(self.events)}", self.trace, self.clock,
                      self.copies_land)
        self.events.append(event)
        return event

    @contextlib.contextmanager
    def on_stream(self, stream: Stream) -> Iterator[None]:
        self.trace.append(f"issue on {stream.name}")
        yield

    def register_host(self, address: int, size: int) -> str | None:
        if self.refuse_pin:
            return self.refuse_pin
        self.registered[address] = size
        return None

    def unregister_host(self, address: int) -> None:
        self.unregistered.append(address)

    def pinned_buffer(self, nbytes: int) -> torch.Tensor:
        self.trace.append(f"pinned {nbytes}")
        return torch.empty(nbytes, dtype=torch.uint8)

    def staging_buffer(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        if self.staging_fails:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.trace.append(f"staging {nbytes} bytes")
        return torch.zeros(nbytes, dtype=torch.uint8)


def _copies() -> tuple[list[tuple[torch.Tensor, torch.Tensor, bool]], torch.Tensor, torch.Tensor]:
    """A buffer (changed by the next forward) and a parameter (changed only by the step)."""
    buffer, weight = torch.arange(4.0), torch.arange(10.0, 16.0)
    copies = [(torch.zeros(4), buffer, False), (torch.zeros(6), weight, True)]
    return copies, buffer, weight


@pytest.mark.parametrize(
    "case, staging_bytes, fails, begin_trace, wait_at_step",
    [
        # Without staging the buffer is copied now and training waits for it on the device;
        # the parameter is left to the copy thread, and the next optimizer step waits for it.
        ("event-ordered", 0, False,
         ["new copy stream", "e0 on train", "copy waits e0", "issue on copy", "e1 on copy",
          "t2 on train", "train waits e1", "t3 on train"], True),
        # With staging, everything is copied device to device now; training waits only for that.
        ("staged", 1 << 20, False,
         ["new copy stream", "e0 on train", "copy waits e0", "staging 128 bytes",
          "issue on copy", "e1 on copy", "t2 on train", "train waits e1", "t3 on train"], False),
        # State larger than the staging bound, or staging out of memory: event-ordered.
        ("too big to stage", 64, False,
         ["new copy stream", "e0 on train", "copy waits e0", "issue on copy", "e1 on copy",
          "t2 on train", "train waits e1", "t3 on train"], True),
        ("staging out of memory", 1 << 20, True,
         ["new copy stream", "e0 on train", "copy waits e0", "issue on copy", "e1 on copy",
          "t2 on train", "train waits e1", "t3 on train"], True),
    ],
)
def test_copies_are_ordered_after_the_step_and_training_waits_only_where_it_must(
    case: str, staging_bytes: int, fails: bool, begin_trace: list[str], wait_at_step: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = RecordingBackend(staging_fails=fails)
    copier = DeviceCopier(staging_bytes, backend)
    copies, buffer, weight = _copies()
    (buffer_dst, _, _), (weight_dst, _, _) = copies

    pending = copier.begin(copies)
    assert backend.trace == begin_trace, case
    assert pending.wait_at_step is wait_at_step
    if staging_bytes and not fails and staging_bytes >= 128:
        assert not buffer_dst.any() and not weight_dst.any()  # only staged so far
    else:
        assert torch.equal(buffer_dst, buffer) and not weight_dst.any()
    if fails:
        assert copier.staging_refused and "out of device memory" in caplog.text

    del backend.trace[:]
    copier.issue_rest(pending)
    assert backend.trace == ["issue on copy", "e4 on copy"]
    assert pending.enqueued.is_set()

    del backend.trace[:]
    copier.before_step(pending)
    copier.before_step(pending)  # a second optimizer, or the same one again: no second wait
    assert backend.trace == (["t5 on train", "train waits e4", "t6 on train"]
                             if wait_at_step else [])

    del backend.trace[:]
    copier.synchronize(pending)
    assert backend.trace == ["sync e4"]
    assert torch.equal(buffer_dst, buffer) and torch.equal(weight_dst, weight)
    assert not pending.keep


def test_a_snapshot_with_only_optimizer_state_makes_training_wait_at_the_step_only() -> None:
    backend = RecordingBackend()
    copier = DeviceCopier(0, backend)
    weight = torch.ones(3)
    pending = copier.begin([(torch.zeros(3), weight, True)])
    assert backend.trace == ["new copy stream", "e0 on train", "copy waits e0"]
    copier.issue_rest(pending)
    copier.before_step(pending)
    assert backend.trace[-3:] == ["t2 on train", "train waits e1", "t3 on train"]


def test_staging_is_allocated_once_per_layout() -> None:
    backend = RecordingBackend()
    copier = DeviceCopier(1 << 20, backend)
    for _ in range(3):
        copies, _, _ = _copies()
        copier.synchronize(_issued(copier, copies))
    assert backend.trace.count("staging 128 bytes") == 1
    copier.synchronize(_issued(copier, [(torch.zeros(2), torch.ones(2), True)]))
    assert "staging 64 bytes" in backend.trace  # another layout, another buffer


def _issued(copier: DeviceCopier, copies: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> Any:
    pending = copier.begin(copies)
    copier.issue_rest(pending)
    return pending


@pytest.mark.parametrize("staging_bytes", [0, 1 << 20])
def test_every_dtype_lands_bit_exact_with_and_without_staging(staging_bytes: int) -> None:
    sources = [
        torch.randn(7, 3).to(torch.bfloat16),
        torch.randn(5).to(torch.float16),
        torch.randn(9).to(torch.float8_e4m3fn),
        torch.arange(3, dtype=torch.int64),
        torch.tensor(True),
        torch.randn(2, 2, dtype=torch.float64),
    ]
    copies = [(torch.empty_like(src), src, index % 2 == 0) for index, src in enumerate(sources)]
    copier = DeviceCopier(staging_bytes, RecordingBackend())
    copier.synchronize(_issued(copier, copies))
    for dst, src, _ in copies:
        assert dst.dtype == src.dtype and torch.equal(dst.view(torch.uint8),
                                                      src.view(torch.uint8))


def test_a_copy_thread_that_fails_still_releases_the_step() -> None:
    backend = RecordingBackend()
    copier = DeviceCopier(0, backend)
    pending = copier.begin([(torch.zeros(2), torch.ones(3), True)])  # sizes do not match
    with pytest.raises(RuntimeError):
        copier.issue_rest(pending)
    assert pending.enqueued.is_set()
    with pytest.raises(RuntimeError, match="not all issued"):
        copier.synchronize(pending)


@pytest.mark.parametrize(
    "waits, passed, expected_s",
    [
        ([], [], 0.0),
        ([(1.0, 1.25)], [True], 0.25),
        ([(1.0, 1.25), (2.0, 2.5)], [True, False], 0.25),  # the second one is counted later
        ([(1.0, 1.0), (2.0, 2.1)], [True, True], 0.1),
    ],
)
def test_device_waits_are_counted_once_they_passed(
    waits: list[tuple[float, float]], passed: list[bool], expected_s: float
) -> None:
    backend = RecordingBackend()
    copier = DeviceCopier(0, backend)
    done = backend.new_event()
    afters = []
    for (start, end), has_passed in zip(waits, passed, strict=True):
        backend.clock[0] = start
        copier._hold(Stream(TRAIN, backend.trace), done)
        after = backend.events[-1]
        after.at, after.passed = end, has_passed
        afters.append(after)
    assert copier.collect_stall_s() == pytest.approx(expected_s)
    assert waits_pending(copier) == passed.count(False)
    for after in afters:
        after.passed = True
    later = sum(end - start for (start, end), p in zip(waits, passed, strict=True) if not p)
    assert copier.collect_stall_s() == pytest.approx(later)
    assert copier.collect_stall_s() == 0.0


def test_slots_are_pinned_once_and_unpinned_before_they_are_unmapped(tmp_path: Path) -> None:
    backend = RecordingBackend()
    copier = DeviceCopier(0, backend)
    slot = Slot.create_or_grow(tmp_path / "slot", 1 << 16)
    copier.pin(slot)
    copier.pin(slot)
    wait_pinned(copier)
    assert list(backend.registered.values()) == [1 << 16] and pinned_slots(copier) == 1
    slot.close()
    assert backend.unregistered == list(backend.registered) and pinned_slots(copier) == 0


def test_memory_that_cannot_be_pinned_is_said_once_and_copies_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = RecordingBackend(refuse_pin="cudaHostRegister error 2: out of memory")
    copier = DeviceCopier(0, backend)
    for name in ("a", "b"):
        copier.pin(Slot.create_or_grow(tmp_path / name, 4096))
        wait_pinned(copier)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ulimit -l" in warnings[0].getMessage()
    assert copier.pin_refused and not backend.registered
    copies, buffer, weight = _copies()
    copier.synchronize(_issued(copier, copies))
    assert torch.equal(copies[0][0], buffer) and torch.equal(copies[1][0], weight)


# ----------------------------------------------------------------------------------------------
# Through the checkpointer: real slots, a real model and optimizer, the CPU as the "device".


@pytest.fixture
def prefix() -> Iterator[str]:
    name = unique_prefix()
    yield name
    remove_segments(name)


@pytest.mark.smoke
@pytest.mark.timeout(60)
def test_checkpointer_snapshots_device_state_exactly_and_orders_the_step_after_it(
    prefix: str,
) -> None:
    model, optim = trained_model()
    backend = RecordingBackend()
    copier = DeviceCopier(0, backend)
    settings = WorkerSettings(shm_slots=prefix, agent_owned=True)
    with Checkpointer(settings, optimizers=[optim], device_copier=copier) as ckpt:
        # The first save is staged while its slots are made (off this thread); the device
        # path starts once they exist.
        first = ckpt.save(0, capture(model, optim, {"step": 0}))
        assert first.wait(30).status == "memory" and first.device is None
        slots = ckpt._slots
        assert slots is not None and slots.maker is not None
        for path in slots.paths:  # all asked for by the first save; made one by one
            slots.maker.wait(path, 1, timeout_s=30)
        for step in (1, 2):
            backend.copies_land.clear()  # the copy stays in flight until after the next step
            request = ckpt.save(step, capture(model, optim, {"step": step}))
            expected = {k: v.clone() for k, v in model.state_dict().items()}
            expected_avg = optim.state_dict()["state"][0]["exp_avg"].clone()
            model(torch.ones(2, 8)).sum().backward()
            optim.step()  # the pre-step hook: the training stream waits for the copy
            optim.zero_grad()
            assert request.device is not None and request.device.step_waited
            assert backend.trace[-1].startswith("t") and backend.trace[-2].startswith(
                "train waits")
            backend.copies_land.set()
            assert request.wait(30).status == "memory"
            step_loaded, state = ckpt.load()
            assert step_loaded == step
            for name, value in state["model"].items():
                assert torch.equal(value, expected[name]), name
            assert torch.equal(state["optim"]["state"]["0.weight"]["exp_avg"], expected_avg)
        wait_pinned(copier)
        assert pinned_slots(copier) == 2
        assert ckpt.stall_s >= 0.0 and waits_pending(copier) == 0
    assert pinned_slots(copier) == 0 and len(backend.unregistered) == 2


class _BrokenBackend(RecordingBackend):
    def __init__(self, fails_in: str) -> None:
        super().__init__()
        self.fails_in = fails_in

    def new_stream(self, device: torch.device) -> Stream:
        if self.fails_in == "new_stream":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().new_stream(device)

    @contextlib.contextmanager
    def on_stream(self, stream: Stream) -> Iterator[None]:
        if self.fails_in == "on_stream":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        yield


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fails_in", ["new_stream", "on_stream"])
def test_a_failing_device_path_is_said_once_and_no_snapshot_is_lost(
    prefix: str, fails_in: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, optim = trained_model()
    settings = WorkerSettings(shm_slots=prefix, agent_owned=True)
    backend = _BrokenBackend(fails_in)
    copier = DeviceCopier(0, backend)
    with Checkpointer(settings, optimizers=[optim], device_copier=copier) as ckpt:
        for step in (1, 2, 3):
            assert ckpt.save(step, capture(model, optim, {"step": step})).wait(30).status \
                == "memory"
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        assert ckpt.load()[0] == 3
        state = ckpt.load()[1]
    for name, value in state["model"].items():
        assert torch.equal(value, expected[name]), name
    failures = [r for r in caplog.records if "CUDA snapshot path failed" in r.getMessage()]
    assert len(failures) == 1 and "illegal memory access" in failures[0].getMessage()
    if fails_in == "on_stream":  # copies already issued were waited for before the plain ones
        assert backend.trace[-1] == "sync copy"
    SlotSet(prefix, 2).close()


def test_a_restore_copies_device_tensors_through_two_reused_pinned_buffers() -> None:
    backend = RecordingBackend()
    sources = [torch.arange(n, dtype=torch.float32) for n in (10, 3, 40)]  # 40, 12, 160 bytes
    live = [torch.zeros_like(t) for t in sources]
    restore_copy(list(zip(live, sources, strict=True)), backend, bounce_bytes=64)
    assert all(torch.equal(d, s) for d, s in zip(live, sources, strict=True))
    trace = backend.trace
    assert trace[:3] == ["pinned 64", "pinned 64", "new copy stream"]
    # Five chunks (40, 12, 64, 64, 32 bytes), each issued on the copy stream with an event
    # after it; a buffer is filled again only once the chunk that last used it has landed.
    issued = [line for line in trace if line.startswith("e") and line.endswith(" on copy")]
    assert len(issued) == 6  # five chunks and the final event
    starts = [i for i, line in enumerate(trace) if line == "issue on copy"]
    for k in range(2, 5):  # the sync comes before the buffer is filled and its copy issued
        assert f"sync {issued[k - 2].split()[0]}" in trace[starts[k - 1]:starts[k]], k
    # Training's stream waits for the last one; both buffers have landed before it returns.
    final = issued[-1].split()[0]
    assert f"{TRAIN} waits {final}" in trace
    assert sorted(trace[-2:]) == [f"sync {issued[-3].split()[0]}", f"sync {issued[-2].split()[0]}"]


def test_a_restore_copies_host_tensors_and_odd_pairs_without_the_device_path() -> None:
    backend = RecordingBackend()
    backend.device_type = "meta"  # nothing here is on "the device"
    sources = [torch.arange(12.0).view(3, 4), torch.arange(6, dtype=torch.int64)]
    live = [torch.zeros(3, 4), torch.zeros(6, dtype=torch.int32)]  # the second: another dtype
    restore_copy(list(zip(live, sources, strict=True)), backend, bounce_bytes=64)
    assert torch.equal(live[0], sources[0]) and torch.equal(live[1], sources[1].int())
    assert backend.trace == []
