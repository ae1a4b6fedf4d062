"""Fingerprints of the replicated state, read by the agent from the snapshot it already holds.

Data-parallel replicas hold bit-identical parameters and optimizer state after every optimizer
step. A device that computes a wrong value without an error (silent data corruption) breaks
that, and nothing else notices: the all-reduce keeps running and spreads the error. A
*fingerprint* is a digest of the bytes a rank's snapshot holds of that state: the tensor items
the worker's checkpointer marks as changed only by ``optimizer.step()`` (the manifest's
``guarded`` indices, :class:`~elasticft.ckpt.snapshot.Layout`), a CRC-32 per item. The agent
computes it from the shared-memory slot, in its own process, after the worker's copy is
complete: the training thread pays nothing.

Only ranks that hold the *same shard* are compared, the replica set of the rank. Its key is
what the manifest says of the shard (each item's name, shape, offsets in the global tensor and
DTensor placements: HSDP's replicate peers share them, its shard peers do not) together with
the rank's tensor- and pipeline-parallel coordinates under a ``(tp, pp, dp)`` layout (a
tensor-parallel model that is not a DTensor keeps whole-looking tensors on every TP rank).
Under ``dedup_replicas`` each rank stores a different share of the replicated state, so there
is nothing to compare: such a snapshot has no fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from elasticft.ckpt.memory.slot import Slot
from elasticft.ckpt.memory.slotformat import COMPLETE


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """One rank's replicated state at one step."""

    rank: int
    step: int
    world_size: int
    replica_set: str
    """Equal for ranks that hold the same shard (see the module's docstring)."""
    digest: str
    """A digest of every item's CRC-32: equal for bit-identical replicated state."""
    items: tuple[tuple[str, int], ...] = ()
    """(name, CRC-32) per fingerprinted item, in manifest order: what differs, where."""
    nbytes: int = 0
    """The bytes read."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "digest": self.digest,
                "replica_set": self.replica_set, "nbytes": self.nbytes}


def coordinates(rank: int, world: int, layout: tuple[int, int, int] | None) -> tuple[int, int]:
    """``rank``'s (tp, pp) coordinates under a (tp, pp, dp) layout; (0, 0) under pure data
    parallelism (the numbering of :func:`elasticft.ckpt.backup.replicas.is_replica`)."""
    tp, pp, dp = layout or (1, 1, world)
    if tp * pp * dp != world:
        return (0, 0)
    return (rank % tp, rank // (tp * dp))


def replica_set_key(items: Sequence[Mapping[str, Any]], coords: tuple[int, int]) -> str:
    """The key of the shard ``items`` describe, at tensor/pipeline ``coords``."""
    described = [[i["fqn"], i["shape"], i.get("chunk_offsets", []), i.get("sharding")]
                 for i in items]
    text = json.dumps([list(coords), described], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def fingerprint_snapshot(manifest: Mapping[str, Any], payload: Any,
                         layout: tuple[int, int, int] | None = None) -> Fingerprint | None:
    """The fingerprint of one snapshot (its manifest and payload bytes); None when it holds
    nothing comparable (no ``guarded`` items, or a deduplicated snapshot)."""
    if manifest.get("replica_regions") or not manifest.get("guarded"):
        return None
    items = manifest["items"]
    chosen = [items[i] for i in manifest["guarded"]
              if i < len(items) and items[i].get("kind") == "tensor" and "offset" in items[i]]
    if not chosen:
        return None
    data = memoryview(payload).cast("B")
    crcs: list[tuple[str, int]] = []
    total = 0
    for item in chosen:
        start, size = int(item["offset"]), int(item["nbytes"])
        crcs.append((item["fqn"], zlib.crc32(data[start:start + size])))
        total += size
    rank, world = int(manifest["rank"]), int(manifest["world_size"])
    digest = hashlib.blake2b(json.dumps(crcs).encode(), digest_size=8).hexdigest()
    return Fingerprint(rank=rank, step=int(manifest["step"]), world_size=world,
                       replica_set=replica_set_key(chosen, coordinates(rank, world, layout)),
                       digest=digest, items=tuple(crcs), nbytes=total)


def fingerprint_slot(slot: Slot, step: int, rank: int,
                     layout: tuple[int, int, int] | None = None) -> Fingerprint | None:
    """The fingerprint of ``rank``'s snapshot of ``step`` in ``slot``, read under the slot's
    shared lock (a writer cannot reuse it meanwhile); None if the slot no longer holds it."""
    with slot.shared() as locked:
        if not locked:
            return None
        header = slot.header()
        if (header is None or header.state != COMPLETE or header.step != step
                or header.rank != rank):
            return None
        return fingerprint_snapshot(slot.manifest(header), slot.payload(header), layout)


def differing_items(a: Fingerprint, b: Fingerprint) -> list[str]:
    """Names of the items whose bytes differ between two fingerprints of one replica set."""
    theirs = dict(b.items)
    return [name for name, crc in a.items if theirs.get(name) != crc]
