"""The recovery orchestrator: one agent collaborator that ties detection, checkpoints and
membership into hierarchical recovery.

When a worker fails or diagnostics report a hang, the agent calls, in order, every
collaborator's ``on_failure``, then ``failure_facts``, then the pure policy
(:func:`elasticft.addon.policy.decide`), then ``on_decision``. The orchestrator sits before the
checkpoint service, so on a failure and its decision it

1. **counts the offence** against this node when its own rank caused it
   (:func:`~elasticft.addon.policy.is_node_offence`: a crash by signal, a hang this node's
   monitor localised, a rank that stayed slow, a device error);
2. hands the policy its facts: offences, the repeat-offender limit, whether the job can go on
   without this node (``can_evict``: more nodes than ``--nnodes`` minimum, or a standby waits),
   whether replicas are intact and JIT is possible, whether this node's ranks caused it;
3. **takes the just-in-time checkpoint the decision chose** (:attr:`Action.checkpoint
   <elasticft.addon.policy.Action.checkpoint>`: every data-parallel shard still has a healthy
   replica, :func:`~elasticft.addon.policy.replicas_intact`, one can be asked, and no survivor
   stays in process): through the checkpoint control channel (:mod:`elasticft.ckpt.control`),
   whose watcher thread answers while the worker's main thread waits in the broken collective,
   it completes the snapshot of the last completed step in shared memory; the checkpoint
   service's flush, released next, persists it. Otherwise the next attempt resumes from the
   newest complete snapshot (memory, peer, disk: the worker's loader picks the fastest);
4. on an eviction (suspect hardware: failed health check, repeat offender), **blacklists this
   node's machine with the evidence** (its host name for a per-process id) before the launcher
   lets it leave without closing the rendezvous; the remaining nodes and a standby
   re-rendezvous.

**Across nodes**, the healthy replicas are mostly on other nodes. The agent that meets the
failure broadcasts a JIT request for its round through the round's store (one key, written
once: ``compare_set``); every agent of the round watches that key in a background thread (a
blocking store wait, watch-based on etcd) and answers it by asking its own workers over the
control channel, then reports the step each node holds (``.../jit/done/<group rank>``). An
agent never stops its workers while its round's JIT checkpoint is still being taken, so the
next round restores the newest step held on every shard. One JIT checkpoint per node and
round: whichever of the failure, the broadcast or the membership change asks first takes it;
the others reuse its result.

Job-wide, the **leader** of each round (group rank 0) compares the round's nodes with the
previous round's: a node that is gone and whose membership lease ended (dead, or cut off
from the network) is quarantined in this job for ``recovery_quarantine_s``, with the evidence
(:func:`~elasticft.addon.policy.judge_departed`, :mod:`elasticft.rendezvous.quarantine`): that
says nothing about its machine, so it is not blacklisted. Every choice is logged with its reason and
written to the event log (``jit_checkpoint``, ``eviction``, ``recovery``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

from elasticft import procs
from elasticft.addon.api import (
    AddOn,
    AddOnContext,
    AgentCollaborator,
    Built,
    GroupInfo,
    run_ending_errors,
)
from elasticft.addon.classify import FailureRecord
from elasticft.addon.policy import (
    Action,
    ActionKind,
    CheckpointSource,
    DepartedNode,
    KnownFacts,
    is_node_offence,
    judge_departed,
    replicas_intact,
)
from elasticft.ckpt.control import request_checkpoint, watching_pid
from elasticft.ckpt.service import CheckpointAddOn, CheckpointService
from elasticft.config import RecoveryConfig
from elasticft.events import EventLog
from elasticft.recovery.roster import EtcdRoster, Roster
from elasticft.rendezvous.quarantine import machine_name
from elasticft.rendezvous.roundstore import (
    INTERRUPTIBLE_WAKE_S,
    JIT_DONE_KEY,
    JIT_REQUEST_KEY,
    KNOWN_ROUND_KEY,
    NODE_KEY,
    WATCH_WAKE_S,
    interrupter,
    own_connection,
    text,
    wait_key,
)

logger = logging.getLogger(__name__)

@dataclasses.dataclass
class _RoundJit:
    """The JIT checkpoint of one node in one round, taken at most once."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    step: int | None = None
    ranks: dict[int, int | None] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Failure:
    """What the orchestrator saw of a failure, until the decision chooses its checkpoint."""

    offending: set[int]
    """This node's ranks that caused it."""
    intact: bool
    healthy: list[Any]
    """This node's workers that can be asked for a just-in-time checkpoint."""
    control: Path | None
    remote: bool
    """The other nodes' replicas can be asked through the round's store."""
    what: str


