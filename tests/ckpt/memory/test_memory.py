"""The memory tier: shared-memory slots, double buffering, torn writes, readers, the memory cap."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from elasticft.ckpt import Checkpointer, WorkerSettings, capture, restore
from elasticft.ckpt.api import StorageFull
from elasticft.ckpt.control import SkipReader
from elasticft.ckpt.memory.shm import MemoryTier, SlotSet
from elasticft.ckpt.memory.slotformat import COMPLETE, WRITING
from elasticft.ckpt.memory.slotmaker import SlotMaker
from tests.ckpt.helpers import remove_segments, trained_model, unique_prefix
from tests.conftest import ROOT


@pytest.fixture
def prefix():
    name = unique_prefix()
    yield name
    remove_segments(name)


def _settings(prefix: str, **kw) -> WorkerSettings:
    return WorkerSettings(shm_slots=prefix, agent_owned=True, **kw)


@pytest.mark.smoke
@pytest.mark.timeout(60)
def test_save_is_exact_state_after_the_step_and_double_buffered(prefix: str) -> None:
    model, optim = trained_model()
    with Checkpointer(_settings(prefix, slots=2), optimizers=[optim]) as ckpt:
        expected = {}
        for step in range(1, 4):
            request = ckpt.save(step, capture(model, optim, {"step": step}))
            expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
            # The next step changes parameters in place; the pre-step hook keeps the snapshot
            # at the state after `step`.
            model(torch.ones(2, 8)).sum().backward()
            optim.step()
            optim.zero_grad()
            assert request.wait(30).status == "memory"
        slots = SlotSet(prefix, 2)
        assert sorted(h.step for h in slots.complete().values()) == [2, 3]
        step, state = ckpt.load()
        slots.close()
    assert step == 3 and ckpt.last_source == "memory"
    fresh, fresh_optim = trained_model(seed=1)
    assert restore(state, fresh, fresh_optim) == {"step": 3}
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[3][name]), name
    # In place from shared memory (no intermediate copy), as a restarted worker does it.
    again, again_optim = trained_model(seed=2)
    with Checkpointer(_settings(prefix)) as reader:
        assert reader.restore(again, again_optim) == (3, {"step": 3})
    assert reader.last_source == "memory"
    for name, value in again.state_dict().items():
        assert torch.equal(value, expected[3][name]), name
    assert torch.equal(again_optim.state_dict()["state"][0]["exp_avg"],
                       fresh_optim.state_dict()["state"][0]["exp_avg"])


_WRITER = textwrap.dedent("""
    import os, signal, sys, torch
    from elasticft.ckpt import Checkpointer, WorkerSettings
    from elasticft.ckpt.memory.shm import SlotSet
    from elasticft.ckpt.memory.slotformat import WRITING
    prefix = sys.argv[1]
    big = torch.nn.Parameter(torch.full((32 << 20,), 1.0))   # 128 MB: the copy takes a while
    optim = torch.optim.SGD([big], lr=0.1)
    ckpt = Checkpointer(WorkerSettings(shm_slots=prefix, agent_owned=True), optimizers=[optim])
    ckpt.save(1, {"w": big.detach(), "extra": {"step": 1}}).wait()
    slots = SlotSet(prefix, 2)
    # Killed once a step's copy is seen in flight; a copy that ended unseen (this thread was
    # not scheduled meanwhile) is followed by the next step's.
    for step in range(2, 100):
        with torch.no_grad():
            big.fill_(float(step))
        request = ckpt.save(step, {"w": big.detach(), "extra": {"step": step}})
        while not request.done():
            if any(h.step == step and h.state == WRITING for h in slots.headers().values()):
                os.kill(os.getpid(), signal.SIGKILL)
        request.wait()
    sys.exit(3)  # no copy was ever seen in flight
""")


@pytest.mark.timeout(60)
def test_an_optimizer_watched_after_construction_keeps_the_snapshot_exact(prefix: str) -> None:
    """A framework makes its optimizer after the checkpointer: watch() gives it the pre-step
    hook the constructor's optimizers get, once however often it is called."""
    model, optim = trained_model()
    with Checkpointer(_settings(prefix, slots=2)) as ckpt:
        ckpt.watch(optim)
        ckpt.watch(optim)
        assert ckpt.optimizers == (optim,)
        request = ckpt.save(1, capture(model, optim, {"step": 1}))
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        model(torch.ones(2, 8)).sum().backward()
        optim.step()  # waits for the copy in flight: the snapshot stays at step 1
        assert request.wait(30).status == "memory"
        step, state = ckpt.load()
    fresh, fresh_optim = trained_model(seed=1)
    restore(state, fresh, fresh_optim)
    assert step == 1
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_writer_killed_mid_save_leaves_previous_snapshot_intact(prefix: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _WRITER, prefix], cwd=ROOT, timeout=100)
    assert proc.returncode == -signal.SIGKILL
    slots = SlotSet(prefix, 2)
    states = {h.step: h.state for h in slots.headers().values()}
    torn = max(states)
    assert states == {torn - 1: COMPLETE, torn: WRITING}, \
        f"the newest step must be torn, the one before untouched: {states}"
    tier = MemoryTier(slots)
    assert tier.steps(0, 1) == [torn - 1]  # the torn step is never offered
    snapshot = tier.read(torn - 1, 0, 1)
    with Checkpointer(_settings(prefix)) as ckpt:
        step, state = ckpt.load()
    assert step == torn - 1 and bool((state["w"] == float(torn - 1)).all())
    assert state["extra"] == {"step": torn - 1}
    assert snapshot.step == torn - 1
    slots.close()


