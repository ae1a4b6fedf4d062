"""Healing from a live replica: a rank that holds no snapshot gets its state from a
data-parallel replica's memory, over the replicas' process group.

A job that grows in process (:mod:`elasticft.inprocess.reshape`: a standby arrives, TP2 x DP1
goes back to TP2 x DP2) has new ranks with nothing in memory beside survivors that hold every
step they trained. The ranks of one data-parallel group hold the same state (the same TP shard,
replicated), so the newest step that *some* member of *every* group holds is enough: in each
group, the lowest-ranked member that holds it broadcasts its snapshot (the manifest, then the
payload's bytes) and every member applies it to its live model and optimizer, the holders from
their own memory in place. Nothing goes through the disk or the agent. When every rank holds the
step there is nothing to heal, and the ordinary restore (:mod:`elasticft.ckpt.restoring.loader`)
runs as before.

Only for state that really is replicated over ``group``: a group over which state is sharded
(FSDP2's) would hand each rank another rank's shard.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.distributed as dist

from elasticft.ckpt.memory.shm import MemoryTier

logger = logging.getLogger(__name__)

_OFFERED = 8
"""How many of its newest steps each rank offers."""


def heal(memory: MemoryTier, rank: int, world_size: int, live: Any, group: Any
         ) -> tuple[int, dict[str, Any], int] | None:
    """(step, extras, source rank) when this rank's replica group had to heal a member, else
    None (every rank holds the newest common step, or no step is held by every group): the
    ordinary restore then runs. Collective over the default group and ``group``."""
    mine = memory.steps(rank, world_size)[:_OFFERED]
    size = dist.get_world_size(group)
    in_group: list[Any] = [None] * size
    dist.all_gather_object(in_group, mine, group=group)
    held_here = sorted({s for steps in in_group for s in steps}, reverse=True)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held_here)
    common = set(held_here)
    for steps in everyone:
        common &= set(steps)
    if not common:
        return None
    step = max(common)
    holders = [i for i, steps in enumerate(in_group) if step in steps]
    needy = [0 if len(holders) == size else 1]
    # NCCL moves only device tensors (its object collectives use the current device).
    device = (torch.device("cuda", torch.cuda.current_device())
              if str(dist.get_backend(group)).lower() == "nccl" else torch.device("cpu"))
    flag = torch.tensor(needy, dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return None  # every rank holds it: the ordinary restore
    source = dist.get_global_rank(group, holders[0])
    with contextlib.ExitStack() as stack:
        if step in mine:
            snapshot = stack.enter_context(memory.open(step, rank, world_size))
            manifest: Any = snapshot.manifest
            payload: Any = snapshot.payload
        else:
            manifest, payload = None, None
        sent: list[Any] = [manifest if rank == source else None,
                           len(payload) if rank == source and payload is not None else 0]
        dist.broadcast_object_list(sent, src=source, group=group)
        buffer = torch.empty(int(sent[1]), dtype=torch.uint8, device=device)
        if rank == source and len(buffer):
            buffer.copy_(torch.frombuffer(payload, dtype=torch.uint8))
        dist.broadcast(buffer, src=source, group=group)
        buffer = buffer.cpu()
        if step in mine:
            extras = live.apply(manifest, payload, {})
        else:
            extras = live.apply(sent[0], memoryview(buffer.numpy()), {})
    logger.info("healed step %d from rank %d's memory over its replica group (%d bytes)", step,
                source, int(sent[1]))
    return step, extras, source
