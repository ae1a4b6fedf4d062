"""In-process recovery, the agent's side: replace the failed worker, keep the others running.

Workers whose training runs under :class:`elasticft.recovery.inprocess.InProcess` say so with an
``armed`` file in this node's in-process directory. When one of them fails and the policy
decides :attr:`~elasticft.addon.policy.ActionKind.RECOVER_IN_PROCESS` (every worker armed, the
failed worker on this node of a one-node job or on another node, the failure is a crash, a hang
or a communication error, restarts left), the agent does not stop the survivors. It

1. makes sure the failed rank's process is gone (a frozen one is killed; its sockets close, so
   the survivors' collectives with it raise). A dead process stays in the kernel's teardown of
   its mappings for up to a second with gigabytes of checkpoint slots mapped; on a CPU node the
   next steps do not wait for it (the process is reaped in the background), while on a node
   with GPUs they do, since the device memory of the dead process is released only at its end
   (:func:`replace_after_kill`),
2. starts a store for the next **generation** (a TCPStore this agent hosts, on a port of its
   own: no key of an earlier group can be read by the new one) and publishes it
   (``generation.json``), for the survivors to regroup on,
3. starts the replacement at once, from the warm interpreter when there is one, with the failed
   worker's environment and the new store as its ``MASTER_PORT``: its unchanged
   ``init_process_group()`` meets the survivors' regroup,
4. keeps monitoring. The recovery is over when every worker reports its first optimizer step in
   the new generation (``resumed``); the event log then gets a ``recover_in_process`` event
   with its phases (detect, abort, regroup, restore and redo).

A failure while a recovery is still under way, a replacement that cannot be started, or a
generation that does not resume within the timeout falls back to the full restart from the same
snapshots (:meth:`InProcessCoordinator.overdue`).

A communication error raised by a worker that is itself alive and waiting (every worker
``failed`` in the current generation, none exited) is recovered the same way with no process
replaced: all of them regroup.

**Across nodes** that is how another node's failure looks here, a lost node's too: the agent
joins the next rendezvous round with its workers still running (a warm standby takes the lost
node's place there, with its ranks) and publishes that round's worker address as the next
generation (:meth:`InProcessCoordinator.publish_round`; the survivor of rank 0 hosts the store,
as torch's ``env://`` would). The other nodes' new workers meet the survivors there. A round
that gives this node's workers other ranks restarts them in that round.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch.distributed as dist

from elasticft import procs, torch_compat
from elasticft.addon.api import Detection, GroupInfo
from elasticft.addon.classify import FailureClass, FailureRecord
from elasticft.addon.policy import Action
from elasticft.agent.recovery_timing import Recovery, first_step_limit, phases
from elasticft.agent.replace import replace_after_kill, start_replacements
from elasticft.agent.warmpool import WarmPool
from elasticft.diag.health import gpu_devices_present
from elasticft.events import EventLog
from elasticft.jsonfile import read_json, write_json
from elasticft.recovery.interrupt import INTERRUPT_FILE
from elasticft.recovery.protocol import (
    DIR_ENV,
    GENERATION_ENV,
    TEARDOWN_ENV,
    TIMEOUT_ENV,
    Generation,
    worker_file,
)
from elasticft.torch_compat import WorkerState

if TYPE_CHECKING:
    from elasticft.agent.spare import SpareKeeper

logger = logging.getLogger(__name__)


def blocker(*, armed: bool, nodes: int, recovering: bool, failed: int, workers: int,
            replaceable: str | None, shared_store: bool = False) -> str | None:
    """Why this failure cannot be recovered in process (None: it can); pure.

    ``failed``: local workers that failed (crashed, hung, or raised while the others did not);
    ``replaceable``: why torch's process context cannot replace one worker, or None;
    ``shared_store``: the rounds' workers share one agent store (``share_tcp_store``), which
    keeps the old group's keys.
    """
    if not armed:
        return "the workers do not all run under elasticft.recovery.inprocess"
    if recovering:
        return "a failure during an in-process recovery"
    if nodes != 1 and failed:
        return (f"a worker of this node failed in a job of {nodes} nodes (across nodes only the "
                f"nodes whose workers all survived regroup in process)")
    if nodes != 1 and shared_store:
        return ("the rounds' workers share the agent's store (share_tcp_store), which keeps the "
                "old group's keys")
    if failed >= workers:
        return "no worker survived"
    return replaceable


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
        """The latest generation on a store of this agent's (None after a new round's)."""
        self.completed = 0
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
        """A full start of the workers: the old records are stale (their pids are gone)."""
        self.recovery = None
        self._interrupted = -1
        if self.directory.exists():  # the notice too: it ended the old workers' generation
            for path in [*self.directory.glob("*-l*.json"), self.directory / INTERRUPT_FILE]:
                with contextlib.suppress(OSError):
                    path.unlink()
        self.directory.mkdir(parents=True, exist_ok=True)

    def _record(self, kind: str, local_rank: int, pid: int | None,
                generation: int | None = None) -> dict[str, Any] | None:
        record = read_json(worker_file(self.directory, kind, local_rank))
        if record is None or pid is None or record.get("pid") != pid:
            return None
        if generation is not None and record.get("generation") != generation:
            return None
        return record

    def armed(self, pids: Mapping[int, int | None]) -> bool:
        """Whether every worker (local rank → pid) runs under ``InProcess``."""
        return bool(pids) and all(self._record("armed", lr, pid) is not None
                                  for lr, pid in pids.items())

    def waiting(self, pids: Mapping[int, int | None]) -> dict[int, tuple[float, str]]:
        """Workers that caught a peer failure in the current generation: when, and its cause."""
        found = {}
        for local_rank, pid in pids.items():
            record = self._record("failed", local_rank, pid, self.generation)
            if record is not None:
                found[local_rank] = (float(record.get("failed", 0.0)),
                                     str(record.get("cause", "")))
        return found

    def interrupt(self) -> None:
        """Tells every survivor at once that the current generation is over: their monitors
        end their process groups and free their main threads (the failure is known here
        before a survivor's collective could say so, or when it never would)."""
        if self._interrupted == self.generation:
            return
        self._interrupted = self.generation
        write_json(self.directory / INTERRUPT_FILE, {"ended": self.generation,
                                                     "time": time.time()})

    def publish(self, master_addr: str, world_size: int) -> Generation:
        """Starts the next generation's store and tells the survivors where it is."""
        store = dist.TCPStore(master_addr, 0, is_master=True, multi_tenant=True,
                              wait_for_workers=False)
        self._stores = [*self._stores[-1:], store]  # the previous generation's may be in use
        self.generation += 1
        generation = Generation(self.generation, master_addr, store.port, world_size)
        generation.write(self.directory)
        self.published = generation
        return generation

    def publish_round(self, master_addr: str, master_port: int, world_size: int,
                      agent_store: bool) -> Generation:
        """Tells the survivors the workers' store of a new rendezvous round (whose new workers
        on other nodes meet them there)."""
        self.generation += 1
        generation = Generation(self.generation, master_addr, master_port, world_size,
                                agent_store)
        generation.write(self.directory)
        self.published = None
        return generation

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

    def joined(self, pids: Mapping[int, int | None]) -> bool:
        """Whether every worker has its ``joined`` record of the current generation."""
        return all(self._record("joined", lr, pid, self.generation) is not None
                   for lr, pid in pids.items())

    def stuck(self, pids: Mapping[int, int | None], now: float, grace_s: float = 5.0
              ) -> list[int]:
        """Survivors still in their teardown (a ``failed`` record of the previous generation,
        none of this one) past the hard limit and ``grace_s``: their own limit did not end
        them, the agent kills them (wall clock ``now``)."""
        found = []
        for local_rank, pid in pids.items():
            failed = self._record("failed", local_rank, pid, self.generation - 1)
            if (failed is not None and self._record("joined", local_rank, pid,
                                                    self.generation) is None
                    and now > float(failed.get("failed", now)) + self.teardown_limit_s
                    + grace_s):
                found.append(local_rank)
        return found

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


class InProcessRecoveryMixin:
    """Mixed into the agent: in-process recovery as the agent carries it out (the steps in this
    module's docstring) on its own process context, workers and event log."""

    attempt_env: ClassVar[str]
    """The worker variable that numbers the attempts (the agent's)."""
    inprocess: InProcessCoordinator
    events: EventLog
    warm_pool: WarmPool | None
    restarts: int
    _attempt: int
    _armed: dict[int, int | None]
    _decided: tuple[FailureRecord, ...]
    _seen_at: float
    _pcontext: Any
    _worker_group: Any
    _shutdown_timeout: int
    _round: int
    spare: SpareKeeper

    def group_info(self) -> GroupInfo:
        raise NotImplementedError

    def _hook_survivor_stop(self) -> None:
        raise NotImplementedError

    def _each_collaborator(self, hook: str, call: Callable[[Any], Any]) -> list[Any]:
        raise NotImplementedError

    if TYPE_CHECKING:  # the agent's own (torch's LocalElasticAgent)
        def _rendezvous(self, worker_group: Any) -> None: ...
        def _stop_workers(self, worker_group: Any) -> None: ...
        def _start_workers(self, worker_group: Any) -> dict[int, Any]: ...

    def _worker_pids(self) -> dict[int, int | None]:
        return dict(self._pcontext.pids()) if self._pcontext is not None else {}

    def _dead_workers(self) -> set[int]:
        """Local ranks whose process has exited or begun to exit: a worker that wrote its
        ``failed`` record and died after it is no survivor, and is replaced like the failed
        rank (a record alone is matched by pid, which says nothing of the process)."""
        if self._pcontext is None or torch_compat.replace_worker_unavailable(self._pcontext):
            return set()  # function entrypoints: no worker of theirs is replaced in process
        dead = set()
        for local_rank, pid in self._pcontext.pids().items():
            proc = torch_compat.worker_process(self._pcontext, local_rank)
            if proc.poll() is not None or (pid is not None and procs.ending_status(pid)):
                dead.add(local_rank)
        return dead

    def _waiting_survivors(self, pids: Mapping[int, int | None]) -> dict[int, tuple[float, str]]:
        """The workers waiting for the next generation whose process still lives."""
        dead = self._dead_workers()
        return {lr: w for lr, w in self.inprocess.waiting(pids).items() if lr not in dead}

    def _to_replace(self, pids: Mapping[int, int | None],
                    failures: Sequence[FailureRecord]) -> list[int]:
        """The local workers a recovery replaces: the failed ones and any other that died,
        less the survivors that wait for the next generation."""
        failed = {f.local_rank for f in failures if f.local_rank in pids} | self._dead_workers()
        return sorted(failed - set(self._waiting_survivors(pids)))

    def _all_armed(self) -> bool:
        """Whether every worker runs under ``elasticft.recovery.inprocess`` (cached per pid
        set: an armed worker stays armed)."""
        pids = self._worker_pids()
        if pids and pids == self._armed:
            return True
        if self.inprocess.armed(pids):
            self._armed = pids
            return True
        return False

    def _in_process_blocker(self, group: GroupInfo,
                            failures: tuple[FailureRecord, ...]) -> str | None:
        pids = self._worker_pids()
        replace = self._to_replace(pids, failures)
        return blocker(
            armed=self._all_armed(), nodes=group.group_world_size,
            recovering=self.inprocess.recovery is not None, failed=len(replace),
            workers=len(pids), shared_store=self.workers_use_agent_store(),
            replaceable=torch_compat.replace_worker_unavailable(self._pcontext))

    def _replace_leavers(self, exited: Mapping[int, Any]) -> bool:
        """Workers that exited while a recovery on this agent's store is still forming its
        group (a survivor whose teardown overran the hard limit, or whose device failed its
        check) are replaced in that same generation; returns whether all were."""
        recovery, generation = self.inprocess.recovery, self.inprocess.published
        if (recovery is None or generation is None or recovery.joined_at is not None
                or generation.generation != recovery.generation):
            return False
        by_global = {w.global_rank: w.local_rank for w in self._worker_group.workers}
        local_ranks = [by_global[r] for r in exited if r in by_global]
        if not local_ranks or any(lr in recovery.replaced for lr in local_ranks):
            return False  # a replacement that failed: the restart
        records = {lr: read_json(worker_file(self.inprocess.directory, "left", lr)) or {}
                   for lr in local_ranks}

        def env_of(env: Any) -> dict[str, str]:
            return self.inprocess.replacement_env(env, generation, self._attempt,
                                                  self.attempt_env)

        try:
            started = replace_after_kill(
                [torch_compat.worker_process(self._pcontext, lr) for lr in local_ranks],
                self._shutdown_timeout, gpu_devices_present(),
                lambda: start_replacements(self._pcontext, local_ranks, self.warm_pool, env_of))
        except Exception:
            logger.exception("could not replace workers %s in the recovery", local_ranks)
            return False
        for local_rank, pid in started.items():
            self._worker_group.workers[local_rank].id = pid
            recovery.replaced[local_rank] = pid
        for local_rank in local_ranks:
            rank = self._worker_group.workers[local_rank].global_rank
            why = str(records[local_rank].get("why", f"exit {exited[rank].exitcode}"))
            logger.warning("in-process recovery of generation %d: local rank %d left (%s); "
                           "its replacement joins the same generation", recovery.generation,
                           local_rank, why)
            self.events.emit("survivor_replaced", attempt=self._attempt,
                             generation=recovery.generation,
                             rank=rank, pid=started[local_rank], reason=why)
        return True

    def _in_process_progress(self, group: GroupInfo, armed: bool) -> Detection | None:
        """Completes a recovery under way, or reports one that is overdue; sees workers that all
        caught a communication error with none exited (a regroup with no replacement)."""
        recovery = self.inprocess.recovery
        pids = self._worker_pids()
        if recovery is not None:
            records = self.inprocess.resumed(pids)
            if records is not None:
                self.inprocess.recovery = None
                self.inprocess.completed += 1
                timings = phases(recovery, records)
                logger.warning("in-process recovery of generation %d done: %s",
                               recovery.generation, timings)
                self.events.emit("recover_in_process", attempt=self._attempt,
                                 generation=recovery.generation, cause=recovery.cause,
                                 round=self._round,
                                 replaced=self._by_global_rank(recovery.replaced),
                                 spare=self._by_global_rank(
                                     self.spare.taken.get(recovery.generation, {})),
                                 phases=timings)
                return None
            if recovery.joined_at is None:
                for local_rank in self.inprocess.stuck(pids, time.time()):
                    logger.warning("local rank %d overran its teardown's hard limit "
                                   "(%.0f s): killed", local_rank,
                                   self.inprocess.teardown_limit_s)
                    procs.kill([torch_compat.worker_process(self._pcontext, local_rank)])
            if self.inprocess.overdue(time.monotonic(), pids):
                what = (f"its first step not done within {recovery.first_step_s:.0f} s of "
                        f"the regroup" if recovery.joined_at is not None else
                        f"not regrouped within {self.inprocess.join_limit_s:.0f} s")
                return Detection(FailureClass.INFRASTRUCTURE, (), "inprocess",
                                 f"in-process recovery of generation {recovery.generation} "
                                 f"{what}")
            return None
        if not armed:
            return None
        waiting = self._waiting_survivors(pids)
        if waiting and len(waiting) < len(pids):
            # A worker's own communication error: its peers may wait in a collective with it
            # that never ends; they are told at once, and report as waiting too.
            self.inprocess.interrupt()
        if waiting and len(waiting) == len(pids):
            by_local = {w.local_rank: w.global_rank for w in group.workers}
            first = min(waiting, key=lambda lr: (waiting[lr][0], lr))  # the one that raised
            return Detection(FailureClass.INFRASTRUCTURE, (by_local[first],), "inprocess",
                             f"every worker caught a communication error, rank "
                             f"{by_local[first]} first: {waiting[first][1]}")
        return None

    def _recover_in_process(self, action: Action) -> str | None:
        """Replaces the failed workers and publishes the next generation; returns why that
        failed (the caller then restarts the group), or None."""
        seen_at = self._seen_at
        decided_at = time.time()
        pids = self._worker_pids()
        replace = self._to_replace(pids, self._decided)
        replaced: dict[int, int] = {}
        self._recovery_times: dict[str, float] = {}
        try:
            self.inprocess.interrupt()
        except OSError as e:  # the survivors then leave when their collectives raise
            logger.warning("could not write the interrupt notice: %s", e)
        if self._worker_group.group_world_size > 1:  # another node's worker failed
            generation = self._next_round_generation(pids)
            if generation is None:
                return None
        else:
            try:
                generation, replaced = self._replace_in_process(replace)
            except Exception as e:  # anything: the restart below starts from the same snapshots
                logger.exception("could not replace workers %s in process", replace)
                return f"{type(e).__name__}: {e}"
        self.inprocess.recovery = Recovery(
            generation.generation, action.reason, seen_at, decided_at, time.time(), replaced,
            time.monotonic() + self.inprocess.join_limit_s, times=self._recovery_times)
        self._hook_survivor_stop()
        self._armed = {}
        group = self.group_info()
        logger.warning("in-process recovery: generation %d on port %d, replaced local rank(s) "
                       "%s (pids %s), %d survivor(s) regroup", generation.generation,
                       generation.master_port, replace, list(replaced.values()),
                       len(pids) - len(replace))
        self.events.emit("worker_replaced", attempt=self._attempt,
                         generation=generation.generation,
                         pids={str(w.global_rank): w.pid for w in group.workers},
                         replaced=self._by_global_rank(replaced))
        self._each_collaborator("on_workers_started", lambda c: c.on_workers_started(group))
        return None

    def _by_global_rank(self, by_local: dict[int, int]) -> dict[str, int]:
        workers = self._worker_group.workers
        return {str(workers[local_rank].global_rank): pid for local_rank, pid in by_local.items()}

    def _replace_in_process(self, replace: list[int]) -> tuple[Generation, dict[int, int]]:
        """Kills the failed local workers, publishes the next generation on a store of this
        agent's and starts their replacements at once; returns it and their pids."""
        pcontext = self._pcontext

        def publish_and_start() -> tuple[Generation, dict[int, int]]:
            world = self._worker_group.workers[0].world_size
            generation = self.inprocess.publish(self._worker_group.master_addr or "127.0.0.1",
                                                world)
            self._attempt += 1
            self.restarts += 1

            def env_of(env: Any) -> dict[str, str]:
                return self.inprocess.replacement_env(env, generation, self._attempt,
                                                      self.attempt_env)

            times["fork"] = time.time()
            replaced = self.spare.take(pcontext, replace, generation, env_of)  # a ready spare
            replaced.update(start_replacements(
                pcontext, [lr for lr in replace if lr not in replaced], self.warm_pool, env_of))
            times["forked"] = time.time()
            for local_rank, pid in replaced.items():  # torch's monitor compares ids and pids
                self._worker_group.workers[local_rank].id = pid
            return generation, replaced

        times = self._recovery_times = {}

        def reaped(at: float) -> None:
            times["reaped"] = at

        return replace_after_kill([torch_compat.worker_process(pcontext, lr) for lr in replace],
                                  self._shutdown_timeout, gpu_devices_present(),
                                  publish_and_start, reaped if replace else None)

    def workers_use_agent_store(self) -> bool:
        """Whether the workers' ``env://`` store is this agent's (``TORCHELASTIC_USE_AGENT_STORE``):
        as the handler says, except for torch's static rendezvous, whose workers get a store of
        their own every round (the agent's ``_fresh_worker_store``)."""
        wg = self._worker_group
        return (bool(getattr(wg.spec.rdzv_handler, "use_agent_store", False))
                and not torch_compat.keeps_one_store(wg.spec.rdzv_handler, wg.group_world_size))

    def _next_round_generation(self, pids: dict[int, int | None]) -> Generation | None:
        """A job of several nodes: a new rendezvous round with no worker stopped (a standby
        takes the lost node's place there), published as the survivors' next generation. A
        round that renumbers this node's ranks restarts its workers in that round (None)."""
        wg = self._worker_group
        before = [(w.global_rank, w.world_size) for w in wg.workers]
        self._attempt += 1
        self.restarts += 1
        self._rendezvous(wg)
        for worker in wg.workers:  # the same processes: torch's monitor compares ids and pids
            worker.id = pids.get(worker.local_rank)
        after = [(w.global_rank, w.world_size) for w in wg.workers]
        if after == before:
            return self.inprocess.publish_round(
                wg.master_addr or "127.0.0.1", wg.master_port or 0, after[0][1],
                self.workers_use_agent_store())
        cause = (f"round {self._round} gives this node's workers (rank, world size) {after}, "
                 f"not {before}: they restart")
        logger.warning("no in-process regroup: %s", cause)
        self.events.emit("restart", attempt=self._attempt, cause=cause, counted=False)
        self._stop_workers(wg)
        for local_rank, pid in self._start_workers(wg).items():
            wg.workers[local_rank].id = pid
        wg.state = WorkerState.HEALTHY
        return None
