"""Every optimizer in ``torch.optim`` round-trips through a memory snapshot, bit for bit.

The table is every subclass of ``torch.optim.Optimizer`` that ``torch.optim`` exports,
enumerated at run time, so an optimizer that a new torch adds is covered (or fails here) without
editing the test. Each is saved before its first step (no state) and after two steps (state), with
two parameter groups and a scheduler that changed the learning rate; the snapshot is loaded into
a fresh model and optimizer with ``restore()`` (in place from shared memory) and with ``load()`` +
``elasticft.ckpt.restore`` (torch's ``set_state_dict``). The restored parameters and optimizer
state must equal the saved ones bitwise, and the next step must equal the uninterrupted run's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticft.ckpt import Checkpointer, StateCapture, WorkerSettings, restore
from elasticft.ckpt.control import all_loaded
from tests.ckpt.helpers import remove_segments, unique_prefix


def _optimizer_classes() -> list[type[torch.optim.Optimizer]]:
    return sorted(
        (obj for name in dir(torch.optim) if not name.startswith("_")
         for obj in [getattr(torch.optim, name)]
         if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer)
         and obj is not torch.optim.Optimizer),
        key=lambda cls: cls.__name__,
    )


SPARSE = {"SparseAdam"}
"""Optimizers that take sparse gradients only: trained through an ``nn.Embedding(sparse=True)``."""
CLOSURE = {"LBFGS"}
"""Optimizers whose ``step`` needs a closure that recomputes the loss."""
ONE_GROUP = {"LBFGS"}
"""LBFGS supports one parameter group only (torch raises otherwise)."""
MATRICES_ONLY = {"Muon"}
"""Muon updates 2-D parameters only: the model has no biases for it."""
SPECIAL = SPARSE | CLOSURE | ONE_GROUP | MATRICES_ONLY


class _Model(torch.nn.Module):
    def __init__(self, sparse: bool, bias: bool) -> None:
        super().__init__()
        self.sparse = sparse
        if sparse:
            self.embed = torch.nn.Embedding(12, 6, sparse=True)
        self.first = torch.nn.Linear(6, 8, bias=bias)
        self.second = torch.nn.Linear(8, 3, bias=bias)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(batch).sum(1) if self.sparse else batch
        return self.second(torch.tanh(self.first(hidden)))


def _groups(model: _Model, name: str) -> list[dict[str, Any]]:
    if name in ONE_GROUP:
        return [{"params": list(model.parameters())}]
    if name in SPARSE:
        return [{"params": list(model.embed.parameters())}]
    return [{"params": list(model.first.parameters())},
            {"params": list(model.second.parameters()), "lr": 0.003}]


def _build(cls: type[torch.optim.Optimizer]) -> tuple[_Model, torch.optim.Optimizer, Any]:
    name = cls.__name__
    torch.manual_seed(0)
    model = _Model(sparse=name in SPARSE, bias=name not in MATRICES_ONLY)
    optim = cls(_groups(model, name), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    return model, optim, scheduler


def _batch(step: int, name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    if name in SPARSE:
        return torch.randint(0, 12, (4, 3), generator=generator)
    return torch.randn(4, 6, generator=generator)


def _step(model: _Model, optim: torch.optim.Optimizer, step: int) -> None:
    batch = _batch(step, type(optim).__name__)

    def closure() -> torch.Tensor:
        optim.zero_grad()
        loss = model(batch).pow(2).mean()
        loss.backward()
        return loss

    if type(optim).__name__ in CLOSURE:
        optim.step(closure)
    else:
        closure()
        optim.step()
    optim.zero_grad()


def _train(model: _Model, optim: torch.optim.Optimizer, scheduler: Any, steps: int) -> None:
    for step in range(steps):
        _step(model, optim, step)
        scheduler.step()  # the saved lr is the scheduler's, not the constructor's


def _exact(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) \
            if a.numel() else True, where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), where
        for key in a:
            _exact(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _exact(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def _snapshot_of(model: _Model, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything a restore must bring back, as private copies."""
    def clone(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: clone(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(clone(v) for v in value)
        return value

    return clone({"model": model.state_dict(), "optim": optim.state_dict()})


@pytest.fixture
def prefix() -> Iterator[str]:
    name = unique_prefix()
    yield name
    remove_segments(name)


def _restore_in_place(ckpt: Checkpointer, model: _Model, optim: torch.optim.Optimizer) -> None:
    assert ckpt.restore(model, optim) is not None


def _load_then_restore(ckpt: Checkpointer, model: _Model, optim: torch.optim.Optimizer) -> None:
    loaded = ckpt.load()
    assert loaded is not None
    restore(loaded[1], model, optim)


def test_the_table_covers_every_optimizer_torch_exports() -> None:
    names = {cls.__name__ for cls in _optimizer_classes()}
    assert {"SGD", "Adam", "AdamW", "LBFGS", "SparseAdam"} <= names
    # Every special case names an optimizer this torch has: a rename must not leave it unused.
    assert names >= SPECIAL


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", [_restore_in_place, _load_then_restore],
                         ids=["restore", "load+restore"])
@pytest.mark.parametrize("steps", [0, 2], ids=["no-state", "with-state"])
@pytest.mark.parametrize("cls", _optimizer_classes(), ids=lambda cls: cls.__name__)
def test_every_optimizer_round_trips_bit_exact_and_steps_on_as_if_uninterrupted(
    cls: type[torch.optim.Optimizer], steps: int,
    how: Callable[[Checkpointer, _Model, torch.optim.Optimizer], None], prefix: str,
) -> None:
    model, optim, scheduler = _build(cls)
    _train(model, optim, scheduler, steps)
    saved = _snapshot_of(model, optim)
    settings = WorkerSettings(shm_slots=prefix, agent_owned=True)
    with Checkpointer(settings, optimizers=[optim]) as ckpt:
        request = ckpt.save(steps, StateCapture(model, optim, rng=False)(extra={"step": steps}))
        assert request.wait(30).status == "memory"
    # The save itself changed nothing (no optimizer state was made up for it).
    _exact(_snapshot_of(model, optim), saved, "after save")
    _step(model, optim, steps)  # the uninterrupted run's next step
    expected_next = _snapshot_of(model, optim)

    fresh_model, fresh_optim, _ = _build(cls)
    with Checkpointer(settings, optimizers=[fresh_optim]) as ckpt:
        how(ckpt, fresh_model, fresh_optim)
    _exact(_snapshot_of(fresh_model, fresh_optim), saved, "restored")
    _step(fresh_model, fresh_optim, steps)
    _exact(_snapshot_of(fresh_model, fresh_optim), expected_next, "next step")


@pytest.mark.timeout(120)
def test_the_agent_hears_of_a_restore_once_the_first_step_after_it_is_over(
    prefix: str, tmp_path: Path
) -> None:
    """The agent's deferred flush waits for this report: beside the restore and the first step
    it would compete for the same memory and cores."""
    model, optim, scheduler = _build(torch.optim.AdamW)
    _train(model, optim, scheduler, 1)
    settings = WorkerSettings(shm_slots=prefix, agent_owned=True, control_dir=tmp_path)
    with Checkpointer(settings, optimizers=[optim]) as ckpt:
        assert ckpt.save(1, StateCapture(model, optim, rng=False)()).wait(30).status == "memory"
    fresh_model, fresh_optim, _ = _build(torch.optim.AdamW)
    with Checkpointer(settings, optimizers=[fresh_optim]) as ckpt:
        assert ckpt.restore(fresh_model, fresh_optim) is not None
        assert not all_loaded(tmp_path, [0])
        _step(fresh_model, fresh_optim, 1)
        assert all_loaded(tmp_path, [0])
        _step(fresh_model, fresh_optim, 2)  # the hook, still registered, stays quiet
        assert ckpt.save(3, StateCapture(fresh_model, fresh_optim, rng=False)()).wait(30)
