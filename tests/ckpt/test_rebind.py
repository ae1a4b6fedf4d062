"""``Checkpointer.rebind``: one checkpointer, the same object around the same optimizers, pointed
at another rank's memory (what a pre-started spare does when it takes a failed rank)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from elasticft.ckpt import Checkpointer, StateCapture, WorkerSettings
from elasticft.ckpt.memory.shm import SlotSet
from elasticft.ckpt.settings import ENV_SHM, ENV_SLOTS
from tests.ckpt.helpers import remove_segments, trained_model, unique_prefix


@pytest.fixture
def prefixes() -> Iterator[tuple[str, str]]:
    names = (unique_prefix(0), unique_prefix(1))
    yield names
    for name in names:
        remove_segments(name)


@pytest.mark.timeout(60)
def test_a_rebound_checkpointer_keeps_its_optimizers_and_defaults_for_the_new_rank(
        tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters())
    settings = WorkerSettings.from_env({}, ckpt_dir=tmp_path, keep=2, slots=2, memory=False)
    ckpt = Checkpointer(settings, optimizers=[optim], rank=0, world_size=1, dedup_replicas=True)
    try:
        ckpt.rebind({"LOCAL_RANK": "1"}, rank=3, world_size=4)
        assert (ckpt.rank, ckpt.world_size, ckpt.optimizers) == (3, 4, (optim,))
        assert ckpt.dedup_replicas  # asked for in a world of one, granted in the real one
        assert (ckpt.settings.local_rank, ckpt.settings.local_dir, ckpt.settings.keep,
                ckpt.settings.slots) == (1, tmp_path, 2, 2)
        assert len(optim._optimizer_step_pre_hooks) == 1  # the old hook went with close()
    finally:
        ckpt.close()


@pytest.mark.timeout(60)
def test_after_a_rebind_saves_go_to_the_other_rank_s_memory(
        prefixes: tuple[str, str]) -> None:
    own, theirs = prefixes
    model, optim = trained_model()
    capture = StateCapture(model, optim)
    ckpt = Checkpointer(WorkerSettings(shm_slots=own, slots=2, agent_owned=True),
                        optimizers=[optim], rank=0, world_size=1)
    try:
        assert ckpt.save(1, capture(extra={"step": 1})).wait(30).status == "memory"
        ckpt.rebind({ENV_SHM: theirs, ENV_SLOTS: "2", "LOCAL_RANK": "0"}, rank=0, world_size=1)
        assert ckpt.settings.shm_slots == theirs and ckpt.settings.agent_owned
        assert ckpt.save(7, capture(extra={"step": 7})).wait(30).status == "memory"
    finally:
        ckpt.close()
    steps = {}
    for prefix in prefixes:
        slots = SlotSet(prefix, 2)
        try:
            newest = slots.newest()
            steps[prefix] = newest[1].step if newest is not None else None
        finally:
            slots.close()
    assert steps == {own: 1, theirs: 7}


@pytest.mark.timeout(30)
def test_instances_are_every_checkpointer_the_process_still_holds(tmp_path: Path) -> None:
    settings = WorkerSettings.from_env({}, ckpt_dir=tmp_path, memory=False)
    kept = Checkpointer(settings)
    dropped = Checkpointer(settings)
    dropped.close()
    assert {id(kept), id(dropped)} <= {id(c) for c in Checkpointer.instances()}
    dropped_id = id(dropped)
    del dropped
    gc.collect()
    assert dropped_id not in {id(c) for c in Checkpointer.instances()}
    assert kept in Checkpointer.instances()
    kept.close()
