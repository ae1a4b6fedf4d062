"""What a restore puts back besides the tensors (elasticft.ckpt.restoring.state): numpy's global
RNG with torch's and Python's, and no gradients, as a fresh process that restored the step would
hold them. Both through the memory tier in place (``Checkpointer.restore``) and through
``load()`` + ``restore()``."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from elasticft.ckpt import Checkpointer, StateCapture, WorkerSettings, restore
from elasticft.ckpt.restoring.state import rng_state, set_rng_state
from tests.ckpt.helpers import remove_segments, trained_model, unique_prefix


@pytest.fixture
def prefix():
    name = unique_prefix()
    yield name
    remove_segments(name)


def _draws() -> tuple[list[float], list[float], list[float]]:
    return (torch.rand(3).tolist(), np.random.normal(size=3).tolist(),
            [random.random() for _ in range(3)])


def test_numpy_rng_words_are_a_tensor_that_follows_numpy_and_restores_it() -> None:
    snap = StateCapture(torch.nn.Linear(2, 2))
    np.random.seed(7)
    np.random.normal()  # a Gaussian carried to the next draw
    first = snap()["rng"]["numpy"]
    assert isinstance(first["state"], torch.Tensor) and first["state"].shape == (624,)
    np.random.normal()
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v
             for k, v in snap()["rng"]["numpy"].items()}
    assert snap()["rng"]["numpy"]["state"] is first["state"]  # the same object, refreshed
    expected = np.random.normal(size=5).tolist()
    set_rng_state({"numpy": saved})
    assert np.random.normal(size=5).tolist() == expected


def test_a_snapshot_without_numpy_leaves_numpy_as_it_is() -> None:
    older = {k: v for k, v in rng_state().items() if k != "numpy"}  # of an earlier version
    np.random.seed(3)
    expected = np.random.normal(size=3).tolist()
    np.random.seed(3)
    set_rng_state(older)
    assert np.random.normal(size=3).tolist() == expected


def _backward(model: torch.nn.Module) -> None:
    model(torch.randn(4, 8)).pow(2).mean().backward()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["in-place", "load-then-restore"])
def test_a_restore_puts_back_every_rng_and_leaves_no_gradients(prefix: str, how: str) -> None:
    model, optim = trained_model(steps=1)
    settings = WorkerSettings(shm_slots=prefix, slots=3)
    with Checkpointer(settings, optimizers=[optim]) as ckpt:
        torch.manual_seed(1)
        np.random.seed(2)
        random.seed(3)
        ckpt.save(1, StateCapture(model, optim)(extra={"step": 1})).wait(30)
        expected = _draws()
        _backward(model)  # the step a failure cuts short: its backward done, no update
        assert all(p.grad is not None for p in model.parameters())
        if how == "in-place":
            restored = ckpt.restore(model, optim)
            assert restored is not None and restored[0] == 1
        else:
            loaded = ckpt.load()
            assert loaded is not None
            restore(loaded[1], model, optim)
        assert all(p.grad is None for p in model.parameters())
        assert _draws() == expected
