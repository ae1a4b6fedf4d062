"""The certified restore: before the first optimizer step after an in-process recovery, the
data-parallel replicas check that they restored the same state.

Replicas of a ``DistributedDataParallel`` hold bit-identical parameters and optimizer state at
every step boundary; an in-process recovery puts every rank back to one such boundary, a
survivor from its own memory, a replacement from its node's or a peer's. A rank that restored
another step, or bytes that are not the step's (a copy served before it was sealed, a torn
peer transfer), would train on from a state the job never had, and every later step would carry
the difference. So the first optimizer step after a DDP is made (at the start, and at every
re-entry after a recovery, which makes the DDP again) is held until its replicas agree: each
rank reduces the parameters the DDP synchronises, and the optimizer state
of those parameters, to a few integers (:func:`digest`: the sums of their bit patterns, exact,
so a single flipped bit changes them), the ranks of the DDP's group gather them, and any
difference raises :class:`RestoreDiverged` on every rank alike. That error is elasticft's own,
not a peer's failure: the agent answers it with a restart of every worker, which restores the
same step on every rank from the agent's snapshots.

The check reads what the gradients' all-reduce has not yet changed: the optimizer step has not
run, so the parameters and the optimizer state are still the restored ones. Its cost is one pass
over those bytes at memory speed and one small all-gather per DDP (the ``certify`` line of the
rank's log; ``bench/conformance.py`` prints it beside the recovery).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


class RestoreDiverged(RuntimeError):
    """Data-parallel replicas restored different states after an in-process recovery."""


_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def digest(tensors: Iterable[Any]) -> tuple[int, int]:
    """(count, sum) of the tensors' bit patterns, read as integers of their element size and
    summed into 64 bits: equal tensors give equal sums, and one changed bit changes the sum."""
    import torch

    totals: dict[Any, Any] = {}  # by device: one transfer each at the end
    count = 0
    for tensor in tensors:
        local = tensor.detach()
        if hasattr(local, "to_local"):  # a DTensor: its shard is what this rank holds
            local = local.to_local()
        if local.numel() == 0:
            continue
        count += 1
        flat = local.reshape(-1)
        if flat.is_complex():  # read as its real and imaginary parts
            flat = torch.view_as_real(flat).reshape(-1)
        bits = flat.view(getattr(torch, _BITS[flat.element_size()]))
        part = bits.sum(dtype=torch.int64)
        totals[part.device] = totals[part.device] + part if part.device in totals else part
    return count, sum(int(total) for total in totals.values())


@dataclasses.dataclass(frozen=True)
class Replicated:
    """What one DDP made in this generation synchronises: its parameters, in its order, and the
    group of its replicas."""

    parameters: tuple[Any, ...]
    group: Any


def state_tensors(optimizers: Iterable[Any], parameters: Sequence[Any]) -> tuple[bool, list[Any]]:
    """The optimizers' state tensors of ``parameters`` (their ``step`` counts included), and
    whether every parameter has state. A rank's state can be incomplete by design (a sharded
    optimizer keeps only its shard's): then only complete states are compared."""
    tensors: list[Any] = []
    complete = True
    for optimizer in optimizers:
        state = getattr(optimizer, "state", None)
        if state is None:
            continue
        for param in parameters:
            entry = state.get(param)
            if not entry:
                complete = False
                continue
            tensors.extend(value for _, value in sorted(entry.items())
                           if hasattr(value, "reshape") and hasattr(value, "view"))
    return complete, tensors


def differing(rows: Sequence[Sequence[int]]) -> list[int]:
    """The ranks (indices in the group) whose row differs from the first rank's. A row is
    (parameter count, parameter sum, state complete, state count, state sum); state is
    compared only when every rank's is complete (pure)."""
    if not rows:
        return []
    compare_state = all(row[2] for row in rows)
    width = 5 if compare_state else 2
    first = list(rows[0][:width])
    return [index for index, row in enumerate(rows) if list(row[:width]) != first]


def certify(replicated: Sequence[Replicated], optimizers: Iterable[Any], generation: int) -> float:
    """Checks every DDP's replicas against each other; raises :class:`RestoreDiverged` on every
    rank of a group that disagrees. Returns the seconds it took."""
    import torch
    import torch.distributed as dist

    started = time.monotonic()
    optimizers = list(optimizers)
    for ddp in replicated:
        device = ddp.parameters[0].device if ddp.parameters else torch.device("cpu")
        if device.type == "meta":
            continue
        complete, state = state_tensors(optimizers, ddp.parameters)
        params = digest(ddp.parameters)
        kept = digest(state)
        mine = torch.tensor([*params, int(complete), *kept], dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(ddp.group))]
        dist.all_gather(everyone, mine, group=ddp.group)
        rows = torch.stack(everyone).tolist()
        if bad := differing(rows):
            ranks = [dist.get_global_rank(ddp.group, i) if ddp.group is not None else i
                     for i in bad]
            raise RestoreDiverged(
                f"after the in-process recovery of generation {generation} the data-parallel "
                f"replicas restored different states: rank(s) {ranks} differ from rank "
                f"{dist.get_global_rank(ddp.group, 0) if ddp.group is not None else 0} "
                f"(parameters and optimizer state, as [count, sum, complete, count, sum]: "
                f"{rows}); every worker restarts from the agent's snapshots")
    took = time.monotonic() - started
    logger.info("certify: generation %d's %d DDP replica set(s) restored the same state "
                "(%.3f s)", generation, len(replicated), took)
    return took
