"""The in-process protocol between an agent and its workers: what the agent tells a worker in
its environment, and the records the two write for each other in the agent's in-process
directory of the node.

The environment (:class:`InProcessSettings`, read in one place): the directory, the generation
a process starts in, the regroup timeout and the teardown's hard limit. The records, each a JSON
file written whole (:func:`elasticft.jsonfile.write_json`) so a reader never sees half of one:

* ``interrupt.json`` (:class:`InterruptNotice`), the agent's: the generation that is over;
* ``generation.json`` (:class:`Generation`), the agent's: the next generation's store and size;
* ``armed``, ``failed``, ``torn``, ``joined``, ``resumed`` and ``left`` (:class:`WorkerRecord`,
  :func:`worker_file`), a worker's: where it stands in a recovery;
* ``spare-<n>.json`` (:class:`SpareReady`), a spare's: its set-up is over and it waits, and
  ``assign-<n>.json`` (:class:`Assignment`), the agent's: the rank it takes.

Each typed record has its one writer (``write``) and its one reader (``read``; a missing, torn
or foreign file reads as None). Both sides (:mod:`elasticft.inprocess.worker`,
:mod:`elasticft.inprocess.spare` and the agent's :mod:`elasticft.inprocess.agent_side`) read and
write them through this module, which imports no other part of in-process recovery.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from elasticft.jsonfile import read_json, write_json

DIR_ENV = "ELASTICFT_INPROCESS_DIR"
GENERATION_ENV = "ELASTICFT_INPROCESS_GEN"
TIMEOUT_ENV = "ELASTICFT_INPROCESS_TIMEOUT"
TEARDOWN_ENV = "ELASTICFT_INPROCESS_TEARDOWN_LIMIT"
WORKER_ENV = frozenset({DIR_ENV, GENERATION_ENV, TIMEOUT_ENV, TEARDOWN_ENV})
"""Worker variables the agent sets for in-process recovery."""

STEP_WAIT_S = 10.0
"""How long a survivor told to stop at its next step boundary (the notice's ``at_step``) may
take to reach one before its monitor ends its groups anyway; the agent's limits add it."""

GENERATION_FILE = "generation.json"
INTERRUPT_FILE = "interrupt.json"

Read = Callable[[Path], "dict[str, Any] | None"]
"""How a record's file is read: :func:`elasticft.jsonfile.read_json` (None: none there)."""

@dataclasses.dataclass(frozen=True)
class InProcessSettings:
    """One worker's view of in-process recovery, read from the environment in one place."""

    directory: Path | None = None
    """The agent's in-process directory of this node (None: no agent, no recovery)."""
    generation: int = 0
    """The generation this process started in (above 0: a replacement)."""
    local_rank: int = 0
    timeout_s: float = 60.0
    """Longest wait for the agent's next generation and for the regrouped process group."""
    teardown_limit_s: float = 30.0
    """Hard limit of the teardown (abort, synchronize, release) and of the device's health
    check: a survivor that overruns it leaves, and the agent replaces it."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> InProcessSettings:
        env = os.environ if env is None else env
        directory = env.get(DIR_ENV)
        return cls(
            directory=Path(directory) if directory else None,
            generation=int(env.get(GENERATION_ENV, "0") or 0),
            local_rank=int(env.get("LOCAL_RANK", "0") or 0),
            timeout_s=float(env.get(TIMEOUT_ENV, "60") or 60),
            teardown_limit_s=float(env.get(TEARDOWN_ENV, "30") or 30),
        )



def worker_file(directory: Path, kind: str, local_rank: int) -> Path:
    """``armed`` (the worker recovers in process), ``failed`` (it caught a peer failure and
    waits for the next generation), ``torn`` (its teardown and health check are over: it
    waits for the generation, or regroups), ``joined`` (it is in the generation's group),
    ``resumed`` (its first optimizer step in that generation is over), ``left`` (its own
    limit ended it: it exits for a replacement)."""
    return directory / f"{kind}-l{local_rank}.json"


@dataclasses.dataclass(frozen=True)
class WorkerRecord:
    """A worker's word of where it stands in a recovery: its ``kind`` (:func:`worker_file`),
    the process that wrote it and the generation it was in, with what that kind carries."""

    kind: str
    local_rank: int
    pid: int
    generation: int
    facts: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """What the kind carries: ``armed`` what the worker follows (``follows_layout``,
    ``sharded_over``); ``failed`` when and why (``failed``, ``cause``); ``left`` why
    (``why``); the others the times of the recovery's phases."""

    def write(self, directory: Path) -> None:
        write_json(worker_file(directory, self.kind, self.local_rank),
                   {**self.facts, "pid": self.pid, "generation": self.generation})

    @classmethod
    def read(cls, directory: Path, kind: str, local_rank: int) -> WorkerRecord | None:
        record = read_json(worker_file(directory, kind, local_rank))
        if record is None or type(record.get("pid")) is not int:
            return None
        facts = {k: v for k, v in record.items() if k not in ("pid", "generation")}
        generation = record.get("generation")
        return cls(kind, local_rank, record["pid"],
                   generation if type(generation) is int else -1, facts)

    def of(self, pid: int | None, generation: int | None = None) -> bool:
        """Whether process ``pid`` wrote it (in ``generation``, when one is given)."""
        return pid == self.pid and (generation is None or generation == self.generation)


@dataclasses.dataclass(frozen=True)
class Generation:
    """The agent's answer to a failure: the new group's store and its members."""

    generation: int
    master_addr: str
    master_port: int
    world_size: int
    env: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    """A reshape (:mod:`elasticft.inprocess.reshape`): the variables that change for each local
    rank (``RANK``, ``WORLD_SIZE``, the layout's...), which the survivor sets before it regroups
    with its new rank; empty: every rank and the layout stay."""
    regroup_by: float = 0.0
    """Wall clock by which every worker must be in the new group: the agent's deadline for the
    recovery's regroup (:attr:`elasticft.inprocess.recovery_timing.Recovery.deadline`), which the
    survivor's regroup keeps too, so both bound the phase on the agent's clock (0: none
    given, the survivor's own timeout)."""

    @classmethod
    def read(cls, directory: Path, read: Read = read_json) -> Generation | None:
        return cls.from_record(read(directory / GENERATION_FILE))

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> Generation | None:
        try:
            return None if record is None else cls(
                int(record["generation"]), str(record["master_addr"]),
                int(record["master_port"]), int(record["world_size"]),
                {str(lr): {str(k): str(v) for k, v in env.items()}
                 for lr, env in dict(record.get("env") or {}).items()},
                float(record.get("regroup_by") or 0.0))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def env_of(self, local_rank: int) -> Mapping[str, str]:
        """The variables that change for ``local_rank`` in this generation (none: the same)."""
        return self.env.get(str(local_rank), {})

    def record(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "env": {k: dict(v) for k, v in self.env.items()}}

    def write(self, directory: Path) -> None:
        write_json(directory / GENERATION_FILE, {**self.record(), "time": time.time()})


@dataclasses.dataclass(frozen=True)
class InterruptNotice:
    """The agent's interrupt notice: generation ``ended`` is over
    (:mod:`elasticft.inprocess.interrupt`)."""

    ended: int
    at_step: bool = False
    """No peer failed (nodes join): each survivor stops at its next step boundary, and its
    groups are ended only if it reaches none within :data:`STEP_WAIT_S`."""
    time: float = 0.0
    """When the agent wrote it (wall clock)."""

    def write(self, directory: Path) -> None:
        write_json(directory / INTERRUPT_FILE, dataclasses.asdict(self))

    @classmethod
    def read(cls, directory: Path, read: Read = read_json) -> InterruptNotice | None:
        record = read(directory / INTERRUPT_FILE)
        if record is None or type(record.get("ended")) is not int:
            return None
        return cls(record["ended"], bool(record.get("at_step")), float(record.get("time", 0.0)))


def ready_file(directory: Path, spare: str) -> Path:
    """Written by the spare once its set-up is over and it waits for a rank."""
    return directory / f"spare-{spare}.json"


def assignment_file(directory: Path, spare: str) -> Path:
    return directory / f"assign-{spare}.json"


@dataclasses.dataclass(frozen=True)
class SpareReady:
    """A spare's word that its set-up is over and it waits for a rank."""

    pid: int
    ready: float
    """When its set-up ended (wall clock)."""

    def write(self, directory: Path, spare: str) -> None:
        write_json(ready_file(directory, spare), dataclasses.asdict(self))

    @classmethod
    def read(cls, directory: Path, spare: str) -> SpareReady | None:
        record = read_json(ready_file(directory, spare))
        try:
            return None if record is None else cls(int(record["pid"]), float(record["ready"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The agent's order to a spare: become ``local_rank`` with ``env`` in ``generation``."""

    generation: Generation
    local_rank: int
    env: dict[str, str]

    def write(self, directory: Path, spare: str) -> None:
        """Written whole and readable by this user only: the environment holds the rank's
        checkpoint peer secret."""
        write_json(assignment_file(directory, spare),
                   {"generation": self.generation.record(),
                    "local_rank": self.local_rank, "env": self.env, "time": time.time()},
                   private=True, parents=False)

    @classmethod
    def read(cls, directory: Path, spare: str) -> Assignment | None:
        record = read_json(assignment_file(directory, spare))
        try:
            generation = None if record is None else Generation.from_record(
                record["generation"])
            return None if record is None or generation is None else cls(
                generation, int(record["local_rank"]),
                {str(k): str(v) for k, v in record["env"].items()})
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
