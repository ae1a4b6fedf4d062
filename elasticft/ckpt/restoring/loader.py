"""Loading: the newest step every rank can restore, each rank from its fastest verified source.

The sources, in the order they are tried (:meth:`SnapshotLoader.tiers`): the rank's own shared
memory, local disk, its own node's agent (a replica taken under another rank, before a new round
renumbered the ranks), a data-parallel replica's node (when a layout puts the backup elsewhere),
the backup peer, the remote directory. The ranks agree on the newest step they all hold; a torn,
uncommitted or corrupt source falls through to the next, and if some rank cannot restore the step
after all, every rank moves to an older one (:mod:`elasticft.ckpt.restoring.reassembly`, which also
fetches deduplicated replicas). From shared memory a restore copies straight into the live tensors.
When no tier holds a step of this world size, ``restore`` reshards the newest durable step
written at another one with ``dcp.load`` (:mod:`elasticft.ckpt.restoring.reshard`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

from elasticft.ckpt.api import CheckpointError, Snapshot, StateMismatch, Tier, TierLevel
from elasticft.ckpt.backup.peer import PeerClient, PeerTier
from elasticft.ckpt.memory.shm import MemoryTier, SlotSet
from elasticft.ckpt.persisting import durable
from elasticft.ckpt.restoring import reshard
from elasticft.ckpt.restoring.reassembly import RankGroup, ReplicaReassembler
from elasticft.ckpt.settings import WorkerSettings
from elasticft.ckpt.snapshot import unflatten

logger = logging.getLogger(__name__)


class SnapshotLoader:
    """Finds, agrees on and reads the step to restore, for one rank."""

    def __init__(self, settings: WorkerSettings, rank: int, world_size: int,
                 slot_count: int, held_as: tuple[tuple[int, int], ...] = ()) -> None:
        self.settings = settings
        self.held_as = held_as
        """Earlier (rank, world size) identities of this process's own memory (a reshape)."""
        self.rank = rank
        self.world_size = world_size
        self._slot_count = slot_count
        self._ranks = RankGroup(rank, world_size)
        self._reassembler = ReplicaReassembler(self._ranks, settings.shm_slots, slot_count)
        self.last_source: str | None = None
        """Tier the last successful load came from."""
        self.last_where = ""
        """Where that tier is (a directory, or the tier's name)."""
        self.looked: list[str] = []
        """Where the last load looked, in load order."""

    def tiers(self) -> list[Tier]:
        """Sources in load order, by :class:`~elasticft.ckpt.api.TierLevel`: own memory, local
        disk, then the peer tier (this node's agent, a replica's node, the backup node), then the
        remote directory."""
        s = self.settings
        tiers: list[Tier] = []
        if s.shm_slots:
            tiers.append(MemoryTier(SlotSet(s.shm_slots, self._slot_count),
                                    held_as=self.held_as))
        if s.local_dir is not None:
            tiers.append(durable.DurableTier(s.local_dir, TierLevel.LOCAL))
        if s.node_peer_addr and s.secret:
            tiers.append(PeerTier(PeerClient(s.node_peer_addr, s.secret), "node"))
        if s.replica_peer_addr and s.secret:
            tiers.append(PeerTier(PeerClient(s.replica_peer_addr, s.secret), "replica"))
        if s.peer_addr and s.secret:
            tiers.append(PeerTier(PeerClient(s.peer_addr, s.secret)))
        if s.remote_dir is not None:
            tiers.append(durable.DurableTier(s.remote_dir, TierLevel.REMOTE))
        return tiers

    def load(self, live: Any = None) -> Any:
        """``(step, state)`` of the newest step every rank can restore, or None; with ``live``
        (a :class:`~elasticft.ckpt.restoring.state.LiveState`) the state is applied to it instead
        and ``(step, extras)`` returned. Collective when a process group is initialized."""
        tiers = self.tiers()
        try:
            return self._load(tiers, live)
        finally:  # _load's views of the slots are gone with its frame
            _close_later(tiers)

    def _load(self, tiers: list[Tier], live: Any) -> Any:
        self.looked = [_where(tier) for tier in tiers]
        held: dict[str, list[int]] = {}
        for tier in tiers:
            try:
                held[tier.name] = tier.steps(self.rank, self.world_size)
            except (OSError, CheckpointError) as e:
                logger.warning("checkpoint tier %s unavailable: %s", tier.name, e)
                held[tier.name] = []
        candidates = sorted({s for steps in held.values() for s in steps}, reverse=True)
        ceiling = self.settings.restore_at_most
        if ceiling is not None:
            # Silent data corruption was found: nothing newer than the last agreed step.
            candidates = [s for s in candidates if s <= ceiling]
        excluded: set[int] = set()
        while True:
            step = self._ranks.agree([s for s in candidates if s not in excluded])
            if step is None:
                if live is not None and not excluded and ceiling is None:
                    return self._reshard(tiers, live)
                logger.info("no checkpoint that every rank can load")
                return None
            with contextlib.ExitStack() as stack:
                snapshot, source = self._read_step(step, tiers, held, stack,
                                                   in_place=live is not None)
                usable = snapshot is not None and not self._replica_not_own(
                    step, snapshot, tiers, held)
                if self._ranks.all_ok(usable):
                    assert snapshot is not None
                    if live is not None:
                        live.prepare(snapshot.manifest)
                    replicas = self._reassembler.reassemble(step, snapshot, live)
                    if self._ranks.all_ok(replicas is not None):
                        assert replicas is not None
                        self.last_source = source
                        self.last_where = next(_where(t) for t in tiers if t.name == source)
                        logger.info("restored step %d from %s", step, source)
                        if live is None:
                            return step, unflatten(snapshot.manifest, snapshot.payload,
                                                   copy=False, replicas=replicas)
                        try:
                            return step, live.apply(snapshot.manifest, snapshot.payload,
                                                    replicas)
                        except StateMismatch as e:
                            raise StateMismatch(
                                f"cannot restore the checkpoint of step {step} "
                                f"({self.last_where}) into this model: {e}") from None
            excluded.add(step)

    def _replica_not_own(self, step: int, snapshot: Snapshot, tiers: list[Tier],
                         held: Mapping[str, list[int]]) -> bool:
        """Whether ``snapshot`` must not stand for this rank (:func:`older_own_step`)."""
        donor = snapshot.manifest.get("replica_of")
        own = [s for tier in tiers if not isinstance(tier, PeerTier)
               for s in held.get(tier.name, ())]
        older = older_own_step(self.rank, step, snapshot.manifest, own)
        if older is not None:
            logger.warning("step %d of rank %d is only rank %s's replica, whose RNG states and "
                           "extras are that rank's: an older step of its own (step %d) is "
                           "restored instead", step, self.rank, donor, older)
            return True
        if another_ranks_side_state(self.rank, snapshot.manifest):
            logger.warning("rank %d takes step %d from rank %s's replica, with that rank's RNG "
                           "states and extras: it holds no older step of its own", self.rank,
                           step, donor)
        return False

    def heal(self, live: Any, group: Any) -> Any:
        """``(step, extras)`` when a member of this rank's replica ``group`` held nothing and
        was healed from a live member's memory (:mod:`elasticft.ckpt.restoring.heal`), else
        None. Collective."""
        from elasticft.ckpt.restoring.heal import heal

        if not (self._ranks.active and self.settings.shm_slots):
            return None
        memory = MemoryTier(SlotSet(self.settings.shm_slots, self._slot_count),
                            held_as=self.held_as)
        try:
            healed = heal(memory, self.rank, self.world_size, live, group)
        finally:
            memory.close()
        if healed is None:
            return None
        step, extras, source = healed
        self.last_source, self.last_where = "replica", f"rank {source}'s memory (live)"
        return step, extras

    def _reshard(self, tiers: list[Tier], live: Any) -> Any:
        """``(step, extras)`` of the newest durable step written at another world size, loaded
        by ``dcp.load`` (:mod:`elasticft.ckpt.restoring.reshard`); None if there is none."""
        roots = [t.root for t in tiers if isinstance(t, durable.DurableTier)]
        found = reshard.other_world_steps(roots, self.world_size)
        candidates = sorted(found, reverse=True)
        while True:
            step = self._ranks.agree(candidates)
            if step is None:
                logger.info("no checkpoint that every rank can load")
                return None
            directory = found[step]
            if self._ranks.all_ok(reshard.verify_share(directory, self.rank, self.world_size)):
                break
            candidates.remove(step)
        info = durable.commit_info(directory) or {}
        extras = reshard.restore_resharded(directory, live)
        self.last_source = "reshard"
        self.last_where = str(directory)
        logger.info("restored step %d from %s, written at world size %s, resharded to %d by "
                    "dcp.load", step, directory, info.get("world_size"), self.world_size)
        return step, extras

    def _read_step(
        self, step: int, tiers: list[Tier], held: Mapping[str, list[int]],
        stack: contextlib.ExitStack, in_place: bool,
    ) -> tuple[Snapshot | None, str | None]:
        for tier in tiers:
            if step not in held.get(tier.name, ()):
                continue
            try:
                if in_place and isinstance(tier, MemoryTier):
                    return stack.enter_context(tier.open(step, self.rank, self.world_size)), \
                        tier.name
                return tier.read(step, self.rank, self.world_size), tier.name
            except (OSError, CheckpointError) as e:
                logger.warning("step %d from %s unusable, trying the next source: %s", step,
                               tier.name, e)
        return None, None


