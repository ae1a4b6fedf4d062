"""The start snapshot: the state training starts from, kept as step 0 under in-process recovery.

A survivor of in-process recovery keeps its process and its tensors. When a peer fails before the
job's first checkpoint, its restore finds nothing, and it would train on from the steps it took
while the replacement starts over. So, while a keeper says the process has not trained yet
(:func:`register_keeper`: in-process recovery's, until the process's first step), a restore that
finds nothing snapshots the model, the optimizer and the RNG as step 0, marked as the start
(:func:`state`; :meth:`elasticft.ckpt.Checkpointer.save_start`). A later restore that lands on it
copies it back and returns None, as at the start, and the replacement starts from it too.

It takes a slot of the memory tier's rotation like any step (no memory of its own once two saves
have followed); the agent's periodic persist skips step 0 (a flush after a crash may write it, and
a relaunch then starts from it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

MARK = "elasticft.start"
"""The extra that marks the start snapshot."""

_keepers: OrderedDict[int, Callable[[], bool]] = OrderedDict()


def register_keeper(untrained: Callable[[], bool]) -> RemovableHandle:
    """Makes restores that find nothing snapshot the start while ``untrained()`` holds;
    ``.remove()`` on the handle withdraws it. Process-wide, as the commit gates are."""
    handle = RemovableHandle(_keepers)
    _keepers[handle.id] = untrained
    return handle


def wanted() -> bool:
    """Whether a keeper says the state now is the start."""
    return any(untrained() for untrained in list(_keepers.values()))


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The state to save as the start (the model, the optimizer, the RNG, the mark)."""
    from elasticft.ckpt.restoring.state import capture

    return capture(model, optimizer, extra={MARK: True})


def is_start(extras: Mapping[str, Any]) -> bool:
    """Whether restored extras are the start snapshot's."""
    return bool(extras.get(MARK))
