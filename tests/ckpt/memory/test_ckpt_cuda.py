"""The memory tier's CUDA path on a real GPU (marked ``gpu``: skipped where CUDA is absent).

The snapshot of every step must be bit-exact against the state after that step, although the
copy to host memory overlaps the next forward (which changes BatchNorm's buffers and a bf16
buffer) and the next optimizer step waits for it on the device only. The state is large
enough (~300 MB) that the copies are still in flight when the next step starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from elasticft.ckpt import Checkpointer, StateCapture, WorkerSettings, capture
from tests.ckpt.helpers import pinned_slots, remove_segments, unique_prefix

pytestmark = pytest.mark.gpu


@pytest.fixture
def prefix() -> Iterator[str]:
    name = unique_prefix()
    yield name
    remove_segments(name)


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.BatchNorm1d(4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024),
    ).cuda()
    # A bf16 buffer the next step changes in place, like BatchNorm's: copied at the save.
    model.register_buffer("seen", torch.zeros(4096, dtype=torch.bfloat16, device="cuda"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(256, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
    model.seen.add_(1.0)
    model(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _host_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, Mapping):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copy(v) for v in value)
    return value


def _assert_equal(loaded: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor), where
        assert loaded.dtype == expected.dtype and torch.equal(loaded.cpu(), expected), where
    elif isinstance(expected, Mapping):
        assert set(loaded) == set(expected), where
        for key in expected:
            _assert_equal(loaded[key], expected[key], f"{where}.{key}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staging_mb", [0, 1024])
def test_every_cuda_snapshot_is_the_state_after_its_step(prefix: str, staging_mb: int) -> None:
    model, optim = _model()
    settings = WorkerSettings(shm_slots=prefix, agent_owned=True,
                              gpu_staging_bytes=staging_mb << 20)
    snapshot = StateCapture(model, optim, rng=False)
    with Checkpointer(settings, optimizers=[optim]) as ckpt:
        for step in range(1, 7):
            _step(model, optim, step)
            request = ckpt.save(step, snapshot(extra={"step": step}))
            expected = _host_copy(capture(model, optim, {"step": step}, rng=False))
            if step % 2:
                request.wait(60)  # also check snapshots the next step did not overtake
            loaded_step, state = ckpt.load()
            assert loaded_step == step
            _assert_equal(state["model"], expected["model"], "model")
            _assert_equal(state["optim"]["state"], expected["optim"]["state"], "optim")
        device = ckpt._device
        assert device is not None, "CUDA state did not take the device path"
        assert pinned_slots(device) == 2 or device.pin_refused is not None
        assert device.staging_refused is None
        assert ckpt.stall_s > 0.0


@pytest.mark.timeout(300)
def test_a_cuda_model_restores_from_memory_in_place(prefix: str) -> None:
    model, optim = _model()
    settings = WorkerSettings(shm_slots=prefix, agent_owned=True)
    with Checkpointer(settings, optimizers=[optim]) as ckpt:
        _step(model, optim, 1)
        ckpt.save(1, capture(model, optim, {"step": 1})).wait(60)
        expected = _host_copy(model.state_dict())
    fresh, fresh_optim = _model(seed=1)
    with Checkpointer(settings) as reader:
        assert reader.restore(fresh, fresh_optim) == (1, {"step": 1})
        assert reader.last_source == "memory"
    _assert_equal(_host_copy(fresh.state_dict()), expected, "restored")
    assert all(p.is_cuda for p in fresh.parameters())


def test_a_restore_through_pinned_buffers_is_exact_on_the_device() -> None:
    from elasticft.ckpt.memory.device import restore_copy

    host = [torch.randn(3_000_001), torch.randn(17, dtype=torch.float64).to(torch.bfloat16)]
    live = [torch.empty_like(t, device="cuda") for t in host]
    restore_copy(list(zip(live, host, strict=True)), bounce_bytes=1 << 20)  # several chunks
    torch.cuda.current_stream().synchronize()
    assert all(torch.equal(d.cpu(), h) for d, h in zip(live, host, strict=True))
