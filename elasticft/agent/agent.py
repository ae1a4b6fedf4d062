"""The node agent: torch's ``LocalElasticAgent`` with a failure policy, an event log and
collaborators.

It overrides only torch's hooks. The run loop (``_invoke_run``) is torch's loop with the
restart branch replaced: every failure is classified (:mod:`elasticft.addon.classify`), the
pure policy (:mod:`elasticft.addon.policy`) decides, and the decision and its reason go to the
log and the event log, as do a change of membership's (nodes join, a survivor leaves a
recovery); restarts are counted from the decisions alone. It also fixes torch 2.13's restart:
restarts honour ``--shutdown-timeout``, and a group that ends unhealthy fails, never succeeds.
One thing torch offers no hook for: when a worker fails, torch stops the others at once, so the
agent wraps that step to let the collaborators act on the survivors first
(:func:`~elasticft.agent.replace.notify_before_survivors_stopped`). When the workers recover in
process (:mod:`elasticft.inprocess.agent_side`, an object the agent holds), the agent sees a
failed worker before torch does (:func:`~elasticft.agent.replace.failed_exits`) and replaces
only that one.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from elasticft import procs, steps, torch_compat
from elasticft.addon.api import (
    AgentCollaborator,
    Detection,
    GroupInfo,
    WorkerInfo,
    prepend_paths,
    run_ending_errors,
)
from elasticft.addon.classify import (
    FailureClass,
    FailureRecord,
    classify_exit,
    own_exception_at_exit,
    without_collateral,
)
from elasticft.addon.policy import (
    Action,
    ActionKind,
    ChangeFacts,
    FailureFacts,
    FailureSignature,
    comm_repeats,
    comm_signature,
    decide,
    decide_change,
    root_cause,
)
from elasticft.agent import console, lifeline
from elasticft.agent.replace import (
    ContextWorkers,
    ending_exits,
    failed_exits,
    notify_before_survivors_stopped,
)
from elasticft.agent.warmpool import WarmPool, WarmStartMixin
from elasticft.ckpt import settings as ckpt_settings
from elasticft.config import ElasticftConfig
from elasticft.diag import workerenv as diag_workerenv
from elasticft.diag.health import GPU_DEVICE_GLOB, gpu_devices_present
from elasticft.events import EventLog
from elasticft.inprocess import ncclenv, protocol, reconfigure, spare
from elasticft.inprocess.agent_side import InProcessRecovery
from elasticft.inprocess.failure_news import FailureNews
from elasticft.inprocess.generations import InProcessCoordinator
from elasticft.inprocess.ports import AgentSide
from elasticft.inprocess.spare_keeper import SpareKeeper, node_gpus
from elasticft.plan import worker as plan_worker
from elasticft.torch_compat import (
    LocalElasticAgent,
    LogsSpecs,
    ProcessFailure,
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

RUN_DIR_ENV = "ELASTICFT_RUN_DIR"
_HOST = socket.gethostname()
NODE_ID_ENV = "ELASTICFT_NODE_ID"
ROUND_ENV = "ELASTICFT_ROUND"
ATTEMPT_ENV = "ELASTICFT_ATTEMPT"
WORKER_ENV = frozenset({RUN_DIR_ENV, NODE_ID_ENV, ROUND_ENV, ATTEMPT_ENV, lifeline.AGENT_PID_ENV})
"""Worker variables the agent itself sets."""

WORKER_ENV_NAMES = (
    WORKER_ENV | ckpt_settings.WORKER_ENV | diag_workerenv.WORKER_ENV | plan_worker.WORKER_ENV
    | steps.WORKER_ENV | protocol.WORKER_ENV | spare.WORKER_ENV
)
"""Every worker variable elasticft adds to torch's (documented in the README), each owned by the
subsystem that sets or reads it: the agent's own, the checkpoint tiers, the diagnostics rings and
shim, the round's 3D-parallel layout, the step records of ``elasticft report`` and in-process
recovery (and its spare)."""
_STEADY_AFTER_S = 2.0


class ElasticftAgent(WarmStartMixin, LocalElasticAgent):
    """A ``LocalElasticAgent`` whose failure handling is decided by :func:`policy.decide`."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        options: ElasticftConfig,
        events: EventLog,
        node_id: str,
        run_dir: Path,
        collaborators: Sequence[AgentCollaborator] = (),
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
        warm_pool: WarmPool | None = None,
    ) -> None:
        super().__init__(
            spec,
            logs_specs,
            start_method=start_method,
            exit_barrier_timeout=exit_barrier_timeout,
            log_line_prefix_template=log_line_prefix_template,
            **torch_compat.agent_init_kwargs(shutdown_timeout),
        )
        # torch < 2.12 neither takes nor keeps it; elasticft applies it on every torch.
        self._shutdown_timeout = shutdown_timeout
        self.options = options
        self.events = events
        self.node_id = node_id
        self.run_dir = run_dir
        self.collaborators = tuple(collaborators)
        self.final_action: Action | None = None
        """The decision that ended the run (None when it succeeded)."""
        self.failures: list[FailureRecord] = []
        """Every classified failure of this run, oldest first."""
        self.restarts = 0
        self._user_error_restarts = 0
        self._attempt = 0
        self._round = -1
        self._round_stores: list[dist.TCPStore] = []  # the workers' (_host_worker_store)
        self._started_at = 0.0
        self._steady_reported = False
        self._detection: Detection | None = None
        self._previous_failure: FailureSignature | None = None
        """The last attempt's failure, when that attempt completed no step (the policy's
        ``FailureFacts.previous_failure``)."""
        self._in_process_failed_at: int | None = None
        """While the workers run an in-process recovery's generation: the newest step of the
        failure it answered (the policy's ``FailureFacts.in_process_failed_at``)."""
        self._previous_comm: FailureSignature | None = None
        self._comm_repeats = 0
        """The last attempt's communication fault before its first step, and how many attempts
        in a row before it had the same (the policy's ``FailureFacts.comm_repeats``)."""
        self.warm_pool = warm_pool
        """Pre-started interpreters for restarts (elasticft.agent.warmpool); None: cold starts."""
        generations = InProcessCoordinator(
            run_dir / "inprocess" / node_id, options.recovery.recovery_inprocess_timeout_s,
            options.recovery.recovery_inprocess_teardown_limit_s)
        self.in_process = InProcessRecovery(
            generations, SpareKeeper(generations.directory, events,
                                     options.recovery.recovery_inprocess_spare,
                                     node_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"),
                                               glob.glob(GPU_DEVICE_GLOB))),
            events, self._agent_side(), shutdown_timeout=shutdown_timeout,
            attempt_env=ATTEMPT_ENV,
            news=FailureNews(events, node_id, lambda _ended: generations.interrupt()))
        """In-process recovery (:mod:`elasticft.inprocess.agent_side`)."""
        self._decided: tuple[FailureRecord, ...] = ()
        self._seen_at = 0.0
        self._exits = procs.ExitWatch()  # the monitor interval, cut short by a worker's exit

    # ------------------------------------------------------------------------------------------
    # What the collaborators see.

    def group_info(self) -> GroupInfo:
        wg = self._worker_group
        pids = self._pcontext.pids() if self._pcontext is not None else {}
        return GroupInfo(
            run_id=wg.spec.rdzv_handler.get_run_id(),
            node_id=self.node_id,
            run_dir=self.run_dir,
            round=self._round,
            group_rank=wg.group_rank if wg.group_rank is not None else -1,
            group_world_size=wg.group_world_size if wg.group_world_size is not None else 0,
            restart_count=self._attempt,
            workers=tuple(
                WorkerInfo(w.local_rank, w.global_rank, w.world_size, pids.get(w.local_rank))
                for w in wg.workers
            ),
            master_addr=wg.master_addr or "",
            master_port=wg.master_port or 0,
            in_process=bool(self.in_process.armed_pids),
        )

    def _each_collaborator(self, hook: str, call: Callable[[AgentCollaborator], T]) -> list[T]:
        """``call(collaborator)`` for each collaborator, in hook order; ``hook`` names the hook
        in the log line of a collaborator that fails."""
        results = []
        for collaborator in self.collaborators:
            try:
                results.append(call(collaborator))
            except run_ending_errors():
                raise  # a collaborator ends the run on purpose, or the launcher was signalled
            except Exception:
                # A collaborator is an add-on: its failure must never cost the training run.
                logger.exception("collaborator %s failed in %s", type(collaborator).__name__, hook)
        return results

    # ------------------------------------------------------------------------------------------
    # torch's hooks.

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if self._round < 0:
            self.prewarm(worker_group.spec)  # imports overlap the first wait (a standby's)
        super()._rendezvous(worker_group)
        self._round = torch_compat.rendezvous_round(worker_group.spec.rdzv_handler,
                                                    self._round + 1)
        if torch_compat.agent_hosts_worker_store(worker_group.spec.rdzv_handler,
                                                 worker_group.group_world_size):
            self._host_worker_store(worker_group)
        self.events.emit(
            "rendezvous",
            round=self._round,
            group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size,
            master_addr=worker_group.master_addr,
            master_port=worker_group.master_port,
        )
        self.in_process.on_rendezvous(
            self._store, self._round, worker_group.group_world_size,
            worker_group.group_rank or 0, worker_group.spec.local_addr or socket.getfqdn())
        group = self.group_info()
        self._each_collaborator("on_rendezvous", lambda c: c.on_rendezvous(group, self._store))

    def _host_worker_store(self, worker_group: WorkerGroup) -> None:
        """Gives this round's workers a fresh store, which the agent of node rank 0 binds on a
        port the system picks (:func:`~elasticft.torch_compat.agent_hosts_worker_store` says
        why); the round before's stays up, for a worker of it still reading."""
        info, hosted = torch_compat.host_worker_store(
            worker_group.group_rank or 0, worker_group.master_addr or "127.0.0.1",
            dist.PrefixStore(f"elasticft/worker-store/{self._round}", self._store))
        self._round_stores = [*self._round_stores[-1:], *([hosted] if hosted else [])]
        worker_group.master_addr, worker_group.master_port = info.master_addr, info.master_port

    def _set_local_rank_env(
        self, worker_env: dict[str, str | None], local_rank: int, spec: WorkerSpec
    ) -> None:
        super()._set_local_rank_env(worker_env, local_rank, spec)
        worker_env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the handler's or this agent's
        worker_env[RUN_DIR_ENV] = str(self.run_dir)
        worker_env[NODE_ID_ENV] = self.node_id
        worker_env[ROUND_ENV] = str(self._round)
        worker_env[ATTEMPT_ENV] = str(self._attempt)
        worker_env.update(lifeline.worker_env())
        worker_env.update(self.in_process.worker_env())
        worker_env.update(self.startup_env())
        group = self.group_info()
        worker = next(w for w in group.workers if w.local_rank == local_rank)
        for extra in self._each_collaborator("worker_env", lambda c: c.worker_env(group, worker)):
            worker_env.update(extra or {})
        if (path := self.worker_pythonpath(worker_env.get("PYTHONPATH"))) is not None:
            worker_env["PYTHONPATH"] = path

    def startup_env(self) -> dict[str, str]:
        # Only a node with GPUs runs NCCL, and only a job under InProcess wants its settings:
        # elsewhere the workers' environment stays torchrun's.
        gpus = gpu_devices_present()
        names_it = ncclenv.entry_script_arms(self._worker_group.spec.args)
        env = ncclenv.worker_env(os.environ, self.in_process.teardown_limit_s, gpus=gpus,
                                 in_process=self.in_process.in_use or names_it)
        # From the script alone, the same for every start and node: a replacement's group
        # must be made the way the survivors' was.
        if names_it:
            chosen = self.options.recovery.recovery_inprocess_regroup
            if chosen == "auto":
                env[reconfigure.REGIME_ENV] = "1"
            if not getattr(self, "_regroup_path_said", False):
                logger.info("%s", reconfigure.path_line(chosen))
                self._regroup_path_said = True
        return env

    def worker_pythonpath(self, existing: str | None) -> str | None:
        """The workers' ``PYTHONPATH``: what the collaborators declare first
        (:meth:`AgentCollaborator.python_path`), then ``existing`` (None: nothing declared,
        ``existing`` stands)."""
        declared = [p for paths in self._each_collaborator("python_path", lambda c: c.python_path())
                    for p in paths or ()]
        return prepend_paths(declared, existing) if declared else None

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.in_process.on_workers_started()
        pids = super()._start_workers(worker_group)
        self._hook_survivor_stop()
        self._started_at = time.monotonic()
        self._steady_reported = False
        group = self.group_info()
        self.events.emit(
            "workers_started",
            attempt=self._attempt,
            round=self._round,
            pids={str(w.global_rank): w.pid for w in group.workers},
            host=_HOST,
            local_ranks={str(w.global_rank): w.local_rank for w in group.workers},
            world_size=group.workers[0].world_size if group.workers else 0,
            warm_local_ranks=list(self.warm_ranks),
        )
        self._each_collaborator("on_workers_started", lambda c: c.on_workers_started(group))
        return pids

    def _hook_survivor_stop(self) -> None:
        if self._pcontext is not None:
            notify_before_survivors_stopped(
                self._pcontext,
                lambda failed: self._each_collaborator(
                    "before_survivors_stopped",
                    lambda c: c.before_survivors_stopped(self.group_info(), failed)),
            )

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM,
                  timeout: int | None = None) -> None:
        # Continued only now: an in-process recovery kills a frozen rank, never lets it run on.
        procs.continue_stopped([w.id for w in self._worker_group.workers])
        # torch < 2.12 calls this without a timeout (its built-in 30 s): honour ours everywhere.
        torch_compat.shutdown_agent(
            self, super()._shutdown, death_sig,
            self._shutdown_timeout if timeout is None else timeout,
        )

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # torch stops workers on restart with its built-in 30 s; honour --shutdown-timeout.
        self._shutdown(timeout=self._shutdown_timeout)
        self.in_process.on_workers_stopped()
        group = self.group_info()
        self._each_collaborator("on_workers_stopped", lambda c: c.on_workers_stopped(group))

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        recovery = self.in_process
        ending = ending_exits(self._pcontext, self._worker_group.workers)
        if ending and not self._absorb_leavers(ending):
            return RunResult(state=WorkerState.FAILED, failures=ending)
        armed = recovery.all_armed()  # once a tick: for a plain script, a file that is not there
        if armed or recovery.recovering:
            # Before torch's poll, which would stop the survivors on seeing the failure.
            exited = failed_exits(self._pcontext, self._worker_group.workers)
            if exited and not self._absorb_leavers(exited):
                return RunResult(state=WorkerState.FAILED, failures=exited)
        result = super()._monitor_workers(worker_group)
        if result.state != WorkerState.HEALTHY:
            return result
        group = self.group_info()
        detection = recovery.progress(group, armed)
        if detection is not None:
            self._detection = detection
            return RunResult(state=WorkerState.UNHEALTHY)
        recovery.tick(armed=armed)
        if not self._steady_reported and time.monotonic() - self._started_at >= _STEADY_AFTER_S:
            self._steady_reported = True
            self.events.emit("steady", attempt=self._attempt, round=self._round)
        for detection in self._each_collaborator("check", lambda c: c.check(group)):
            if detection is not None:
                self._detection = detection
                return RunResult(state=WorkerState.UNHEALTHY)
        return result

    # ------------------------------------------------------------------------------------------
    # The run loop, with torch's restart branch replaced by the policy.

    def run(self, role: str = "default") -> RunResult:
        """torch's run (which shuts the workers down however it ends), then the in-process
        directory and the generations' stores are released."""
        try:
            return super().run(role)
        finally:
            self.in_process.close()
            self._exits.close()

    def _invoke_run(self, role: str = "default") -> RunResult:
        spec = self._worker_group.spec
        self._initialize_workers(self._worker_group)
        while True:
            pids = self._pcontext.pids().values() if self._pcontext is not None else ()
            self._exits.wait(pids, spec.monitor_interval)
            run_result = self._monitor_workers(self._worker_group)
            state = run_result.state
            self._worker_group.state = state
            if state == WorkerState.SUCCEEDED:
                self.events.emit("workers_succeeded", attempt=self._attempt)
                self.in_process.on_workers_stopped()
                done = self.group_info()
                self._each_collaborator("on_workers_stopped",
                                        lambda c, g=done: c.on_workers_stopped(g))
                self._each_collaborator("on_workers_succeeded",
                                        lambda c, g=done: c.on_workers_succeeded(g))
                self._exit_barrier()
                return run_result
            if state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                action = self._handle_failure(run_result)
                if action.kind is ActionKind.RECOVER_IN_PROCESS:
                    failed = self.in_process.recover(action, self._decided, self._seen_at)
                    if failed is not None:
                        logger.error("in-process recovery failed (%s); restarting the workers",
                                     failed)
                        self._restart(cause=f"in-process recovery failed: {failed}",
                                      counted=False)
                    continue
                if action.kind is ActionKind.RESTART_IN_PLACE:
                    self._wait_before_restart(action)
                    self._restart(cause=action.reason)
                    continue
                self._stop_workers(self._worker_group)
                self._worker_group.state = WorkerState.FAILED
                self.final_action = action
                return self._failed_result(run_result)
            if state == WorkerState.HEALTHY:
                waiting = spec.rdzv_handler.num_nodes_waiting()
                if waiting > 0:
                    self._join(waiting)
                continue
            raise RuntimeError(f"[{role}] worker group in unexpected state {state.name}")

    def _handle_failure(self, run_result: RunResult) -> Action:
        self._seen_at = time.time()
        group = self.group_info()
        if self._detection is not None:
            failures = self._detection.as_failures(group)
            suspect = self._detection.node_suspect
            self._detection = None
        else:
            failures = self._classify(run_result)
            suspect = False
        for failure in failures:
            # A failure the job recovers from is a warning; the decision to stop is the error.
            logger.warning("worker failure: %s", failure.summary())
            self.events.emit("failure", attempt=self._attempt, **failure.to_json())
        self.failures.extend(failures)
        self._each_collaborator("on_failure", lambda c: c.on_failure(group, failures))
        spec = self._worker_group.spec
        facts = FailureFacts(
            failures, spec.max_restarts - self._remaining_restarts, spec.max_restarts,
            user_error_restarts_used=self._user_error_restarts,
            restart_on_user_error=self.options.agent.restart_on_user_error,
            node_suspect=suspect, nodes=group.group_world_size,
            previous_failure=self._previous_failure,
            in_process_failed_at=self._in_process_failed_at)
        for extra in self._each_collaborator("failure_facts",
                                             lambda c: c.failure_facts(group, failures)):
            facts = dataclasses.replace(facts, **(extra or {}))
        why_not = self.in_process.blocker(group, failures)
        if why_not is None:
            facts = dataclasses.replace(facts, in_process=True)
        elif self.in_process.armed_pids:
            logger.info("no in-process recovery: %s", why_not)
        comm = comm_signature(root_cause(failures)) if failures else None
        repeats = comm_repeats(self._previous_comm, self._comm_repeats, comm,
                               facts.step_completed)
        facts = dataclasses.replace(
            facts, comm_repeats=repeats, jitter=random.random(),
            backoff_first_s=self.options.agent.restart_backoff_s,
            backoff_max_s=self.options.agent.restart_backoff_max_s)
        self._previous_comm = comm if facts.step_completed is False else None
        self._comm_repeats = repeats
        self._decided = failures
        action = decide(facts)
        signature = FailureSignature.of(root_cause(failures)) if failures else None
        self._previous_failure = signature if facts.step_completed is False else None
        self._in_process_failed_at = (facts.newest_step if action.kind is
                                      ActionKind.RECOVER_IN_PROCESS else None)
        log = logger.error if action.kind is ActionKind.STOP else logger.warning
        log("decision: %s (%s)", action.kind.value, action.reason)
        self.events.emit(
            "decision", action=action.kind.value, reason=action.reason, attempt=self._attempt,
            checkpoint=action.checkpoint.value, step_completed=facts.step_completed,
            signature=signature.to_json() if signature else None,
            newest_step=facts.newest_step, in_process_failed_at=facts.in_process_failed_at,
            previous_failure=(facts.previous_failure.to_json() if facts.previous_failure
                              else None))
        self._each_collaborator("on_decision", lambda c: c.on_decision(group, action))
        if self._pcontext is not None:  # a recovered failure's tracebacks: worker logs only
            console.run_goes_on(self._pcontext, action.kind in (
                ActionKind.RESTART_IN_PLACE, ActionKind.RECOVER_IN_PROCESS))
        if action.spends_restart:  # what the run spends, counted from the decision alone
            self.restarts += 1
            if action.consumes_user_error_restart:
                self._user_error_restarts += 1
            else:
                self._remaining_restarts -= 1
        return action

    def _decide_change(self, facts: ChangeFacts) -> Action:
        """The policy's answer to a change of membership, logged and in the event log."""
        action = decide_change(facts)
        logger.warning("decision: %s (%s)", action.kind.value, action.reason)
        self.events.emit("membership", change=facts.change, action=action.kind.value,
                         reason=action.reason, attempt=self._attempt)
        return action

    def _join(self, waiting: int) -> None:
        """Nodes wait to join: a regroup in process with them, or a restart, as decided."""
        why_not = self.in_process.growth_blocker()
        action = self._decide_change(ChangeFacts("join", f"{waiting} node(s) waiting",
                                                 why_not is None, why_not or ""))
        cause = action.reason
        if action.kind is ActionKind.REGROUP_IN_PROCESS:
            if (failed := self.in_process.grow(cause)) is None:
                return
            cause = f"{cause}; the growth in process failed: {failed}"
        self._restart(cause=cause, counted=False)

    def _absorb_leavers(self, exited: dict[int, ProcessFailure]) -> bool:
        """Leavers of a forming recovery replaced as decided (False: a failure, to decide)."""
        facts = self.in_process.leavers(exited)
        if facts is None:
            return False
        return (self._decide_change(facts).kind is ActionKind.REGROUP_IN_PROCESS
                and self.in_process.replace_leavers(exited))

    def _classify(self, run_result: RunResult) -> tuple[FailureRecord, ...]:
        stderrs = dict(self._pcontext.stderrs) if self._pcontext is not None else {}
        by_rank = {w.global_rank: w for w in self._worker_group.workers}
        records = {}
        for rank, failure in sorted(run_result.failures.items()):
            local_rank = failure.local_rank if rank not in by_rank else by_rank[rank].local_rank
            records[rank] = classify_exit(rank, local_rank, failure.pid, failure.exitcode,
                                          error_file=failure.error_file,
                                          stderr_file=stderrs.get(local_rank))
        if any(r.failure_class is not FailureClass.STOP_REQUESTED for r in records.values()):
            # The others are stopped (or were, by torch's poll) because these failed; one may
            # have been leaving on an exception of its own that its peers reported first.
            for worker in self._worker_group.workers:
                record = records.get(worker.global_rank)
                if record is not None and record.failure_class is not \
                        FailureClass.STOP_REQUESTED:
                    continue
                own = own_exception_at_exit(
                    worker.global_rank, worker.local_rank,
                    worker.id if record is None else record.pid,
                    1 if record is None else record.exitcode, stderrs.get(worker.local_rank),
                    seen_at=self._seen_at)
                if own is not None:
                    records[worker.global_rank] = own
        return without_collateral(tuple(records[rank] for rank in sorted(records)))

    def _wait_before_restart(self, action: Action) -> None:
        """The policy's wait before a restart (a communication fault that repeated before the
        first step), logged and recorded as a ``backoff`` event."""
        if action.wait_s <= 0:
            return
        logger.warning("waiting %.2f s before restart %d: the same communication fault before "
                       "the first step %d times in a row; its cause may need time to clear",
                       action.wait_s, self.restarts, self._comm_repeats + 1)
        self.events.emit("backoff", attempt=self._attempt, wait_s=round(action.wait_s, 3),
                         repeats=self._comm_repeats, reason=action.reason)
        time.sleep(action.wait_s)

    def _restart(self, cause: str, counted: bool = True, in_round: bool = False) -> None:
        """The one restart path: its event and the ``before_restart`` hooks (where the healthy
        workers take their checkpoint), then the workers stopped and started again, after a new
        rendezvous round (``in_round``: in the round just joined)."""
        self._attempt += 1
        self._in_process_failed_at = None  # every worker starts again
        if not counted:  # the attempts around a membership change are not "in a row"
            self._previous_failure = None
        self.events.emit("restart", attempt=self._attempt, cause=cause, counted=counted)
        group = self.group_info()
        self._each_collaborator("before_restart", lambda c: c.before_restart(group, cause, counted))
        if not in_round:
            self._restart_workers(self._worker_group)
            return
        self._stop_workers(self._worker_group)
        for local_rank, pid in self._start_workers(self._worker_group).items():
            self._worker_group.workers[local_rank].id = pid
        self._worker_group.state = WorkerState.HEALTHY

    def _agent_side(self) -> AgentSide:
        """What in-process recovery reads and asks of this agent."""

        def next_attempt() -> int:
            self._attempt += 1
            return self._attempt

        def workers_changed() -> None:
            self._hook_survivor_stop()
            group = self.group_info()
            self._each_collaborator("on_workers_started", lambda c: c.on_workers_started(group))

        def round_env(local_rank: int) -> dict[str, str]:
            wg = self._worker_group
            worker = wg.workers[local_rank]
            env = {"RANK": str(worker.global_rank), "WORLD_SIZE": str(worker.world_size),
                   "ROLE_RANK": str(worker.role_rank),
                   "ROLE_WORLD_SIZE": str(worker.role_world_size),
                   "GROUP_RANK": str(wg.group_rank), "GROUP_WORLD_SIZE": str(wg.group_world_size),
                   ROUND_ENV: str(self._round)}
            group = self.group_info()
            info = next(w for w in group.workers if w.local_rank == local_rank)
            for extra in self._each_collaborator("worker_env",
                                                 lambda c: c.worker_env(group, info)):
                env.update(extra or {})
            return env

        return AgentSide(
            round_env=round_env,
            context=lambda: self._pcontext, worker_group=lambda: self._worker_group,
            workers=ContextWorkers(lambda: self._pcontext, lambda: self._worker_group,
                                   lambda: self.warm_pool),
            attempt=lambda: self._attempt,
            next_attempt=next_attempt, round=lambda: self._round,
            group_info=self.group_info, rendezvous=lambda: self._rendezvous(self._worker_group),
            restart_in_round=lambda cause: self._restart(cause, counted=False, in_round=True),
            workers_changed=workers_changed)

    def _failed_result(self, run_result: RunResult) -> RunResult:
        """A FAILED result with at least one ProcessFailure, so callers never see success.

        torch's own agent returns UNHEALTHY with no failures when a health check fails with no
        restarts left, and its launcher then exits 0.
        """
        failures = dict(run_result.failures)
        if not failures:
            for record in self.failures[-len(self._worker_group.workers):] or ():
                failures[record.rank] = ProcessFailure(
                    local_rank=max(record.local_rank, 0), pid=record.pid,
                    exitcode=record.exitcode or 1, error_file="")
        return RunResult(state=WorkerState.FAILED, failures=failures)

