"""The start snapshot: under in-process recovery, before the process's first step (a start keeper
is registered and says so), a restore that finds nothing snapshots the state training starts
from as step 0, so that a survivor whose peer fails before the first checkpoint rolls back to it
(its restore copies it back and returns None, as at the start), and its replacement starts from
the same state. Without a keeper, or after the first step, nothing is saved."""

from __future__ import annotations

import pytest
import torch

from elasticft.ckpt import Checkpointer, WorkerSettings, capture, start_snapshot
from tests.ckpt.helpers import remove_segments, trained_model, unique_prefix


@pytest.fixture
def prefix():
    name = unique_prefix()
    yield name
    remove_segments(name)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()  # the RNG moves too
        optim.step()
        optim.zero_grad()


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": len(optim.state), "rng": torch.get_rng_state().clone()}


def _same(a: dict, b: dict) -> bool:
    return (a["optim"] == b["optim"] and torch.equal(a["rng"], b["rng"])
            and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("keeper", "saved_step", "second_restore", "rolled_back"), [
    (None, None, None, False),  # no in-process recovery: nothing saved, nothing to roll back
    (True, None, None, True),  # a failure before the first save: back to the start
    (True, 1, 1, False),  # a step was saved: it is restored, as always
    (False, None, None, False),  # a first restore after a step: the state is not the start
], ids=["no-keeper", "nothing-saved", "step-saved", "after-a-step"])
def test_a_survivor_rolls_back_to_the_start_when_nothing_was_saved(
        prefix: str, keeper: bool | None, saved_step: int | None, second_restore: int | None,
        rolled_back: bool) -> None:
    model, optim = trained_model(steps=0)
    handle = start_snapshot.register_keeper(lambda: keeper) if keeper is not None else None
    kept = bool(keeper)  # the start is snapshotted
    settings = WorkerSettings(shm_slots=prefix, agent_owned=True, slots=3)
    try:
        with Checkpointer(settings, optimizers=[optim]) as ckpt:
            start = _state(model, optim)
            assert ckpt.restore(model, optim) is None
            ckpt._wait_inflight()
            assert ckpt.newest_step() == (0 if kept else None)
            _train(model, optim, 2)
            if saved_step is not None:
                ckpt.save(saved_step, capture(model, optim, {"step": saved_step})).wait(30)
                _train(model, optim, 1)
            trained = _state(model, optim)
            restored = ckpt.restore(model, optim)  # a survivor's re-entry after a failure
            assert (restored[0] if restored else None) == second_restore
            assert _same(_state(model, optim), start) == rolled_back
            if not kept:
                assert _same(_state(model, optim), trained)
            assert ckpt.newest_step() == (saved_step if saved_step is not None
                                          else 0 if kept else None)
        if kept and saved_step is None:
            # The replacement: a fresh process, whose own initialisation differs (an unseeded
            # model), starts from the survivors' start state, and saves no start of its own.
            other_model, other_optim = trained_model(seed=1, steps=0)
            with Checkpointer(settings, optimizers=[other_optim]) as replacement:
                assert replacement.restore(other_model, other_optim) is None
                assert _same(_state(other_model, other_optim), start)
                assert replacement.newest_step() == 0
    finally:
        if handle is not None:
            handle.remove()
