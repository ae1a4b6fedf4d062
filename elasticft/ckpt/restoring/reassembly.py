"""Loading across ranks: agreeing on a step, and reassembling deduplicated replicas.

A load is collective. Every rank offers the steps it can restore and all take the newest one
they share (:meth:`RankGroup.agree`); a rank that then fails to read it makes every rank move to
an older one (:meth:`RankGroup.all_ok`).

With ``dedup_replicas`` each data-parallel rank stores only its share of the replicated state,
so a loaded snapshot names items that another rank (their *owner*) holds.
:class:`ReplicaReassembler` fetches them: with one memcpy from the owner's shared memory when
the owner is on this host, else by a broadcast of the owner's replica region, whichever tier
the owner loaded it from. Control data between ranks is JSON in fixed-size tensors, never
pickle.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elasticft.ckpt.api import CheckpointError, Snapshot
from elasticft.ckpt.hostcopy import copy_bytes
from elasticft.ckpt.memory.shm import MemoryTier, SlotSet
from elasticft.ckpt.snapshot import dtype_from_name, stored_here, tensor_view

logger = logging.getLogger(__name__)

_AGREE_STEPS = 32
"""How many of its newest steps a rank offers when the ranks agree on one."""
_PEER_INFO_BYTES = 512


class RankGroup:
    """The ranks of the default process group, as a load sees them (one rank without one)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    @property
    def active(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def device(self) -> torch.device:
        """Where collective tensors live: NCCL wants them on the rank's GPU."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def agree(self, steps: list[int]) -> int | None:
        """The newest of ``steps`` (newest first) that every rank offers; None if none."""
        mine = steps[:_AGREE_STEPS]
        if not self.active:
            return mine[0] if mine else None
        local = torch.full((_AGREE_STEPS,), -1, dtype=torch.int64)
        local[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
        gathered = [torch.empty_like(local, device=self.device())
                    for _ in range(self.world_size)]
        dist.all_gather(gathered, local.to(self.device()))
        common = set(mine)
        for other in gathered:
            common &= {int(s) for s in other.cpu().tolist() if s >= 0}
        return max(common) if common else None

    def all_ok(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank."""
        if not self.active:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


class ReplicaReassembler:
    """Fetches the items of a deduplicated snapshot that other ranks store."""

    def __init__(self, ranks: RankGroup, shm_slots: str | None, slot_count: int) -> None:
        self.ranks = ranks
        self.shm_slots = shm_slots
        self.slot_count = slot_count
        self._peers: list[dict[str, Any]] | None = None

    def reassemble(self, step: int, snapshot: Snapshot,
                   live: Any) -> dict[str, torch.Tensor] | None:
        """The items of ``snapshot`` that other ranks store, by name; None if that failed.

        Collective when any rank's snapshot is deduplicated. Into the live tensors when
        restoring in place (``live`` is a :class:`~elasticft.ckpt.restoring.state.LiveState`), else
        into new tensors.
        """
        manifest = snapshot.manifest
        wanted: dict[int, list[dict[str, Any]]] = {}
        for item in manifest["items"]:
            if item["kind"] == "tensor" and not stored_here(item):
                wanted.setdefault(int(item["replica_of"]), []).append(item)
        regions = list(manifest.get("replica_regions", ()))
        if not self.ranks.active:
            return {} if not wanted else None
        world, rank, device = self.ranks.world_size, self.ranks.rank, self.ranks.device()
        # One all-reduce: whether anyone needs a broadcast from rank k, and k's region size.
        flags = torch.zeros(2 * world, dtype=torch.int64)
        if len(regions) == world:
            flags[world:] = torch.tensor(regions, dtype=torch.int64)
        dedup = torch.tensor([1 if regions else 0], dtype=torch.int64, device=device)
        dist.all_reduce(dedup, op=dist.ReduceOp.MAX)
        if not int(dedup.item()):
            return {}  # nobody's snapshot is deduplicated
        targets: dict[str, torch.Tensor] = {}
        for items in wanted.values():
            for item in items:
                target = live.target(item) if live is not None else None
                if target is None:
                    target = torch.empty(tuple(item["shape"]), dtype=dtype_from_name(item["dtype"]))
                targets[item["fqn"]] = target
        ok = True
        peers = self._peer_memory()
        missing = set()
        for owner, items in wanted.items():
            if not self._copy_from_peer_memory(step, owner, items, targets, peers):
                missing.add(owner)
                flags[owner] = 1
        flags_dev = flags.to(device)
        dist.all_reduce(flags_dev, op=dist.ReduceOp.MAX)
        flags = flags_dev.cpu()
        for owner in range(world):
            length = int(flags[world + owner])
            if not int(flags[owner]) or length <= 0:
                continue
            if owner == rank:
                if len(snapshot.payload) < length:
                    raise CheckpointError(f"rank {rank}'s snapshot of step {step} is "
                                          "shorter than its replica region", "corrupt")
                region = torch.frombuffer(snapshot.payload, dtype=torch.uint8, count=length)
                dist.broadcast(region.to(device), src=owner)
                continue
            buffer = torch.empty(length, dtype=torch.uint8, device=device)
            dist.broadcast(buffer, src=owner)
            if owner in missing:
                payload = buffer.cpu().numpy()
                for item in wanted[owner]:
                    place = dict(item, offset=item["replica_offset"])
                    try:
                        copy_bytes(targets[item["fqn"]], tensor_view(payload, place))
                    except CheckpointError:
                        logger.warning("replica %r from rank %d does not fit", item["fqn"], owner)
                        ok = False
        return targets if ok else None

    def _peer_memory(self) -> list[dict[str, Any]]:
        """Every rank's host and shared-memory names (exchanged once)."""
        if self._peers is None:
            mine = json.dumps({"host": host_key(), "prefix": self.shm_slots,
                               "slots": self.slot_count}).encode()
            if len(mine) > _PEER_INFO_BYTES:
                mine = json.dumps({"host": host_key(), "prefix": None, "slots": 0}).encode()
            local = torch.zeros(_PEER_INFO_BYTES, dtype=torch.uint8)
            local[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
            device = self.ranks.device()
            gathered = [torch.empty_like(local, device=device)
                        for _ in range(self.ranks.world_size)]
            dist.all_gather(gathered, local.to(device))
            self._peers = [json.loads(bytes(t.cpu().numpy()).rstrip(b"\0")) for t in gathered]
        return self._peers

    def _copy_from_peer_memory(self, step: int, owner: int, items: list[dict[str, Any]],
                               targets: Mapping[str, torch.Tensor],
                               peers: list[dict[str, Any]]) -> bool:
        """Copies ``owner``'s replicas of ``step`` from its shared memory on this host."""
        peer = peers[owner]
        if peer.get("host") != host_key() or not peer.get("prefix"):
            return False
        tier = MemoryTier(SlotSet(peer["prefix"], max(2, int(peer.get("slots") or 2))),
                          lock_timeout_s=2.0)
        try:
            with tier.open(step, owner, self.ranks.world_size) as theirs:
                stored = {i["fqn"]: i for i in theirs.manifest["items"]
                          if i["kind"] == "tensor" and stored_here(i)}
                for item in items:
                    source = stored.get(item["fqn"])
                    if (source is None or source["dtype"] != item["dtype"]
                            or source["shape"] != item["shape"]):
                        return False
                    copy_bytes(targets[item["fqn"]], tensor_view(theirs.payload, source))
            return True
        except (OSError, CheckpointError) as e:
            logger.info("replicas of rank %d not in shared memory here (%s); the owner sends "
                        "them", owner, e)
            return False
        finally:
            tier.close()


@functools.cache
def host_key() -> str:
    """This host, for telling which ranks share its /dev/shm (host name and boot id)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
