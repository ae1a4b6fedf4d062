"""A data loader given to StateCapture: the iterator a resume makes again mid-epoch draws what the
epoch's first one drew (its workers' seeds, a shuffle from torch's RNG), and torch's RNG is then
where the restored step left it, in a fresh process's loader (a replacement) and in the loader
that went on past the step (a survivor). Real DataLoaders, with real worker processes."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from elasticft.ckpt import StateCapture
from elasticft.ckpt.restoring.state import set_rng_state

SAMPLES, BATCH = 32, 4
STEPS = 14  # 4 steps an epoch with the distributed sampler's half, 8 with RandomSampler's whole


class AugmentedSamples(TensorDataset):
    """Noise from torch's, numpy's and Python's RNGs added to each sample as it is read."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        x, y = super().__getitem__(index)
        return x + torch.randn_like(x) + float(np.random.normal()) + random.random(), y


def make_loader(workers: int, generator: bool, sampler: str, augment: bool) -> DataLoader:
    data = torch.Generator().manual_seed(1)
    tensors = (torch.randn(SAMPLES, 3, generator=data), torch.arange(SAMPLES))
    dataset = AugmentedSamples(*tensors) if augment else TensorDataset(*tensors)
    chosen = (DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=0)
              if sampler == "distributed" else RandomSampler(dataset))
    return DataLoader(dataset, batch_size=BATCH, sampler=chosen, num_workers=workers,
                      drop_last=True,
                      generator=torch.Generator().manual_seed(5) if generator else None)


def train(loader: DataLoader, capture: StateCapture, start: int,
          snapshots: dict[int, dict[str, Any]] | None = None) -> list[tuple[int, str]]:
    """Steps ``start`` on as a user's loop resumes: the epoch's iterator made again, its first
    batches skipped; each step records its batch and a draw of torch's RNG (a dropout mask)."""
    records = []
    per_epoch = len(loader)
    epoch, skip = divmod(start, per_epoch)
    step = start
    while step < STEPS:
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for i, (x, _) in enumerate(loader):
            if i < skip:
                continue
            step += 1
            records.append((step, f"{x.sum().item()!r} {torch.rand(2).tolist()}"))
            if snapshots is not None:
                snapshots[step] = copy.deepcopy(capture()["rng"])
            if step == STEPS:
                break
        epoch, skip = epoch + 1, 0
    return records


Factory = Callable[[], DataLoader]


def uninterrupted(factory: Factory) -> tuple[list[tuple[int, str]], dict[int, dict[str, Any]]]:
    torch.manual_seed(0)
    loader = factory()
    snapshots: dict[int, dict[str, Any]] = {}
    records = train(loader, StateCapture(torch.nn.Linear(1, 1), loaders=[loader]), 0, snapshots)
    return records, snapshots


CASES = [
    pytest.param(2, False, "distributed", True, id="workers-2-augment-no-generator"),
    pytest.param(2, True, "distributed", True, id="workers-2-augment-own-generator"),
    pytest.param(0, False, "distributed", False, id="in-process-no-generator"),
    pytest.param(0, False, "random", False, id="random-sampler-from-torch-rng"),
    pytest.param(2, False, "random", True, id="workers-2-random-sampler"),
]


@pytest.mark.parametrize(("workers", "generator", "sampler", "augment"), CASES)
@pytest.mark.parametrize("restored_step", [6, 8], ids=["mid-epoch", "epoch-end"])
def test_a_loader_resumed_in_a_fresh_process_draws_what_the_epoch_drew(
        workers: int, generator: bool, sampler: str, augment: bool, restored_step: int) -> None:
    def factory() -> DataLoader:
        return make_loader(workers, generator, sampler, augment)
    reference, snapshots = uninterrupted(factory)
    torch.manual_seed(123)  # a replacement's own start
    loader = factory()
    capture = StateCapture(torch.nn.Linear(1, 1), loaders=[loader])
    set_rng_state(snapshots[restored_step])
    assert train(loader, capture, restored_step) == reference[restored_step:]


@pytest.mark.parametrize(("workers", "generator", "sampler", "augment"), CASES)
def test_a_loader_that_went_on_past_the_step_resumes_at_it(
        workers: int, generator: bool, sampler: str, augment: bool) -> None:
    def factory() -> DataLoader:
        return make_loader(workers, generator, sampler, augment)
    reference, snapshots = uninterrupted(factory)
    torch.manual_seed(0)
    loader = factory()  # the survivor's: it trained into the next epoch, then rolls back
    capture = StateCapture(torch.nn.Linear(1, 1), loaders=[loader])
    train(loader, capture, 0)
    set_rng_state(snapshots[6])
    assert train(loader, capture, 6) == reference[6:]


def test_a_snapshot_of_other_loaders_is_refused_with_the_fix() -> None:
    _, snapshots = uninterrupted(lambda: make_loader(0, True, "distributed", False))
    loader = make_loader(0, False, "distributed", False)  # no generator of its own
    StateCapture(torch.nn.Linear(1, 1), loaders=[loader])
    with pytest.raises(ValueError, match="give StateCapture the same loaders"):
        set_rng_state(snapshots[6])