@pytest.mark.timeout(60)
def test_a_reader_holding_a_slot_never_costs_a_snapshot_with_the_default_slots(
    prefix: str,
) -> None:
    model, optim = trained_model()
    with Checkpointer(_settings(prefix), optimizers=[optim]) as ckpt:
        reader = SlotSet(prefix, 3)
        held = None
        for step in range(1, 8):
            assert ckpt.save(step, capture(model, optim)).wait(30).status == "memory"
            if held is None:  # the agent starts copying step 1 out and takes its time
                held = reader.get(reader.newest()[0])
                assert held is not None and held.try_lock(exclusive=False)
        assert held is not None
        held.unlock()
        assert ckpt.snapshots_skipped == 0
        assert ckpt.newest_step() == 7
        reader.close()


@pytest.mark.timeout(60)
def test_writer_skips_a_slot_a_reader_holds_never_waits_and_says_so(
    prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    model, optim = trained_model()
    settings = _settings(prefix, slots=2, control_dir=tmp_path)
    with Checkpointer(settings, optimizers=[optim]) as ckpt:
        ckpt.save(1, capture(model, optim)).wait(30)
        ckpt.save(2, capture(model, optim)).wait(30)
        reader = SlotSet(prefix, 2)
        oldest = min(reader.complete().items(), key=lambda ih: ih[1].generation)[0]
        slot = reader.get(oldest)
        assert slot is not None and slot.try_lock(exclusive=False)  # the agent persisting step 1
        try:
            request = ckpt.save(3, capture(model, optim)).wait(30)
        finally:
            slot.unlock()
        assert request.status == "skipped"
        assert request.skipped is not None and "ckpt_memory_slots" in request.skipped
        assert ckpt.snapshots_skipped == 1
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any("memory snapshot of step 3 skipped" in r.getMessage() for r in warnings)
        assert ckpt.save(4, capture(model, optim)).wait(30).status == "memory"
        assert ckpt.save(5, capture(model, optim)).wait(30).skipped is None
        assert sorted(h.step for h in reader.complete().values()) == [4, 5]
        reader.close()
    # The agent reads what the worker reported, once.
    skips = SkipReader()
    found = skips.new_skips(tmp_path)
    assert [(s["rank"], s["local_rank"], s["step"]) for s in found] == [(0, 0, 3)]
    assert found[0]["reason"] == request.skipped
    assert skips.new_skips(tmp_path) == []


@pytest.mark.timeout(60)
def test_memory_cap_too_small_fails_the_request_with_a_clear_error(prefix: str) -> None:
    model, optim = trained_model()
    with Checkpointer(_settings(prefix, memory_cap_bytes=4096), optimizers=[optim]) as ckpt:
        request = ckpt.save(1, capture(model, optim))
        with pytest.raises(StorageFull, match="memory cap of 4096 bytes"):
            request.wait(30)
        assert request.status == "failed"


@pytest.mark.timeout(60)
def test_process_owned_memory_is_removed_at_exit() -> None:
    code = textwrap.dedent("""
        import torch
        from elasticft.ckpt import Checkpointer
        ckpt = Checkpointer.from_env(env={})
        ckpt.save(1, {"w": torch.ones(10)}).wait()
        print(ckpt.settings.shm_slots)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=50, env={k: v for k, v in os.environ.items()
                                          if not k.startswith(("ELASTICFT_", "TORCHELASTIC_"))})
    assert out.returncode == 0, out.stderr
    prefix = out.stdout.strip().splitlines()[-1]
    assert prefix.startswith("elasticft-ckpt-")
    assert not list(Path("/dev/shm").glob(f"{prefix}-*"))


@pytest.mark.timeout(60)
def test_a_slot_still_being_made_when_the_set_is_removed_leaves_no_file(prefix: str) -> None:
    # At exit the checkpointer removes its slots while the maker may still be allocating one;
    # before, the maker renamed it into place afterwards (or was cut off under a temporary
    # name), and the slot outlived the process.
    slots = SlotSet(prefix, 2, maker=SlotMaker())
    assert slots.ensure(1, 256 << 20) is None  # asked for: the maker allocates it now
    slots.unlink()
    assert not any(t.name == "elasticft-ckpt-slots" for t in threading.enumerate())
    assert not list(Path("/dev/shm").glob(f"{prefix}*"))


def _live_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    for per_param in optim.state.values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return tensors


@pytest.mark.smoke
@pytest.mark.timeout(60)
def test_restored_state_never_aliases_the_snapshot_and_training_leaves_it_intact(
    prefix: str,
) -> None:
    model, optim = trained_model()
    with Checkpointer(_settings(prefix), optimizers=[optim]) as ckpt:
        ckpt.save(1, capture(model, optim, {"step": 1})).wait(30)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_optim = trained_model(seed=3)
    with Checkpointer(_settings(prefix)) as reader:
        assert reader.restore(fresh, fresh_optim) == (1, {"step": 1})
    slots = SlotSet(prefix, 2)
    try:
        index, _ = slots.newest()
        slot = slots.get(index)
        assert slot is not None
        start = torch.frombuffer(slot.map, dtype=torch.uint8).data_ptr()
        for tensor in _live_tensors(fresh, fresh_optim):
            address = tensor.untyped_storage().data_ptr()
            assert not start <= address < start + slot.size, "live state inside a snapshot"
    finally:
        slots.close()
    for _ in range(2):  # training goes on from the restored state
        fresh(torch.ones(2, 8)).sum().backward()
        fresh_optim.step()
        fresh_optim.zero_grad()
    with Checkpointer(_settings(prefix)) as reader:
        step, state = reader.load()  # the seal still matches: nothing wrote into the snapshot
    assert step == 1
    for name, value in saved.items():
        assert torch.equal(state["model"][name], value), name


@pytest.mark.timeout(60)
def test_snapshot_overwritten_after_complete_fails_its_seal_and_load_falls_back(
    prefix: str,
) -> None:
    """What training state aliasing a snapshot would do: the seal catches it, the older step
    loads instead."""
    big = torch.nn.Parameter(torch.zeros(1 << 16))
    optim = torch.optim.SGD([big], lr=0.1)
    with Checkpointer(_settings(prefix), optimizers=[optim]) as ckpt:
        for step in (1, 2):
            with torch.no_grad():
                big.fill_(float(step))
            ckpt.save(step, {"w": big.detach(), "extra": {"step": step}}).wait(30)
    slots = SlotSet(prefix, 2)
    try:
        index, header = slots.newest()
        assert header.step == 2
        slot = slots.get(index)
        assert slot is not None
        payload = torch.frombuffer(slot.payload(header), dtype=torch.float32)
        payload[: 1 << 15].fill_(7.0)  # half the tensor, in place, after COMPLETE
    finally:
        slots.close()
    with Checkpointer(_settings(prefix)) as reader:
        step, state = reader.load()
    assert step == 1 and reader.last_source == "memory"
    assert torch.equal(state["w"], torch.full((1 << 16,), 1.0))


def test_directories_may_be_given_as_strings(tmp_path: Path) -> None:
    from elasticft.ckpt.settings import WorkerSettings

    settings = WorkerSettings.from_env({}, ckpt_dir=str(tmp_path / "a"),
                                       remote_dir=str(tmp_path / "b"))
    assert (settings.local_dir, settings.remote_dir) == (tmp_path / "a", tmp_path / "b")


def test_sweep_removes_the_segments_of_owners_that_are_gone(tmp_path: Path) -> None:
    from elasticft.ckpt.memory.shm import segment_prefix, slot_path, sweep_orphans

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = slot_path(segment_prefix(int(gone.stdout), "job", 0), 0, tmp_path)
    alive = slot_path(segment_prefix(os.getpid(), "job", 0), 1, tmp_path)
    other = tmp_path / "unrelated-segment"
    for path in (dead, alive, other):
        path.write_bytes(b"x")
    assert sweep_orphans(tmp_path) == [dead]
    assert not dead.exists() and alive.exists() and other.exists()


@pytest.mark.timeout(60)
def test_a_renumbered_checkpointer_restores_the_old_ranks_snapshots_then_its_own(
        prefix: str) -> None:
    """A reshape in process renumbers a survivor (rank 2 of 4 -> rank 0 of 2): what it wrote
    as rank 2 still restores, and once it saved as rank 0 that comes first."""
    model, optim = trained_model()
    with Checkpointer(_settings(prefix, slots=3), optimizers=[optim], rank=2,
                      world_size=4) as ckpt:
        assert ckpt.save(1, capture(model, optim, {"step": 1})).wait(30).status == "memory"
        ckpt.renumber(0, 2)
        assert (ckpt.rank, ckpt.world_size) == (0, 2)
        fresh, fresh_optim = trained_model(seed=1)
        assert ckpt.restore(fresh, fresh_optim) == (1, {"step": 1})
        assert ckpt.last_source == "memory"
        assert all(torch.equal(a, b) for a, b in zip(
            fresh.state_dict().values(), model.state_dict().values(), strict=True))
        assert ckpt.save(2, capture(model, optim, {"step": 2})).wait(30).status == "memory"
        slots = SlotSet(prefix, 3)
        held = sorted((h.step, h.rank, h.world_size) for h in slots.complete().values())
        slots.close()
        assert held == [(1, 2, 4), (2, 0, 2)]
        assert MemoryTier(SlotSet(prefix, 3)).steps(0, 2) == [2]
        assert MemoryTier(SlotSet(prefix, 3), held_as=((2, 4),)).steps(0, 2) == [2, 1]
        assert ckpt.restore(fresh, fresh_optim) == (2, {"step": 2})
