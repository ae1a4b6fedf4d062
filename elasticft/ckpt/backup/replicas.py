"""Replica serving: a replacement node restores the newest step from a replica in memory.

Data-parallel ranks hold the same shard. When a node is lost, the node that replaces it asks
the peer server of a node that holds a replica of each of its ranks
(:func:`elasticft.ckpt.backup.peer.replica_node`): that node's slots hold the shard of the newest
step in memory, newer than any on disk. :class:`Replicas` answers for the peer server
(:class:`elasticft.ckpt.backup.peer.ReplicaSource`): which steps this node holds a replica of, and
one of them encoded exactly as the durable tier writes a shard. A replica can stand in for another
rank only when its tensors are whole (no DTensor or FSDP shard of a rank's own).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from elasticft.addon.api import GroupInfo
from elasticft.ckpt.memory.nodeslots import NodeSlots
from elasticft.ckpt.memory.shm import SlotSet
from elasticft.ckpt.memory.slotformat import SlotHeader
from elasticft.ckpt.persisting import durable, pipeline

logger = logging.getLogger(__name__)


def is_replica(held_rank: int, rank: int, world: int,
               layout: tuple[int, int, int] | None) -> bool:
    """Whether ``held_rank`` holds the same shard as ``rank``: the same tp and pp coordinates
    under a (tp, pp, dp) ``layout``; any rank under pure data parallelism (no layout)."""
    tp, pp, dp = layout or (1, 1, world)
    if tp * pp * dp != world:
        return False
    return (held_rank % tp, held_rank // (tp * dp)) == (rank % tp, rank // (tp * dp))


def whole_tensors(manifest: Mapping[str, Any]) -> bool:
    """Whether every tensor is whole (no DTensor/FSDP shard), so another rank can load it."""
    return all(not any(item.get("chunk_offsets", ())) and
               item.get("shape") == item.get("global_size", item.get("shape"))
               for item in manifest["items"] if item["kind"] == "tensor")


class Replicas:
    """The replicas of other ranks' shards in this node's slots, for the peer server."""

    def __init__(self, slots: NodeSlots, layout: tuple[int, int, int] | None,
                 group: Callable[[], GroupInfo | None], cache_root: Callable[[GroupInfo], Path]
                 ) -> None:
        self.slots = slots
        self.layout = layout
        self._group = group
        self._cache_root = cache_root
        """The checkpoint directory whose ``replica-cache`` holds a shard while it is encoded."""

    def _headers(self, rank: int, world: int) -> list[tuple[SlotSet, int, SlotHeader]]:
        # Headers carry the rank a snapshot was taken as: this node's ranks may have changed
        # since (a new round), so every slot set is looked at, not the current ranks'.
        found = []
        for slots in self.slots.all_sets():
            for index, header in slots.complete().items():
                if header.world_size == world and is_replica(header.rank, rank, world,
                                                             self.layout):
                    found.append((slots, index, header))
        return found

    def replica_steps(self, rank: int, world_size: int) -> list[int]:
        return sorted({h.step for _, _, h in self._headers(rank, world_size)}, reverse=True)

    def replica_shard(self, step: int, rank: int, world_size: int
                      ) -> tuple[dict[str, Any], bytes] | None:
        group = self._group()
        if group is None:
            return None
        for slots, index, header in self._headers(rank, world_size):
            if header.step != step:
                continue
            slot = slots.get(index)
            # A buffer of its own: the persist thread may be using the staging buffers.
            snapshot = (pipeline.copy_out(slot, step, pipeline.StagingBuffer())
                        if slot is not None else None)
            if snapshot is None or not whole_tensors(snapshot.manifest):
                continue
            # Encoded exactly as the durable tier writes a shard (checksummed blobs). Each
            # request gets a scratch directory of its own: two ranks asking for the same step
            # at once are served from the same replica, so they would write the same file.
            cache = self._cache_root(group) / "replica-cache"
            cache.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f"node-{group.node_id}-", dir=cache))
            try:
                directory = durable.write_rank_shard(scratch, snapshot)
                manifest = durable.read_rank_manifest(directory, snapshot.rank)
                data = (directory / manifest["file"]).read_bytes()
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            logger.info("serving step %d of rank %d from the replica rank %d in memory", step,
                        rank, snapshot.rank)
            return dict(manifest, rank=rank, replica_of=snapshot.rank), data
        return None
