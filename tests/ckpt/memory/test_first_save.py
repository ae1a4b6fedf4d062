"""The training thread never makes a slot, and a restore copies from shared memory in place.

A worker's first save used to create its shared-memory slots (``posix_fallocate``) on the
training thread. Now a :class:`~elasticft.ckpt.memory.slotmaker.SlotMaker` makes them on its own
thread and the first save stages its copy until its slot exists; after a restart the slots are there
and nothing is made. Observed through the creation seam (``Slot.create_or_grow``: which thread
calls it), never through time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticft.ckpt import Checkpointer, StateCapture, WorkerSettings
from elasticft.ckpt.memory.slot import Slot
from tests.ckpt.helpers import remove_segments, trained_model, unique_prefix


@pytest.fixture
def prefix() -> Iterator[str]:
    name = unique_prefix()
    yield name
    remove_segments(name)


@pytest.fixture
def creations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread of every slot creation."""
    threads: list[str] = []
    original = Slot.create_or_grow.__func__  # type: ignore[attr-defined]

    def recorded(cls: type[Slot], path: Path, size: int) -> Slot:
        threads.append(threading.current_thread().name)
        return original(cls, path, size)

    monkeypatch.setattr(Slot, "create_or_grow", classmethod(recorded))
    return threads


def _state_of(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": {k: {n: t.clone() for n, t in v.items()}
                      for k, v in optim.state_dict()["state"].items()}}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    for index, per_param in a["optim"].items():
        for key, value in per_param.items():
            assert torch.equal(value, b["optim"][index][key]), (index, key)


@pytest.mark.timeout(60)
def test_the_first_save_makes_no_slot_on_the_training_thread_and_is_exact(
    prefix: str, creations: list[str]
) -> None:
    model, optim = trained_model()
    settings = WorkerSettings(shm_slots=prefix, agent_owned=True)
    capture = StateCapture(model, optim)
    with Checkpointer(settings, optimizers=[optim]) as ckpt:
        request = ckpt.save(1, capture(extra={"step": 1}))
        expected = _state_of(model, optim)
        # The next step runs while the slot may still be in the making; the pre-step hook
        # holds it until the staged copy is in the slot.
        model(torch.ones(2, 8)).sum().backward()
        optim.step()
        optim.zero_grad()
        assert request.wait(30).status == "memory"
        loaded = ckpt.load()
        assert loaded is not None and loaded[0] == 1
        _equal({"model": loaded[1]["model"],
                "optim": {i: loaded[1]["optim"]["state"][name]
                          for i, name in enumerate(["0.weight", "0.bias", "2.weight", "2.bias"])}},
               expected)
        second = ckpt.save(2, capture(extra={"step": 2}))
        expected = _state_of(model, optim)
        assert second.wait(30).status == "memory"
        assert ckpt._slots is not None and ckpt._slots.maker is not None
        # every slot was asked for at the first save: the last of them may still be in the
        # making on the maker's thread, so its count is waited for, not read once
        maker, deadline = ckpt._slots.maker, time.monotonic() + 30
        while maker.made_count < ckpt._slot_count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert maker.made_count == ckpt._slot_count
    assert creations and all(name == "elasticft-ckpt-slots" for name in creations), creations
    assert threading.main_thread().name not in creations

    restarted_model, restarted_optim = trained_model(seed=1)
    with Checkpointer(settings, optimizers=[restarted_optim]) as ckpt:
        restored = ckpt.restore(restarted_model, restarted_optim)
        assert restored is not None and restored[0] == 2
        _equal(_state_of(restarted_model, restarted_optim), expected)
        made_before = len(creations)
        for step in (2, 3, 4):
            assert ckpt.save(step, StateCapture(restarted_model, restarted_optim)(
                extra={"step": step})).wait(30).status == "memory"
        assert len(creations) == made_before  # after a restart the slots are reused


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_large_state_restores_bit_exact_in_place_from_shared_memory(prefix: str) -> None:
    """About 0.5 GB of AdamW state, restored into a fresh model and optimizer in place."""
    torch.manual_seed(0)
    width, layers = 1024, 40  # 40 x 4 MB parameters, x3 with AdamW's moments: ~0.5 GB

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                      for _ in range(layers)])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, optim = build()
    model(torch.randn(4, width)).sum().backward()
    optim.step()
    settings = WorkerSettings(shm_slots=prefix, agent_owned=True)
    with Checkpointer(settings, optimizers=[optim]) as ckpt:
        assert ckpt.save(7, StateCapture(model, optim)(extra={"step": 7})).wait(120).status \
            == "memory"
    expected = _state_of(model, optim)
    del model, optim
    fresh_model, fresh_optim = build()
    live_before = [p.data_ptr() for p in fresh_model.parameters()]
    with Checkpointer(settings, optimizers=[fresh_optim]) as ckpt:
        assert ckpt.restore(fresh_model, fresh_optim) == (7, {"step": 7})
        assert ckpt.last_source == "memory"
    assert [p.data_ptr() for p in fresh_model.parameters()] == live_before  # in place
    _equal(_state_of(fresh_model, fresh_optim), expected)
    # The restored state is private memory: stepping it leaves the snapshot as it was.
    fresh_model(torch.randn(4, width)).sum().backward()
    fresh_optim.step()
    with Checkpointer(settings, optimizers=[]) as ckpt:
        loaded = ckpt.load()
    assert loaded is not None and loaded[0] == 7
    for name, value in expected["model"].items():
        assert torch.equal(loaded[1]["model"][name], value), name
