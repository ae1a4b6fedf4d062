"""DDP's rebuilt bucket layout carried to the DDP of the next generation
(:mod:`elasticft.inprocess.ddp_buckets`), on a real gloo group of one rank. That this makes a
re-made DDP's losses an uninterrupted run's with 4 ranks is tested end to end in
test_inprocess.py and test_inprocess_across_nodes.py; a restart after an in-process recovery
with 3 and 4 ranks, in bench/conformance.py (``twice``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elasticft.inprocess.ddp_buckets import BucketLayouts, decode, encode, rebuilt_layout

SMALL = 100 / 2 ** 20
"""A bucket cap (MiB) of 100 bytes: the model's gradients take several buckets."""


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _layout(ddp: DistributedDataParallel) -> list[list[str]]:
    """Each bucket's parameters by name, in the bucket's order."""
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    return [[names[id(p)] for p in bucket.parameters()]
            for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def _step(ddp: DistributedDataParallel) -> list[list[str]]:
    """One training step; the layout its all-reduce used."""
    ddp(torch.ones(3, 4)).sum().backward()
    return _layout(ddp)


@pytest.mark.parametrize(("indices", "sizes", "layout"), [
    ("5 4 3, 2, 1 0", "104, 256, 160", ([[5, 4, 3], [2], [1, 0]], [104, 256, 160])),
    ("1 0", "40", ([[1, 0]], [40])),
    (None, None, None),  # before the rebuild was logged
])
def test_the_rebuilt_layout_is_read_from_ddps_logging_data(
        indices: str | None, sizes: str | None, layout: tuple | None) -> None:
    data = {"bucket_sizes": "520"} if indices is None else {
        "rebuilt_per_bucket_param_indices": indices, "rebuilt_bucket_sizes": sizes}
    assert rebuilt_layout(data) == layout


def test_a_ddp_of_a_later_generation_starts_with_the_rebuilt_layout(
        group_of_one: dist.TCPStore) -> None:
    layouts = BucketLayouts()
    unarm = layouts.arm()
    try:
        first = DistributedDataParallel(_net(), bucket_cap_mb=SMALL)
        guess = _step(first)
        rebuilt = [_step(first) for _ in range(4)][-1]
        assert rebuilt != guess  # the backward's order, in several buckets
        assert layouts.rebuilt, "the rebuilt layout was remembered"
        # the next generation: the function re-wraps the module
        again = DistributedDataParallel(first.module, bucket_cap_mb=SMALL)
        assert _step(again) == rebuilt
        assert _step(again) == rebuilt  # and its own rebuild keeps it
    finally:
        unarm()
    plain = DistributedDataParallel(first.module, bucket_cap_mb=SMALL)
    assert _step(plain) == guess  # unarmed: torch's guess again


@pytest.mark.parametrize(("layout", "count"), [
    (([[5, 4, 3], [2], [1, 0]], [104, 256, 160]), 6),
    (([[1, 0]], [40]), 2),
    (None, 3),
    (([], []), 0),
])
def test_a_layout_travels_as_integers_of_one_length_for_any_layout(
        layout: tuple | None, count: int) -> None:
    row = encode(layout, count)
    assert len(row) == 2 + 3 * count
    assert decode(row, count) == layout


@pytest.mark.parametrize(("read_kept", "starts_with"), [(True, "rebuilt"), (False, "guess")],
                         ids=["a-restarted-attempt", "a-new-launch"])
def test_a_restarted_process_starts_with_the_layout_an_earlier_attempt_kept(
        group_of_one: dist.TCPStore, tmp_path: Path, read_kept: bool, starts_with: str) -> None:
    """A restart ends every process and what it remembered: the layout is written to the
    node's run directory, and a later attempt's new process (a new BucketLayouts) reads it
    before its first DDP is made; a new launch over the same directory starts with torch's
    guess, as an uninterrupted run does."""
    earlier = BucketLayouts(tmp_path / "ddp-layouts")
    unarm = earlier.arm()
    try:
        first = DistributedDataParallel(_net(), bucket_cap_mb=SMALL)
        seen = {"guess": _step(first), "rebuilt": [_step(first) for _ in range(4)][-1]}
    finally:
        unarm()
    assert seen["rebuilt"] != seen["guess"] and len(list((tmp_path / "ddp-layouts").iterdir())) == 1
    later = BucketLayouts(tmp_path / "ddp-layouts", read_kept=read_kept)  # a new process's
    unarm = later.arm()
    try:
        again = DistributedDataParallel(_net(), bucket_cap_mb=SMALL)
        assert _step(again) == seen[starts_with]
    finally:
        unarm()
