"""This node's generations of in-process recovery: the directory the agent and its armed workers
share, and the store of each new generation.

The workers write their records there (``armed``, ``failed``, ``joined``, ``resumed``, ``left``:
:mod:`elasticft.inprocess.protocol`); the agent reads them matched by pid and generation, writes
the interrupt notice that ends a generation, and publishes the next one (``generation.json``:
a store of its own on a fresh port, or the workers' store of a new rendezvous round).
:class:`InProcessCoordinator` is that bookkeeping, with no process of its own to start or stop;
:class:`elasticft.inprocess.agent_side.InProcessRecovery` acts on it.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from elasticft import torch_compat
from elasticft.inprocess.protocol import (
    DIR_ENV,
    GENERATION_ENV,
    STEP_WAIT_S,
    TEARDOWN_ENV,
    TIMEOUT_ENV,
    Generation,
    InterruptNotice,
    WorkerRecord,
)
from elasticft.inprocess.recovery_timing import (
    Overrun,
    Recovery,
    SurvivorState,
    first_step_limit,
    overruns,
)


class InProcessCoordinator:
    """This node's in-process directory and generations."""

    def __init__(self, directory: Path, timeout_s: float, teardown_limit_s: float = 30.0
                 ) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        self.teardown_limit_s = teardown_limit_s
        self.generation = 0
        self.recovery: Recovery | None = None
        self.published: Generation | None = None
        self.regroup_by = 0.0
        """The deadline of the recovery under way (wall clock), told to the workers in each
        generation it publishes."""
        """The latest generation on a store of this agent's (None after a new round's)."""
        self.completed = 0
        self.notified: tuple[int, float, bool] | None = None
        """The latest interrupt notice written: the generation it ended, when, and whether it
        asked for a step boundary."""
        self._interrupted = -1
        self._stores: list[Any] = []

    @property
    def join_limit_s(self) -> float:
        """From the decision to every worker in the new group: a survivor's bounded teardown,
        then the regroup (a replacement's start and join)."""
        return self.teardown_limit_s + self.timeout_s

    def worker_env(self) -> dict[str, str]:
        return {DIR_ENV: str(self.directory), GENERATION_ENV: str(self.generation),
                TIMEOUT_ENV: str(self.timeout_s), TEARDOWN_ENV: str(self.teardown_limit_s)}

    def reset(self) -> None:
        """A full start of the workers: nothing in the directory is theirs.

        The old workers' records name pids that are gone; the interrupt notice and
        ``generation.json`` ended their generations, and would end the new workers' at once
        (a worker reads a published generation above its own as the end of its own); a
        spare's files belong to a spare that is gone. They may be an earlier agent's too: one
        that died (SIGKILL) in the middle of a recovery left them in the same run directory.
        """
        self.recovery = None
        self.notified = None
        self._interrupted = -1
        if self.directory.exists():
            for path in self.directory.glob("*.json"):
                with contextlib.suppress(OSError):
                    path.unlink()
        self.directory.mkdir(parents=True, exist_ok=True)

    def _record(self, kind: str, local_rank: int, pid: int | None,
                generation: int | None = None) -> dict[str, Any] | None:
        record = WorkerRecord.read(self.directory, kind, local_rank)
        if record is None or not record.of(pid, generation):
            return None
        return {**record.facts, "pid": record.pid, "generation": record.generation}

    def armed(self, pids: Mapping[int, int | None]) -> bool:
        """Whether every worker (local rank → pid) runs under ``InProcess``."""
        return bool(pids) and all(self._record("armed", lr, pid) is not None
                                  for lr, pid in pids.items())

    def armed_record(self, local_rank: int, pid: int | None) -> dict[str, Any]:
        """What a worker said of itself when it armed (empty: not armed)."""
        return self._record("armed", local_rank, pid) or {}

    def left_record(self, local_rank: int, pid: int | None) -> dict[str, Any]:
        """Why a worker left for a replacement (empty: it did not)."""
        return self._record("left", local_rank, pid) or {}

    def waiting(self, pids: Mapping[int, int | None]) -> dict[int, tuple[float, str]]:
        """Workers that caught a peer failure in the current generation: when, and its cause."""
        found = {}
        for local_rank, pid in pids.items():
            record = self._record("failed", local_rank, pid, self.generation)
            if record is not None:
                found[local_rank] = (float(record.get("failed", 0.0)),
                                     str(record.get("cause", "")))
        return found

    def interrupt(self, at_step: bool = False) -> None:
        """Tells every survivor at once that the current generation is over: their monitors
        end their process groups and free their main threads (the failure is known here
        before a survivor's collective could say so, or when it never would). ``at_step``: no
        peer failed (nodes join), so each survivor stops at its next step boundary instead,
        and its groups are ended only if it reaches none in time
        (:mod:`elasticft.inprocess.interrupt`)."""
        if self._interrupted == self.generation:
            return
        self._interrupted = self.generation
        now = time.time()
        InterruptNotice(self.generation, at_step, now).write(self.directory)
        self.notified = (self.generation, now, at_step)

    def publish(self, master_addr: str, world_size: int) -> Generation:
        """Starts the next generation's store and tells the survivors where it is."""
        store = torch_compat.serve_store(master_addr)
        self._stores = [*self._stores[-1:], store]  # the previous generation's may be in use
        self.generation += 1
        generation = Generation(self.generation, master_addr, store.port, world_size,
                                regroup_by=self.regroup_by)
        generation.write(self.directory)
        self.published = generation
        return generation

    def host_store(self, master_addr: str) -> tuple[str, int]:
        """Starts a store for the next generation of a job of several nodes, which the nodes
        may agree on (:mod:`elasticft.inprocess.failure_news`); returns its address and port."""
        store = torch_compat.serve_store(master_addr)
        self._stores = [*self._stores[-1:], store]
        return master_addr, store.port

    def adopt(self, master_addr: str, master_port: int, world_size: int) -> Generation:
        """Tells the survivors the next generation the nodes agreed on: an agent's store (this
        agent's or another node's), every rank a client of it."""
        self.generation += 1
        generation = Generation(self.generation, master_addr, master_port, world_size,
                                regroup_by=self.regroup_by)
        generation.write(self.directory)
        self.published = generation
        return generation

    def publish_round(self, master_addr: str, master_port: int, world_size: int,
                      env: Mapping[str, Mapping[str, str]] | None = None) -> Generation:
        """Tells the survivors the workers' store of a new rendezvous round, an agent's (whose
        new workers on other nodes meet them there); ``env``: a reshape's variables per local
        rank."""
        self.generation += 1
        generation = Generation(self.generation, master_addr, master_port, world_size,
                                dict(env or {}), self.regroup_by)
        generation.write(self.directory)
        self.published = None
        return generation

    def notice_of(self, ended: int, published_at: float, at_step: bool) -> tuple[float, bool]:
        """When the survivors of generation ``ended`` were told that it is over, and whether
        to stop at a step boundary: the interrupt notice, else (it could not be written) the
        next generation's publication."""
        if self.notified is not None and self.notified[0] == ended:
            return self.notified[1], self.notified[2]
        return published_at, at_step

    def replacement_env(self, env: Mapping[str, str], generation: Generation, attempt: int,
                        attempt_env: str) -> dict[str, str]:
        # The store is the agent's: every rank connects as a client, rank 0 included.
        return {**env, "MASTER_ADDR": generation.master_addr,
                "MASTER_PORT": str(generation.master_port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                attempt_env: str(attempt), GENERATION_ENV: str(generation.generation)}

    def resumed(self, pids: Mapping[int, int | None]) -> dict[int, dict[str, Any]] | None:
        """Every worker's ``resumed`` record of the current generation, or None until all have
        one."""
        records = {}
        for local_rank, pid in pids.items():
            record = self._record("resumed", local_rank, pid, self.generation)
            if record is None:
                return None
            records[local_rank] = record
        return records

    def joined_by(self, local_rank: int, pid: int | None) -> bool:
        """Whether that worker joined the current generation's group (it had formed)."""
        return self._record("joined", local_rank, pid, self.generation) is not None

    def torn_by(self, local_rank: int, pid: int | None) -> bool:
        """Whether that worker tore its groups down for the current generation (its ``torn``
        record of the generation that ended): it went on to wait for it and join its store."""
        return self._record("torn", local_rank, pid, self.generation - 1) is not None

    def joined(self, pids: Mapping[int, int | None]) -> bool:
        """Whether every worker has its ``joined`` record of the current generation."""
        return all(self._record("joined", lr, pid, self.generation) is not None
                   for lr, pid in pids.items())

    def survivors(self, pids: Mapping[int, int | None], replaced: Collection[int]
                  ) -> list[SurvivorState]:
        """What the records say of each survivor of the recovery under way (the workers less
        the ``replaced`` local ranks): its ``failed``, ``torn`` and ``left`` records of the
        generation that ended, its ``joined`` of the new one."""
        ended = self.generation - 1
        found = []
        for local_rank, pid in pids.items():
            if local_rank in replaced:
                continue
            failed = self._record("failed", local_rank, pid, ended)
            found.append(SurvivorState(
                local_rank, pid,
                failed_at=float(failed.get("failed", 0.0)) if failed is not None else None,
                torn_down=self._record("torn", local_rank, pid, ended) is not None,
                left=self._record("left", local_rank, pid, ended) is not None,
                joined=self._record("joined", local_rank, pid, self.generation) is not None))
        return found

    def overruns(self, pids: Mapping[int, int | None], now: float) -> list[Overrun]:
        """The survivors of the recovery under way past their limit, from the interrupt
        notice or from their ``failed`` record (:func:`overruns`; wall clock ``now``)."""
        recovery = self.recovery
        if recovery is None or recovery.joined_at is not None:
            return []
        return overruns(self.survivors(pids, recovery.replaced),
                        notified_at=recovery.notified_at, now=now,
                        limit_s=self.teardown_limit_s, step_wait_s=STEP_WAIT_S,
                        at_step=recovery.at_step)

    def overdue(self, now: float, pids: Mapping[int, int | None] | None = None) -> bool:
        """Whether the recovery under way overran its phase's limit: joining (teardown and
        regroup, :attr:`Recovery.deadline`), then the first step (:func:`first_step_limit`
        of the survivors' measurements, from when every worker joined)."""
        recovery = self.recovery
        if recovery is None:
            return False
        if recovery.joined_at is None and pids is not None and self.joined(pids):
            recovery.joined_at = now
            records = [self._record("failed", lr, pid, self.generation - 1) or {}
                       for lr, pid in pids.items()]
            recovery.first_step_s = first_step_limit(records)
        if recovery.joined_at is not None:
            return now > recovery.joined_at + recovery.first_step_s
        return now > recovery.deadline

    def close(self) -> None:
        self._stores = []
        with contextlib.suppress(OSError):
            shutil.rmtree(self.directory)
