"""The checkpoint engine's shared vocabulary: the tier abstraction and the errors.

A *snapshot* is one rank's state at one step: a JSON manifest (what every item is, where its
bytes are) plus a payload of raw tensor bytes. Snapshots live in *tiers*, fastest first, numbered
by :class:`TierLevel` (the one numbering of the package, its options and its docs):

1. ``memory``: shared-memory slots on this host (:mod:`elasticft.ckpt.memory.shm`);
2. ``local``:  a directory on local disk (:mod:`elasticft.ckpt.persisting.durable`);
3. ``peer``:   the agent of another node that holds a backup (:mod:`elasticft.ckpt.backup.peer`);
4. ``remote``: a directory on shared storage (:mod:`elasticft.ckpt.persisting.durable`).

Every tier answers the same two questions: which steps do you hold for this rank, and give me
the snapshot of that step (verified). A tier that cannot answer raises a
:class:`CheckpointError` whose ``reason`` says why, and the loader moves on to the next tier.

Every tier takes its snapshots from the memory tier's *complete* ones, so a snapshot is
committed where it is sealed complete. A :class:`CommitGate` can refuse that: the layer that
knows when training state stopped being trustworthy (in-process recovery, after its process
groups were ended) registers one with the checkpointer, which asks it when a save starts and
again before it seals the snapshot.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Protocol


class CheckpointError(Exception):
    """A checkpoint problem; ``reason`` is machine-readable (``corrupt``, ``missing``...)."""

    reason = "checkpoint_error"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class SnapshotMissing(CheckpointError):
    reason = "missing"


class SnapshotCorrupt(CheckpointError):
    """Bytes do not match their checksum, or a snapshot was torn by a crash mid-write."""

    reason = "corrupt"


class StorageFull(CheckpointError):
    """The disk ran out of space; training goes on with the tiers that still work."""

    reason = "storage_full"


class UnsupportedState(CheckpointError):
    """The state holds a value a checkpoint cannot carry (tensors and JSON values only)."""

    reason = "unsupported_state"


class StateMismatch(CheckpointError):
    """A snapshot does not fit the model or optimizer it is restored into: another model, or
    the same one sharded another way. The message names the tensor, both shapes and the
    likely cause."""

    reason = "state_mismatch"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One rank's state at one step, as stored: manifest plus raw tensor bytes.

    ``payload`` is any buffer (a shared-memory slice, a bytearray read from disk or a peer);
    tensors decoded from it alias it until they are cloned.
    """

    manifest: dict[str, Any]
    payload: Any

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def rank(self) -> int:
        return int(self.manifest["rank"])

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])


class TierLevel(enum.IntEnum):
    """The tiers, fastest first: the order a load tries them in (a slower tier only where the
    faster ones cannot serve the step)."""

    MEMORY = 1
    """Shared-memory slots on this host."""
    LOCAL = 2
    """A directory on this node's disk."""
    PEER = 3
    """Another node's agent: the backup node, or a node holding a data-parallel replica."""
    REMOTE = 4
    """A directory on shared storage."""


class Tier(abc.ABC):
    """A place snapshots are kept: list the steps held for a rank, read one back verified."""

    name: str
    level: TierLevel

    @abc.abstractmethod
    def steps(self, rank: int, world_size: int) -> list[int]:
        """Steps this tier can serve for ``rank`` of a job of ``world_size``, newest first."""

    @abc.abstractmethod
    def read(self, step: int, rank: int, world_size: int) -> Snapshot:
        """The verified snapshot; raises :class:`SnapshotMissing` or :class:`SnapshotCorrupt`."""

    def close(self) -> None:  # noqa: B027 - most tiers hold nothing open
        """Releases what the tier holds open."""


class CommitGate(Protocol):
    """What may forbid committing a snapshot: asked when a save starts and again right before
    its snapshot is sealed complete (on the copy thread)."""

    def current(self) -> int:
        """The period a save taken now belongs to (in-process recovery: its generation)."""

    def refusal(self, taken_in: int) -> BaseException | None:
        """The error refusing a snapshot taken in period ``taken_in``, or None if it may be
        committed. ``save`` raises it; a refused seal leaves the snapshot incomplete."""