def _close_later(tiers: list[Tier]) -> None:
    """Closes ``tiers`` on a thread of their own. Unmapping the memory tier's slots after a
    restore takes 0.1-0.2 s for 3 GB (the kernel lets go of every page the copy mapped, measured
    here), which the caller's first step need not wait for: the GIL is released meanwhile, and
    the kernel lets the step's page faults proceed during the unmapping."""
    def close_all() -> None:
        for tier in tiers:
            tier.close()

    threading.Thread(target=close_all, name="elasticft-tiers-close", daemon=True).start()


def _where(tier: Tier) -> str:
    """A tier as a place: a directory for the durable tiers, else the tier's name."""
    if isinstance(tier, durable.DurableTier):
        return str(tier.root.absolute())
    if isinstance(tier, MemoryTier):
        return "shared memory"
    return {"node": "this node's agent", "replica": "a replica's node"}.get(tier.name,
                                                                           "the backup node")


def older_own_step(rank: int, step: int, manifest: Mapping[str, Any],
                   own_steps: list[int]) -> int | None:
    """The step of ``rank``'s own to restore instead of ``manifest``'s, or None to take it
    (pure). A replica's node serves another rank's snapshot as this rank's (``replica_of``):
    the same model and optimizer, but that rank's RNG states and extras. A script that seeds
    each rank apart (nanoGPT's ``1337 + rank``) draws its dropout and augmentation from states
    that differ, so the replica would have this rank draw what the other drew, and the run go
    on with numbers the job never had. Where the rank holds an older step of its own
    (``own_steps``: its memory, its disks), that one is restored by every rank, one step more
    redone; with none (a node lost with its memory and no backup) the replica is taken."""
    if not another_ranks_side_state(rank, manifest):
        return None
    return max((s for s in own_steps if s < step), default=None)


def another_ranks_side_state(rank: int, manifest: Mapping[str, Any]) -> bool:
    """Whether ``manifest`` is another rank's replica that holds RNG states or extras (pure)."""
    donor = manifest.get("replica_of")
    return donor is not None and int(donor) != rank and any(
        item["path"][0] in ("rng", "extra") for item in manifest["items"])