@dataclasses.dataclass(eq=False)
class RecoveryOrchestrator(AgentCollaborator):
    """Just-in-time checkpoints, offence counting, eviction and blacklisting for one node."""

    config: RecoveryConfig
    _: dataclasses.KW_ONLY
    node_id: str
    min_nodes: int
    checkpoints: CheckpointService | None = None
    """The node's CheckpointService (its control directory and memory), if it runs."""
    roster: Roster | None = None
    layout: tuple[int, int, int] | None = None
    events: EventLog | None = None
    """The agent's event log; opened here (under ``event_dir``, else the run directory)
    only for an orchestrator built outside an agent, which then closes it too."""
    event_dir: Path | None = None

    def __post_init__(self) -> None:
        self.offences = 0
        self._owns_events = self.events is None
        self._group: GroupInfo | None = None
        self._round_nodes: dict[int, tuple[str, ...]] = {}
        self._facts: KnownFacts = {}
        self._failure: _Failure | None = None
        """What ``on_failure`` saw, for the checkpoint the decision then chooses."""
        self._threads: list[threading.Thread] = []
        self._jit_lock = threading.Lock()
        self._round_jit: dict[int, _RoundJit] = {}
        self._round_store: Any = None
        self._watch_stop = threading.Event()
        self._watcher: tuple[threading.Thread, Any] | None = None
        """The JIT watcher thread and its store's ``interrupt_waits`` (None: it has none)."""
        self._closing = threading.Event()
        self._started: GroupInfo | None = None
        """The group as of its workers' start (with their pids), for the JIT watcher."""

    # -- events -------------------------------------------------------------------------------

    def _emit(self, kind: str, **payload: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, **payload)

    # -- rounds and the leader's verdict on departed nodes -------------------------------------

    def on_rendezvous(self, group: GroupInfo, store: Any) -> None:
        self._group = group
        self.node_id = group.node_id  # the name the agent claimed (unique on its host)
        if self.events is None:
            self.events = EventLog(self.event_dir or group.run_dir, group.node_id)
        self._stop_jit_watcher()  # the previous round's
        self._round_store = store
        if store is None:
            return
        if group.group_world_size > 1:
            self._watch_stop = threading.Event()
            watch_store = own_connection(store)
            interrupt = interrupter(watch_store)
            wake_s = INTERRUPTIBLE_WAKE_S if interrupt is not None else WATCH_WAKE_S
            watcher = threading.Thread(target=self._watch_jit,
                                       args=(group, watch_store, self._watch_stop, wake_s),
                                       daemon=True, name="elasticft-recovery-jit-watch")
            self._watcher = (watcher, interrupt)
            watcher.start()
            self._threads.append(watcher)
        known = max((r for r in self._round_nodes if r < group.round), default=None)
        record = {} if known is None else {"round": known, "nodes": self._round_nodes[known]}
        try:
            store.set(KNOWN_ROUND_KEY.format(group.group_rank), json.dumps(record))
            store.set(NODE_KEY.format(group.group_rank), group.node_id)
        except run_ending_errors():
            raise
        except Exception as e:
            logger.warning("could not record this node in round %d: %s", group.round, e)
            return
        thread = threading.Thread(target=self._learn_round, args=(group, store), daemon=True,
                                  name="elasticft-recovery-round")
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def on_workers_started(self, group: GroupInfo) -> None:
        self._started = group

    def _learn_round(self, group: GroupInfo, store: Any) -> None:
        """Reads every node of the round; the leader then judges who left since the last.

        The last round is the newest earlier round any node of this one took part in, as the
        nodes report it: a standby that now leads saw no earlier round itself."""
        try:
            nodes = tuple(store.get(NODE_KEY.format(r)).decode()
                          for r in range(group.group_world_size))
            known = [json.loads(store.get(KNOWN_ROUND_KEY.format(r)))
                     for r in range(group.group_world_size)]
        except run_ending_errors():
            raise
        except Exception as e:
            logger.warning("could not read the nodes of round %d: %s", group.round, e)
            return
        self._round_nodes[group.round] = nodes
        known = [k for k in known if isinstance(k.get("round"), int) and k["round"] < group.round]
        if group.group_rank != 0 or not known:
            return
        previous = max(k["round"] for k in known)
        before = {str(n) for k in known if k["round"] == previous for n in k["nodes"]}
        gone = sorted(before - set(nodes))
        if gone:
            self._judge_departed(gone, previous, group)

    def _judge_departed(self, gone: list[str], previous: int, group: GroupInfo) -> None:
        roster = self.roster
        if roster is None or not self.config.recovery_blacklist:
            logger.warning("node(s) %s left after round %d (no blacklist with this "
                           "rendezvous backend)", ", ".join(gone), previous)
            return
        deadline = time.monotonic() + self.config.recovery_departed_grace_s
        departed: list[DepartedNode] = []
        for node in gone:
            # A lease outlives its agent by up to its TTL: wait that long before calling it gone.
            alive = True
            while True:
                try:
                    alive = roster.alive(node)
                    blacklisted = roster.is_blacklisted(node)
                except run_ending_errors():
                    raise
                except Exception as e:
                    logger.warning("membership of %s unknown: %s", node, e)
                    alive, blacklisted = True, False
                if not alive or time.monotonic() >= deadline:
                    break
                time.sleep(0.5)
            departed.append(DepartedNode(node, alive, blacklisted))
        quarantine_s = self.config.recovery_quarantine_s
        for eviction in judge_departed(departed, previous):
            logger.warning("leader %s quarantines node %s in this job for %.0f s: %s",
                           self.node_id, eviction.node_id, quarantine_s, eviction.reason)
            try:
                roster.quarantine(eviction.node_id, eviction.reason, previous,
                                      f"leader {self.node_id}, round {group.round}",
                                      quarantine_s)
            except run_ending_errors():
                raise
            except Exception as e:
                logger.error("could not quarantine node %s: %s", eviction.node_id, e)
                continue
            self._emit("eviction", evicted=eviction.node_id, reason=eviction.reason,
                       by="leader", round=group.round, blacklisted=False,
                       quarantined_s=quarantine_s)
        for node in departed:
            if node.alive or node.blacklisted:
                logger.info("node %s left after round %d but is %s; not quarantined",
                            node.node_id, previous,
                            "alive" if node.alive else "already blacklisted or quarantined")

    # -- failures -------------------------------------------------------------------------------

    def on_failure(self, group: GroupInfo, failures: tuple[FailureRecord, ...]) -> None:
        local = {w.global_rank for w in group.workers}
        offending = {f.rank for f in failures if f.rank in local and is_node_offence(f)}
        if offending:
            self.offences += 1
        world = group.workers[0].world_size if group.workers else 0
        intact = replicas_intact(world, offending, self.layout)
        healthy = [w for w in group.workers
                   if w.global_rank not in offending and procs.responsive(w.pid)]
        control = self._control_dir(group)
        uses_api = self._uses_api(group)
        # The other nodes' replicas can be asked through the round's store.
        remote = intact and uses_api and group.group_world_size > 1 and \
            self._round_store is not None
        self._facts = {
            "node_offences": self.offences,
            "repeat_offender_limit": self.config.recovery_repeat_offender,
            "replicas_intact": intact,
            "jit_available": control is not None and uses_api and (bool(healthy) or remote),
            "offending_here": bool(offending),
            "can_evict": self._can_evict(group),
        }
        self._failure = _Failure(offending, intact, healthy, control, remote,
                                 "; ".join(f.summary() for f in failures[:3]))

    def _recovery_checkpoint(self, group: GroupInfo, action: Action) -> None:
        """The checkpoint the decision chose (:attr:`Action.checkpoint`), taken now: a
        just-in-time checkpoint of this node's healthy replicas (and a request to the other
        nodes'), or none (the newest complete snapshot, with why)."""
        failure, self._failure = self._failure, None
        if failure is None:
            return
        offending = sorted(failure.offending)
        if action.kind is ActionKind.RECOVER_IN_PROCESS and not action.takes_jit:
            # The survivors stay and restore their newest snapshot themselves, after finishing
            # the copy in flight (Checkpointer.restore): nothing to ask them for (across nodes:
            # another node's failure, which this node's workers all survived).
            self._emit("recovery_checkpoint", source=CheckpointSource.SNAPSHOT.value,
                       reason="in-process recovery", offending_ranks=offending)
        elif action.takes_jit and failure.control is not None:
            asked = failure.remote and self._broadcast_jit(group, failure.what)
            if failure.healthy:
                self._shared_jit(group, failure.control, failure.healthy,
                                 f"on node {self.node_id}: {failure.what}")
            if asked:
                # While a local worker still exists (a hang: stopped or stuck), the replicas
                # elsewhere wait in the collective with it; stopping it would end that wait,
                # so the reports come first. After a crash they are collected on the side.
                if any(procs.exists(w.pid) for w in group.workers):
                    self._collect_jit_reports(group, self._round_store)
                else:
                    thread = threading.Thread(target=self._collect_jit_reports,
                                              args=(group, self._round_store), daemon=True,
                                              name="elasticft-recovery-jit-reports")
                    thread.start()
                    self._threads.append(thread)
        else:
            why = ("a shard lost every replica" if not failure.intact else
                   "no healthy worker on this node to ask" if not failure.healthy else
                   "the workers keep no elasticft snapshot" if failure.control is not None else
                   "no checkpoint service")
            if failure.control is not None and failure.intact and failure.healthy:
                logger.info("the script resumes from its own checkpoint, if it keeps one "
                            "(its workers keep no elasticft snapshot)")
            else:
                logger.info("resuming from the newest complete snapshot: %s", why)
            self._emit("recovery_checkpoint", source=action.checkpoint.value, reason=why,
                       offending_ranks=offending)

    def _uses_api(self, group: GroupInfo) -> bool:
        """Whether the workers snapshot through the Checkpointer (and so run the control thread
        that answers a JIT request); a plain script never does, and asking it would only wait."""
        try:
            return self.checkpoints.newest_common_step(group) is not None
        except run_ending_errors():
            raise
        except Exception:
            return False

    def _control_dir(self, group: GroupInfo) -> Path | None:
        service = self.checkpoints
        if service is None or not hasattr(service, "control_dir"):
            return None
        return service.control_dir(group)

    def _can_evict(self, group: GroupInfo) -> bool:
        if group.group_world_size > self.min_nodes:
            return True
        if self.roster is None:
            return False
        try:
            return self.roster.standbys() > 0
        except run_ending_errors():
            raise
        except Exception as e:
            logger.warning("standbys unknown: %s", e)
            return False

    def _shared_jit(self, group: GroupInfo, control: Path, healthy: list[Any], cause: str
                    ) -> _RoundJit:
        """This node's JIT checkpoint of ``group.round``: taken by the first caller, waited for
        and reused by the others (a failure, a peer's broadcast and a membership change can all
        ask in the same round)."""
        with self._jit_lock:
            record = self._round_jit.get(group.round)
            first = record is None
            if record is None:
                record = self._round_jit[group.round] = _RoundJit()
                for old in [r for r in self._round_jit if r < group.round - 1]:
                    del self._round_jit[old]
        if not first:
            record.done.wait(self.config.recovery_jit_timeout_s + 1.0)
            return record
        try:
            self._jit_checkpoint(group, control, healthy, cause, record)
        finally:
            record.done.set()
        return record

    def _jit_checkpoint(self, group: GroupInfo, control: Path, healthy: list[Any], cause: str,
                        record: _RoundJit) -> None:
        started = time.monotonic()
        # Only a worker whose watcher thread runs can answer; one still starting (importing
        # torch) cannot, and waiting for it would only delay the restart.
        healthy = [w for w in healthy if w.pid and watching_pid(control, w.local_rank) == w.pid]
        if not healthy:
            logger.info("no worker of this node can take a JIT checkpoint yet (%s)", cause)
            return
        reason = f"just-in-time checkpoint: {cause}"
        pids = {w.local_rank: w.pid for w in healthy}
        # A live worker answers within a poll interval; one that is already exiting (its
        # collective failed when another rank went) never does, and must not delay recovery.
        acks = request_checkpoint(control, list(pids), reason,
                                  self.config.recovery_jit_timeout_s,
                                  alive=lambda local_rank: procs.responsive(pids.get(local_rank)))
        steps = {w.global_rank: acks[w.local_rank].step for w in healthy
                 if w.local_rank in acks}
        seconds = time.monotonic() - started
        held = [s for s in steps.values() if s is not None]
        record.ranks = steps
        record.step = min(held) if held and len(held) == len(steps) else None
        logger.warning("just-in-time checkpoint from healthy rank(s) %s: step %s in %.2f s",
                       sorted(steps) or "none", max(held) if held else "none", seconds)
        self._emit("jit_checkpoint", ranks={str(r): s for r, s in steps.items()},
                   asked=[w.global_rank for w in healthy], step=max(held) if held else None,
                   seconds=round(seconds, 3), cause=cause[:300], round=group.round)

    def _node_jit(self, group: GroupInfo, cause: str) -> _RoundJit | None:
        """The JIT checkpoint of every live local worker (none: nobody to ask)."""
        control = self._control_dir(group)
        healthy = [w for w in group.workers if procs.responsive(w.pid)]
        if control is None or not healthy or not self._uses_api(group):
            return None
        return self._shared_jit(group, control, healthy, cause)

    # -- the JIT request across nodes ---------------------------------------------------------

    def _broadcast_jit(self, group: GroupInfo, cause: str) -> bool:
        """Asks every node of the round for its JIT checkpoint; True when this request is the
        round's (the first one wins), and so its reports are this node's to collect."""
        store = self._round_store
        request = json.dumps({"by": self.node_id, "group_rank": group.group_rank,
                              "cause": cause[:300], "round": group.round, "time": time.time()})
        try:
            held = store.compare_set(JIT_REQUEST_KEY, "", request)
        except run_ending_errors():
            raise
        except Exception as e:
            logger.warning("could not ask the other nodes for a JIT checkpoint: %s", e)
            return False
        if text(held) != request:
            logger.info("the other nodes were already asked for a JIT checkpoint this round")
            return False
        logger.warning("asked every node of round %d for a just-in-time checkpoint",
                       group.round)
        return True

    def _collect_jit_reports(self, group: GroupInfo, store: Any) -> None:
        started = time.monotonic()
        deadline = started + self.config.recovery_jit_timeout_s + 2.0
        reports: dict[str, Any] = {}
        for rank in range(group.group_world_size):
            if rank == group.group_rank:
                continue
            key = JIT_DONE_KEY.format(rank)
            try:
                found = wait_key(store, key, deadline, self._closing)
                reports[str(rank)] = json.loads(text(store.get(key))) if found else None
            except run_ending_errors():
                raise
            except Exception:
                reports[str(rank)] = None  # gone with the failure, or too slow
        steps = [r["step"] for r in reports.values() if r and r.get("step") is not None]
        logger.warning("JIT checkpoint reports of round %d: %s", group.round,
                       {k: (v or {}).get("step") for k, v in reports.items()})
        self._emit("jit_request", round=group.round, reports=reports,
                   newest_common_step=min(steps) if steps and len(steps) == len(reports)
                   else None, seconds=round(time.monotonic() - started, 3))

    def _stop_jit_watcher(self) -> None:
        self._watch_stop.set()
        if self._watcher is not None:
            thread, interrupt = self._watcher
            if interrupt is not None:
                interrupt(thread)
            self._watcher = None

    def _watch_jit(self, group: GroupInfo, store: Any, stop: threading.Event,
                   wake_s: float) -> None:
        """Waits (blocking on the store, ``wake_s`` at a time) for a JIT request of this round
        from another node; answers it with this node's JIT checkpoint and reports the step."""
        while not stop.is_set() and not self._closing.is_set():
            started = time.monotonic()
            try:
                store.wait([JIT_REQUEST_KEY], timedelta(seconds=wake_s))
                request = json.loads(text(store.get(JIT_REQUEST_KEY)))
            except Exception:
                if time.monotonic() - started < WATCH_WAKE_S / 2:
                    stop.wait(WATCH_WAKE_S)  # the store is unreachable: do not spin
                continue
            if stop.is_set() or self._closing.is_set():
                return
            if request.get("by") == self.node_id:
                return  # ours: on_failure takes this node's checkpoint
            started = self._started  # the round's group at rendezvous has no worker pids yet
            current = started if started is not None and started.round == group.round else group
            record = self._node_jit(current, f"requested by node {request.get('by')}: "
                                    f"{request.get('cause', '')}")
            report = {"node": self.node_id, "step": record.step if record else None,
                      "ranks": {str(r): s for r, s in (record.ranks if record else {}).items()}}
            try:
                store.set(JIT_DONE_KEY.format(group.group_rank), json.dumps(report))
            except run_ending_errors():
                raise
            except Exception as e:
                logger.warning("could not report this node's JIT checkpoint: %s", e)
            return

    def before_restart(self, group: GroupInfo, cause: str, counted: bool) -> None:
        """The workers are about to be stopped. A membership change stops healthy workers
        (another node failed or left): they are the healthy replicas, so they take the
        just-in-time checkpoint before they go; and a JIT checkpoint still being taken for a
        peer's request is finished first."""
        if counted:
            record = self._round_jit.get(group.round)
            if record is not None:
                record.done.wait(self.config.recovery_jit_timeout_s + 1.0)
            return  # a failure of this node: the decision already chose the checkpoint
        self._node_jit(group, cause)

    def failure_facts(self, group: GroupInfo, failures: tuple[FailureRecord, ...]
                      ) -> KnownFacts:
        return self._facts

    def on_decision(self, group: GroupInfo, action: Action) -> None:
        self._recovery_checkpoint(group, action)
        self._emit("recovery", action=action.kind.value, checkpoint=action.checkpoint.value,
                   reason=action.reason, offences=self.offences)
        if action.kind is not ActionKind.EVICT_NODE:
            return
        logger.warning("node %s evicts itself: %s", self.node_id, action.reason)
        blacklisted = False
        # Evidence about the machine: its name goes on the blacklist, never a per-process id.
        machine = machine_name(self.node_id, socket.gethostname())
        if self.roster is not None and self.config.recovery_blacklist:
            try:
                self.roster.blacklist(machine, action.reason,
                                          f"node {self.node_id} itself (pid {os.getpid()})")
                blacklisted = True
            except run_ending_errors():
                raise
            except Exception as e:
                logger.error("could not blacklist machine %s: %s", machine, e)
        self._emit("eviction", evicted=self.node_id, reason=action.reason, by="self",
                   round=group.round, blacklisted=blacklisted, machine=machine)

    def close(self) -> None:
        self._closing.set()
        self._stop_jit_watcher()
        for thread in self._threads:
            thread.join(timeout=2 * WATCH_WAKE_S + 1)
        close = getattr(self.roster, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()
        if self.events is not None and self._owns_events:
            self.events.close()


class RecoveryAddOn(AddOn[RecoveryOrchestrator]):
    """Recovery as an add-on of the agent (:class:`elasticft.addon.api.AddOn`). It needs the
    checkpoint service (the just-in-time checkpoint goes through its control directory), and
    its hooks run before the service's: the service flushes the checkpoint recovery asked for.
    """

    name: ClassVar[str] = "recovery"
    needs: ClassVar[tuple[str | type[AddOn[Any]], ...]] = (CheckpointAddOn,)
    runs_before: ClassVar[tuple[str, ...]] = (CheckpointAddOn.name,)

    def build(self, context: AddOnContext, built: Built) -> RecoveryOrchestrator | None:
        options = context.options
        if not options.recovery.recovery_enabled:
            return None
        import socket

        checkpoints = built.of(CheckpointAddOn)
        layout = options.plan.layout.complete() if options.plan.layout else None
        return RecoveryOrchestrator(
            options.recovery,
            node_id=options.agent.node_id or socket.gethostname(),
            min_nodes=int(context.launch.min_nodes or 1),
            checkpoints=checkpoints,
            roster=EtcdRoster.from_launch_config(context.launch),
            layout=layout,
            events=context.events,
            event_dir=options.agent.event_dir,
        )
