"""In-process recovery, the agent's side: replace the failed worker, keep the others running.

Workers whose training runs under :class:`elasticft.inprocess.worker.InProcess` say so with an
``armed`` file in this node's in-process directory. When one of them fails and the policy
decides :attr:`~elasticft.addon.policy.ActionKind.RECOVER_IN_PROCESS` (every worker armed, the
failed worker on this node of a one-node job or on another node, the failure is a crash, a hang
or a communication error, restarts left), the agent does not stop the survivors. It

1. makes sure the failed rank's process is gone (a frozen one is killed; its sockets close, so
   the survivors' collectives with it raise). A dead process stays in the kernel's teardown of
   its mappings for up to a second with gigabytes of checkpoint slots mapped; on a CPU node the
   next steps do not wait for it (the process is reaped in the background), while on a node
   with GPUs they do, since the device memory of the dead process is released only at its end
   (:meth:`~elasticft.inprocess.ports.WorkerOps.kill_then`),
2. starts a store for the next **generation** (a TCPStore this agent hosts, on a port of its
   own: no key of an earlier group can be read by the new one) and publishes it
   (``generation.json``), for the survivors to regroup on,
3. starts the replacement at once, from the warm interpreter when there is one, with the failed
   worker's environment and the new store as its ``MASTER_PORT``: its unchanged
   ``init_process_group()`` meets the survivors' regroup. On a node with GPUs it starts only on
   a GPU no live worker uses and that did not fault (:mod:`elasticft.inprocess.placement`: a
   worker that died of a device fault gets no replacement on its GPU); where there is none,
   the failure is not recovered in process and the policy's restart or eviction decides, the
   reason in the event log (``replacement_unplaced``),
4. keeps monitoring. The recovery is over when every worker reports its first optimizer step in
   the new generation (``resumed``); the event log then gets a ``recover_in_process`` event
   with its phases (detect, abort, regroup, restore and redo).

Every survivor is bounded from the interrupt notice: one that has not reported ``failed``
within the teardown's hard limit of it (its main thread is held in a C call, or holds the GIL,
and its own monitor cannot run), or is not in the new group within the limit of its report, is
killed (a ``survivor_killed`` event with what the agent saw:
:func:`elasticft.inprocess.recovery_timing.overruns`) and replaced in the same generation, like
the failed rank (``survivor_replaced``), with no restart.

A failure while a recovery is still under way, a replacement that cannot be started, or a
generation that does not resume within the timeout falls back to the full restart from the same
snapshots (``InProcessCoordinator.overdue``, :mod:`elasticft.inprocess.generations`).

A communication error raised by a worker that is itself alive and waiting (every worker
``failed`` in the current generation, none exited) is recovered the same way with no process
replaced: all of them regroup.

**Across nodes** every node hears of the failure at once and only the failed rank gets a new
process; the agents agree on the next generation, or take the next rendezvous round, and a
round that renumbers the workers is a *reshape* (:mod:`elasticft.inprocess.across_nodes`).

**The agent holds it.** :class:`InProcessRecovery` is an object of the agent's, not a part of
it: what it needs of the agent comes through :class:`~elasticft.inprocess.ports.AgentSide`
(torch's process context and worker group to read, the attempt counter, a rendezvous, the
agent's restart path, its collaborators' notice), what it does to the worker processes through
:class:`~elasticft.inprocess.ports.WorkerOps` (which alone records the new pids in torch's
worker group), and every restart it causes goes through the agent's one restart path with its hooks
(``before_restart``: the healthy workers' checkpoint). Its state (the coordinator of
generations, the spare, the workers last seen armed) is its own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from elasticft import procs, torch_compat
from elasticft.addon.api import Detection, GroupInfo
from elasticft.addon.classify import FailureClass, FailureRecord, device_fault
from elasticft.addon.policy import Action, ChangeFacts
from elasticft.diag.health import gpu_devices_present
from elasticft.events import EventLog
from elasticft.inprocess import placement
from elasticft.inprocess.across_nodes import CHAINED_LIMIT, AcrossNodes
from elasticft.inprocess.failure_news import FailureNews
from elasticft.inprocess.generations import InProcessCoordinator
from elasticft.inprocess.ports import AgentSide
from elasticft.inprocess.protocol import Generation, WorkerRecord
from elasticft.inprocess.recovery_timing import Recovery, phases
from elasticft.inprocess.spare_keeper import SpareKeeper

logger = logging.getLogger(__name__)


def blocker(*, armed: bool, nodes: int, recovering: bool, failed: int, workers: int,
            replaceable: str | None, shared_store: bool = False, across_nodes: bool = False,
            chained: int = 0) -> str | None:
    """Why this failure cannot be recovered in process (None: it can); pure.

    ``failed``: local workers that failed (crashed, hung, or raised while the others did not);
    ``replaceable``: why torch's process context cannot replace one worker, or None;
    ``shared_store``: the rounds' workers share one agent store (``share_tcp_store``), which
    keeps the old group's keys; ``across_nodes``: the nodes share a store where they agree on
    a generation with only the failed ranks new (:mod:`elasticft.inprocess.failure_news`);
    ``chained``: recoveries begun since the last one that completed (a failure during one of
    them begins the next, across nodes, up to :data:`CHAINED_LIMIT`).
    """
    if not armed:
        return "the workers do not all run under elasticft.inprocess.InProcess"
    if recovering and not (across_nodes and nodes != 1):
        return "a failure during an in-process recovery"
    if recovering and chained >= CHAINED_LIMIT:
        return (f"a failure during in-process recovery {chained} in a row (at most "
                f"{CHAINED_LIMIT} before one completes)")
    if nodes != 1 and failed and not across_nodes:
        return (f"a worker of this node failed in a job of {nodes} nodes (across nodes only the "
                f"nodes whose workers all survived regroup in process, as the job's nodes "
                f"share no store)")
    if nodes != 1 and shared_store:
        return ("the rounds' workers share the agent's store (share_tcp_store), which keeps the "
                "old group's keys")
    if failed >= workers and not (nodes != 1 and across_nodes):  # other nodes' survive
        return "no worker survived"
    return replaceable


def leaver_blocker(*, replacement_left: bool, formed: bool, began_regroup: bool
                   ) -> str | None:
    """Why a worker that left a forming recovery cannot be replaced in that same generation
    (None: it can); pure.

    ``replacement_left``: the leaver is a replacement of this recovery; ``formed``: a leaver
    joined the generation's group, which had formed; ``began_regroup``: a leaver wrote its
    ``torn`` record (its groups were aborted, then it waited for the generation and joined its
    store), so its half of ``init_process_group`` (its address under its rank, NCCL's
    bootstrap with the root) may be in the generation's store, where a replacement of the same
    rank meets it and the group does not form until the recovery is overdue. Such a leaver
    needs a generation on a fresh store; until the survivors can leave a regroup under way for
    it, the answer is a restart now rather than one when the recovery is overdue.
    """
    if replacement_left:
        return "a replacement failed"
    if formed:
        return "its group had formed: a replacement cannot join it"
    if began_regroup:
        return ("it had begun the regroup (its torn record): what it left in the generation's "
                "store keeps a replacement of its rank from forming the group")
    return None


@dataclasses.dataclass(eq=False)
class InProcessRecovery(AcrossNodes):
    """In-process recovery as the agent carries it out (the steps in this module's docstring):
    the generations it publishes, the spare it keeps, and the agent's side it calls back."""

    coordinator: InProcessCoordinator
    spare: SpareKeeper
    events: EventLog
    agent: AgentSide
    shutdown_timeout: float = dataclasses.field(kw_only=True)
    attempt_env: str = dataclasses.field(kw_only=True)
    """The worker variable that numbers the attempts (the agent's)."""
    news: FailureNews | None = dataclasses.field(default=None, kw_only=True)
    """The news of ended generations across the job's nodes (None: one node only)."""
    armed_pids: dict[int, int | None] = dataclasses.field(default_factory=dict, init=False)
    """The workers (local rank → pid) last seen all armed."""
    in_use: bool = dataclasses.field(default=False, init=False)
    """Whether this job's workers ever armed in-process recovery (for this agent's life): the
    job runs under ``InProcess``, and its later starts get the in-process NCCL settings
    (:func:`elasticft.inprocess.ncclenv.worker_env`)."""
    chained: int = dataclasses.field(default=0, init=False)
    """Recoveries begun since the last one completed (or since the workers started)."""
    _times: dict[str, float] = dataclasses.field(default_factory=dict, init=False)
    _killed: dict[int, str] = dataclasses.field(default_factory=dict, init=False)
    """The survivors this recovery killed past their limit (local rank → why)."""

    # -- the agent's lifecycle -----------------------------------------------------------------

    @property
    def recovering(self) -> bool:
        """Whether a recovery is under way (published, not yet resumed)."""
        return self.coordinator.recovery is not None

    @property
    def teardown_limit_s(self) -> float:
        """The hard limit of a survivor's teardown from the interrupt notice (seconds)."""
        return self.coordinator.teardown_limit_s

    def worker_env(self) -> dict[str, str]:
        return self.coordinator.worker_env()

    def on_rendezvous(self, store: Any, round_: int, nodes: int, node_rank: int,
                      host: str) -> None:
        """A rendezvous round began: the news of ended generations is heard in its store."""
        if self.news is not None:
            self.news.on_rendezvous(store, round_, nodes, node_rank, host)

    def on_workers_started(self) -> None:
        """A full start of the workers: the old records are stale."""
        self.coordinator.reset()
        self.armed_pids = {}
        self._killed = {}
        self.chained = 0

    def on_workers_stopped(self) -> None:
        self.spare.stop()

    def tick(self, *, armed: bool) -> None:
        """A healthy monitor tick: the spare is kept (one node only: a job of several nodes
        replaces a lost rank with a standby node's)."""
        self.spare.tick(self._context(), self.agent.workers,
                        armed=armed and self._group().group_world_size == 1,
                        recovering=self.recovering)

    def close(self) -> None:
        if self.news is not None:
            self.news.close()
        self.coordinator.close()

    # -- what the agent asks at a monitor tick -------------------------------------------------

    def _context(self) -> Any:
        return self.agent.context()

    def _group(self) -> Any:
        return self.agent.worker_group()

    def worker_pids(self) -> dict[int, int | None]:
        context = self._context()
        return dict(context.pids()) if context is not None else {}

    def _dead_workers(self) -> set[int]:
        """Local ranks whose process has exited or begun to exit: a worker that wrote its
        ``failed`` record and died after it is no survivor, and is replaced like the failed
        rank (a record alone is matched by pid, which says nothing of the process)."""
        context = self._context()
        if context is None or torch_compat.replace_worker_unavailable(context):
            return set()  # function entrypoints: no worker of theirs is replaced in process
        dead = set()
        for local_rank, pid in context.pids().items():
            proc = torch_compat.worker_process(context, local_rank)
            if proc.poll() is not None or (pid is not None and procs.ending_status(pid)):
                dead.add(local_rank)
        return dead

    def _waiting_survivors(self, pids: Mapping[int, int | None]) -> dict[int, tuple[float, str]]:
        """The workers waiting for the next generation whose process still lives."""
        dead = self._dead_workers()
        return {lr: w for lr, w in self.coordinator.waiting(pids).items() if lr not in dead}

    def _to_replace(self, pids: Mapping[int, int | None],
                    failures: Sequence[FailureRecord]) -> list[int]:
        """The local workers a recovery replaces: the failed ones and any other that died,
        less the survivors that wait for the next generation."""
        failed = {f.local_rank for f in failures if f.local_rank in pids} | self._dead_workers()
        return sorted(failed - set(self._waiting_survivors(pids)))

    def all_armed(self) -> bool:
        """Whether every worker runs under ``elasticft.inprocess.worker`` (cached per pid
        set: an armed worker stays armed)."""
        pids = self.worker_pids()
        if pids and pids == self.armed_pids:
            return True
        if self.coordinator.armed(pids):
            self.armed_pids = pids
            self.in_use = True
            return True
        return False

    def blocker(self, group: GroupInfo, failures: tuple[FailureRecord, ...]) -> str | None:
        """Why this failure cannot be recovered in process (None: it can)."""
        pids = self.worker_pids()
        replace = self._to_replace(pids, failures)
        why = blocker(
            armed=self.all_armed(), nodes=group.group_world_size,
            recovering=self.recovering, failed=len(replace), workers=len(pids),
            shared_store=torch_compat.workers_share_one_store(self._group()),
            across_nodes=self._across_nodes(), chained=self.chained,
            replaceable=torch_compat.replace_worker_unavailable(self._context()))
        if why is None and replace:
            why = self._unplaceable(replace, self._device_faults(failures))
        return why

    def _device_faults(self, failures: Sequence[FailureRecord]) -> dict[int, bool]:
        """Local rank → whether its worker died of a fault of its GPU: its failure says so, or
        the ``left`` record it wrote (a survivor whose device failed the health check may exit
        before the agent saw it wait)."""
        return placement.device_faults(
            (f.local_rank, f"{f.exception or ''} {f.message or ''} "
                           f"{self.coordinator.left_record(f.local_rank, f.pid).get('why', '')}")
            for f in failures)

    def _unplaceable(self, replace: Sequence[int], faults: Mapping[int, bool],
                     spare_takes: bool = True) -> str | None:
        """Why a replacement of one of ``replace`` has no GPU to start on
        (:func:`elasticft.inprocess.placement.unplaced`), or None; the rank the ready spare takes
        (``spare_takes``) needs none. The reason goes to the event log."""
        context = self._context()
        if context is None or not self.spare.gpus:
            return None
        unplaced = placement.unplaced(
            self.spare.gpu_use(context), replace, faults,
            self.spare.would_take(replace) if spare_takes else None)
        if unplaced is None:
            return None
        local_rank, reason = unplaced
        self.events.emit("replacement_unplaced", attempt=self.agent.attempt(),
                         rank=self._group().workers[local_rank].global_rank, reason=reason)
        return f"no GPU for a replacement: {reason}"

    def leavers(self, exited: Mapping[int, Any]) -> ChangeFacts | None:
        """What the policy (:func:`~elasticft.addon.policy.decide_change`) sees of workers that
        exited while a recovery on this agent's store is still forming its group (a survivor
        whose teardown overran the hard limit, or whose device failed its check, or that the
        agent killed past its limit): whether their replacements can join that same
        generation. None when no recovery's group is forming (their exit is a failure)."""
        recovery, generation = self.coordinator.recovery, self.coordinator.published
        if (recovery is None or generation is None or recovery.joined_at is not None
                or generation.generation != recovery.generation):
            return None
        by_global = {w.global_rank: w.local_rank for w in self._group().workers}
        local_ranks = [by_global[r] for r in exited if r in by_global]
        what = f"local rank(s) {local_ranks} left the recovery of generation " \
               f"{recovery.generation}"
        leaving = [(by_global[r], exited[r].pid) for r in exited if r in by_global]
        why_not = leaver_blocker(
            replacement_left=not local_ranks or any(lr in recovery.replaced
                                                    for lr in local_ranks),
            formed=any(self.coordinator.joined_by(lr, pid) for lr, pid in leaving),
            began_regroup=any(self.coordinator.torn_by(lr, pid) for lr, pid in leaving))
        if why_not is None:
            why_not = self._unplaceable(local_ranks, self._left_faults(local_ranks)[1],
                                        spare_takes=False)
        return ChangeFacts("leaver", what, why_not is None, why_not or "")

    def _left_faults(self, local_ranks: Sequence[int]
                     ) -> tuple[dict[int, dict[str, Any]], dict[int, bool]]:
        """The ``left`` records of these local ranks, and whether each names a device fault."""
        records = {lr: record.facts if (record := WorkerRecord.read(
                       self.coordinator.directory, "left", lr)) is not None else {}
                   for lr in local_ranks}
        return records, {lr: device_fault(str(records[lr].get("why", "")))
                         for lr in local_ranks}

    def replace_leavers(self, exited: Mapping[int, Any]) -> bool:
        """Replaces the workers that left a forming recovery (:meth:`leavers`, once the policy
        decided so) in that same generation; returns whether all were."""
        recovery, generation = self.coordinator.recovery, self.coordinator.published
        assert recovery is not None and generation is not None  # leavers()
        context, group = self._context(), self._group()
        by_global = {w.global_rank: w.local_rank for w in group.workers}
        local_ranks = [by_global[r] for r in exited if r in by_global]
        records, faults = self._left_faults(local_ranks)
        for local_rank in local_ranks:
            self.spare.place_replacement(context, local_rank, faults[local_rank])
        attempt = self.agent.attempt()

        def env_of(env: Any) -> dict[str, str]:
            return self.coordinator.replacement_env(env, generation, attempt, self.attempt_env)

        try:
            started = self.agent.workers.kill_then(
                local_ranks, self.shutdown_timeout, gpu_devices_present(),
                lambda: self.agent.workers.start_replacements(local_ranks, env_of))
        except Exception:
            logger.exception("could not replace workers %s in the recovery", local_ranks)
            return False
        self.agent.workers.record_pids(started)
        recovery.replaced.update(started)
        for local_rank in local_ranks:
            rank = group.workers[local_rank].global_rank
            why = self._killed.get(local_rank) or str(
                records[local_rank].get("why", f"exit {exited[rank].exitcode}"))
            logger.warning("in-process recovery of generation %d: local rank %d left (%s); "
                           "its replacement joins the same generation", recovery.generation,
                           local_rank, why)
            self.events.emit("survivor_replaced", attempt=attempt,
                             generation=recovery.generation,
                             rank=rank, pid=started[local_rank], reason=why)
        return True

    def progress(self, group: GroupInfo, armed: bool) -> Detection | None:
        """Completes a recovery under way, or reports one that is overdue; sees workers that all
        caught a communication error with none exited (a regroup with no replacement)."""
        heard = self.news.heard() if self.news is not None and (armed or self.recovering) \
            else None
        if heard is not None:  # another node ended the generation: this one's are survivors
            return self._recover_heard(*heard)
        recovery = self.coordinator.recovery
        pids = self.worker_pids()
        if recovery is not None:
            records = self.coordinator.resumed(pids)
            if records is not None:
                self.coordinator.recovery = None
                self.coordinator.completed += 1
                self.chained = 0
                timings = phases(recovery, records)
                times = recovery.times  # across nodes: the agents' own waits
                for phase, start, end in (("agree_s", "agree", "agreed"),
                                          ("rendezvous_s", "rendezvous", "rendezvoused")):
                    if start in times and end in times:
                        timings[phase] = round(times[end] - times[start], 4)
                limits = {"rendezvous_s": times["rendezvous_limit_s"]} \
                    if "rendezvous_limit_s" in times else {}
                logger.warning("in-process recovery of generation %d done: %s",
                               recovery.generation, timings)
                self.events.emit("recover_in_process", attempt=self.agent.attempt(),
                                 generation=recovery.generation, cause=recovery.cause,
                                 round=self.agent.round(),
                                 replaced=self._by_global_rank(recovery.replaced),
                                 spare=self._by_global_rank(
                                     self.spare.taken.get(recovery.generation, {})),
                                 phases=timings, limits=limits)
                return None
            self._kill_overruns(recovery, pids)
            if self.coordinator.overdue(time.time(), pids):
                what = (f"its first step not done within {recovery.first_step_s:.0f} s of "
                        f"the regroup" if recovery.joined_at is not None else
                        f"not regrouped within {self.coordinator.join_limit_s:.0f} s")
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
            self.coordinator.interrupt()
        if waiting and len(waiting) == len(pids):
            by_local = {w.local_rank: w.global_rank for w in group.workers}
            first = min(waiting, key=lambda lr: (waiting[lr][0], lr))  # the one that raised
            return Detection(FailureClass.INFRASTRUCTURE, (by_local[first],), "inprocess",
                             f"every worker caught a communication error, rank "
                             f"{by_local[first]} first: {waiting[first][1]}")
        return None

    def _kill_overruns(self, recovery: Recovery, pids: Mapping[int, int | None]) -> None:
        """Kills each survivor past its limit from the interrupt notice, or from its own
        report (:func:`elasticft.inprocess.recovery_timing.overruns`), once: its exit is then
        replaced in the same recovery (:meth:`replace_leavers`), with the reason logged here."""
        workers = self._group().workers
        for overrun in self.coordinator.overruns(pids, time.time()):
            if overrun.local_rank in self._killed:
                continue
            self._killed[overrun.local_rank] = overrun.reason
            rank = workers[overrun.local_rank].global_rank
            logger.warning("in-process recovery of generation %d: rank %d (local rank %d, pid "
                           "%s) %s; killed, for a replacement in the same generation",
                           recovery.generation, rank, overrun.local_rank, overrun.pid,
                           overrun.reason)
            self.events.emit("survivor_killed", attempt=self.agent.attempt(),
                             generation=recovery.generation, rank=rank, pid=overrun.pid,
                             reason=overrun.reason, **overrun.evidence)
            self.agent.workers.kill([overrun.local_rank])

    # -- a recovery ------------------------------------------------------------------------------

    def growth_blocker(self) -> str | None:
        """Why nodes waiting to join cannot join the running workers in process (None: they
        can: every worker armed and following a layout change, no recovery under way)."""
        if self.recovering:
            return "a recovery is under way"
        if not self.all_armed():
            return "not every worker runs under InProcess"
        pids = self.worker_pids()
        if not all(self.coordinator.armed_record(lr, pid).get("follows_layout")
                   for lr, pid in pids.items()):
            return "the script does not follow a layout change (InProcess(follows_layout=True))"
        return None

    def grow(self, cause: str) -> str | None:
        """Nodes wait to join (a standby came back): the workers are interrupted at once, the
        agent joins the next round with them still running, and the round's reshape is
        decided as a shrink's is (:meth:`_next_round_generation`); returns why that failed
        (the agent then restarts the group), or None."""
        logger.warning("%s: the workers regroup in process with the new node(s)", cause)
        return self._recover(cause, (), time.time(), in_round=True, at_step=True)

    def recover(self, action: Action, failures: Sequence[FailureRecord], seen_at: float
                ) -> str | None:
        """Replaces the failed workers and publishes the next generation; returns why that
        failed (the agent then restarts the group through its restart path), or None."""
        across = self._across_nodes()
        return self._recover(action.reason, failures, seen_at,
                             in_round=self._group().group_world_size > 1 and not across,
                             across=across)

    def _recover(self, cause: str, failures: Sequence[FailureRecord], seen_at: float, *,
                 in_round: bool, at_step: bool = False, across: bool = False) -> str | None:
        decided_at = time.time()
        self.coordinator.regroup_by = decided_at + self.coordinator.join_limit_s
        pids = self.worker_pids()
        replace = self._to_replace(pids, failures)
        replaced: dict[int, int] = {}
        self._times = {}
        if self.coordinator.recovery is not None:  # a failure during it: the next one begins
            logger.warning("in-process recovery of generation %d superseded: %s",
                           self.coordinator.generation, cause)
            self.coordinator.recovery = None
        self.chained += 1
        try:
            self.coordinator.interrupt(at_step=at_step)
        except OSError as e:  # the survivors then leave when their collectives raise
            logger.warning("could not write the interrupt notice: %s", e)
        if in_round:  # nodes join (or no store the nodes share)
            joined = self._next_round_generation(pids)
            if joined is None:
                return None
            generation, replaced = joined
        elif across:  # the nodes agree on the next generation in the job's shared store
            try:
                agreed = self._agree_across_nodes(pids, replace, cause,
                                                   self._device_faults(failures))
            except Exception as e:  # anything: the restart starts from the same snapshots
                logger.exception("could not agree on the next generation across nodes")
                return f"{type(e).__name__}: {e}"
            if agreed is None:
                return None
            generation, replaced = agreed
        else:
            try:
                generation, replaced = self._replace_in_process(
                    replace, self._device_faults(failures))
            except Exception as e:  # anything: the restart starts from the same snapshots
                logger.exception("could not replace workers %s in process", replace)
                return f"{type(e).__name__}: {e}"
        published_at = time.time()
        notified_at, notice_at_step = self.coordinator.notice_of(
            generation.generation - 1, published_at, at_step)
        self.coordinator.recovery = Recovery(
            generation.generation, cause, seen_at, decided_at, published_at, replaced,
            self.coordinator.regroup_by, times=self._times,
            notified_at=notified_at, at_step=notice_at_step)
        self._killed = {}
        self.armed_pids = {}
        group = self.agent.group_info()
        logger.warning("in-process recovery: generation %d on port %d, replaced local rank(s) "
                       "%s (pids %s), %d survivor(s) regroup", generation.generation,
                       generation.master_port, replace, list(replaced.values()),
                       len(pids) - len(replace))
        self.events.emit("worker_replaced", attempt=self.agent.attempt(),
                         generation=generation.generation,
                         pids={str(w.global_rank): w.pid for w in group.workers},
                         replaced=self._by_global_rank(replaced))
        self.agent.workers_changed()
        return None

    def _by_global_rank(self, by_local: dict[int, int]) -> dict[str, int]:
        workers = self._group().workers
        return {str(workers[local_rank].global_rank): pid for local_rank, pid in by_local.items()}

    def _replace_in_process(self, replace: list[int], faults: Mapping[int, bool],
                            publish: Callable[[], Generation] | None = None
                            ) -> tuple[Generation, dict[int, int]]:
        """Kills the failed local workers, publishes the next generation (``publish``; by
        default on a store of this agent's) and starts their replacements at once, each on the
        GPU :func:`elasticft.inprocess.placement.replacement_gpu` allows (``faults``: local ranks
        whose worker died of a device fault); returns it and their pids."""
        context, group = self._context(), self._group()
        times = self._times

        def publish_and_start() -> tuple[Generation, dict[int, int]]:
            world = group.workers[0].world_size
            generation = (publish() if publish is not None else
                          self.coordinator.publish(group.master_addr or "127.0.0.1", world))
            attempt = self.agent.next_attempt()

            def env_of(env: Any) -> dict[str, str]:
                return self.coordinator.replacement_env(env, generation, attempt,
                                                        self.attempt_env)

            times["fork"] = time.time()
            replaced = self.spare.take(context, self.agent.workers, replace, generation,
                                       env_of, faults)  # a ready spare
            started = [lr for lr in replace if lr not in replaced]
            for local_rank in started:
                where = self.spare.place_replacement(context, local_rank,
                                                     faults.get(local_rank, False))
                if where.gpu is None:
                    raise RuntimeError(f"no GPU for a replacement: {where.reason}")
            replaced.update(self.agent.workers.start_replacements(started, env_of))
            times["forked"] = time.time()
            self.agent.workers.record_pids(replaced)
            return generation, replaced

        def reaped(at: float) -> None:
            times["reaped"] = at

        return self.agent.workers.kill_then(replace, self.shutdown_timeout, gpu_devices_present(),
                                            publish_and_start, reaped if replace else None)
