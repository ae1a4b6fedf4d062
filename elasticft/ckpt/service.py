"""The agent's checkpoint service: one node's memory tier, persisted, replicated and flushed.

One :class:`CheckpointService` runs inside each node's agent (an ``AgentCollaborator``) and
joins the checkpoint engine's agent-side concepts to the agent's hooks:

* **Slots it owns** (:mod:`elasticft.ckpt.memory.nodeslots`): every local worker's shared-memory
slots,
  passed to the workers (``ELASTICFT_WORKER_CKPT_*``) and held for the job's life, so a worker
  that crashes loses nothing. Named segments that processes now gone left behind are removed by
  the launcher's one sweep of leftovers.
* **Persistence in the background** (:mod:`elasticft.ckpt.persisting.agentpersist`): every monitor
tick,
  a step due for persistence that every local worker holds is written to the local directory
  and the remote one on a background thread, DCP-readable, committed once every rank is
  durable, and backed up to a peer.
* **Peer backup.** In a multi-node job it runs a :class:`~elasticft.ckpt.backup.peer.PeerServer` on
the
  job's address, publishes its address in the rendezvous store, and pushes each persisted shard
  to its backup node. The leader of every round publishes the round's secret
  (``CheckpointConfig.ckpt_peer_secret`` through the Python API, else a fresh random one per
  round) and every node adopts it, so all nodes of a round agree even when a new node becomes
  the leader, and a node that left cannot fetch shards any more. The server also serves the
  data-parallel replicas this node holds in memory (:mod:`elasticft.ckpt.backup.replicas`). Under a
  (tp, pp, dp) layout the backup node is outside the node's parallel groups and holds no
  replica, so workers are also given a replica's node
  (:func:`~elasticft.ckpt.backup.peer.replica_node`) and ask it first.
* **Flush on failure** (:mod:`elasticft.ckpt.persisting.flush`): the newest snapshot every local
worker
  completed goes to disk on a thread of its own, after the decision and, for a restart in
  place, after the restarted workers' restore and first step.
* **Checkpoint now.** :meth:`checkpoint_now` (used by the Slurm handler and recovery) asks the
  workers' control threads for their newest snapshot, waits for the acks and persists it.
* **Silent data corruption** (:mod:`elasticft.ckpt.integrity.sdcwatch`): every
  ``ckpt_fingerprint_every``-th step, the workers' snapshots are fingerprinted and the
  data-parallel replicas compared; a diverging rank is an ``sdc_suspect`` event. Under
  ``ckpt_sdc_action`` evict the service hands the workers the restore limit the verdict set
  (:data:`~elasticft.ckpt.settings.ENV_RESTORE_AT_MOST`), agrees on it with the nodes of each
  new round, rejects the persisted steps after it in the node's local directory, the remote
  directory and its peer store (:mod:`elasticft.ckpt.persisting.rejected`), and tells the
  policy why its node is suspect (``suspect_evidence``). Its node's health
  (:mod:`elasticft.ckpt.integrity.nodehealth`) goes with its fingerprints.
* **What each attempt resumed from**: one log line and a ``restore`` event; every save a
  worker could not take is a ``snapshot_skipped`` event. Events go to the agent's one event
  log (``AddOnContext.events``). Where checkpoints persist:
  :mod:`elasticft.ckpt.persisting.places`. Under ``--fresh`` the workers first remove what earlier
  launches left there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from elasticft.addon.api import (
    AddOnContext,
    AgentCollaborator,
    Detection,
    GroupInfo,
    WorkerInfo,
    run_ending_errors,
)
from elasticft.addon.classify import FailureRecord
from elasticft.addon.policy import Action, ActionKind, KnownFacts
from elasticft.ckpt import settings
from elasticft.ckpt.api import CheckpointError
from elasticft.ckpt.backup.peer import (
    PeerClient,
    PeerServer,
    backup_node,
    bind_host,
    new_secret,
    replica_node,
)
from elasticft.ckpt.backup.replicas import Replicas
from elasticft.ckpt.control import (
    RestoreReader,
    SkipReader,
    request_checkpoint,
    restore_line,
)
from elasticft.ckpt.integrity.nodehealth import NodeHealth
from elasticft.ckpt.integrity.sdcwatch import LAG_ENV, FingerprintWatch, evidence_slots
from elasticft.ckpt.memory import shm
from elasticft.ckpt.memory.nodeslots import NodeSlots
from elasticft.ckpt.memory.shm import SlotSet
from elasticft.ckpt.persisting import durable
from elasticft.ckpt.persisting.agentpersist import COPY_DELAY_ENV, AgentPersister
from elasticft.ckpt.persisting.flush import FailureFlush
from elasticft.ckpt.persisting.places import NodePlaces
from elasticft.config import (
    CheckpointConfig,
    ConfigError,
    require_writable_dir,
)
from elasticft.events import EventLog

logger = logging.getLogger(__name__)

_SECRET_KEY = "elasticft/ckpt/secret"
_PEER_KEY = "elasticft/ckpt/peer/{}"
_SURVIVOR_COPY_GRACE_S = 2.0
"""How long a failure's survivors may finish a snapshot copy before torch stops them."""


class CheckpointService(AgentCollaborator):
    """Owns this node's memory tier; persists, replicates and flushes it."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        local_addr: str | None = None,
        shm_dir: Path = shm.SHM_DIR,
        events: EventLog | None = None,
        event_dir: Path | None = None,
        layout: tuple[int, int, int] | None = None,
        fresh: bool = False,
        copy_delay_s: float = 0.0,
        sdc_watch_lag: int = 0,
    ) -> None:
        self.config = config
        self.fresh_launch = f"{os.getpid()}-{time.time_ns()}" if fresh else None
        """``--fresh``: this launch's token (see :func:`durable.start_fresh`)."""
        self._restores = RestoreReader()
        self.layout = layout
        """The job's (tp, pp, dp) when fully given (--layout): backups then go to a node
        outside this node's parallel groups; None: to the next node in a ring."""
        self._local_addr = local_addr
        self._group: GroupInfo | None = None
        self.places = NodePlaces(config.ckpt_dir)
        self.slots = NodeSlots(config.ckpt_memory_slots + evidence_slots(config),
                               config.ckpt_memory_cap_mb << 20, shm_dir)
        self._secret = config.ckpt_peer_secret
        self._peer_server: PeerServer | None = None
        self._backup_addr: str | None = None
        self._holder_addr: str | None = None
        self._replica_addr: str | None = None
        self._events = events
        """The agent's event log; opened here (under ``event_dir``, else the run directory)
        only for a service built outside an agent, which then closes it too."""
        self._owns_events = events is None
        self._event_dir = event_dir
        self._events_lock = threading.Lock()  # the agent's thread and the persist threads
        self._skips = SkipReader()
        self.snapshots_skipped = 0
        self.persister = AgentPersister(config, self.slots, self.places, self._event,
                                        self._replicate, copy_delay_s=copy_delay_s)
        self._flush = FailureFlush(self.persister)
        self.replicas = Replicas(self.slots, layout, lambda: self._group,
                                 self.places.default_root)
        self.fingerprints = FingerprintWatch(self.slots, config.ckpt_fingerprint_every, layout,
                                             self._group_event, config.ckpt_sdc_action,
                                             lag_steps=sdc_watch_lag)
        self._rollback_counted = -1
        """The attempt (restart count) whose restore after a rollback was counted."""
        self._health: NodeHealth | None = None
        """This node's health, for a split between replicas on two nodes."""

    # ------------------------------------------------------------------------------------------
    # Where things are.

    def local_dir(self, group: GroupInfo) -> Path:
        """This node's shards (see :mod:`elasticft.ckpt.persisting.places`)."""
        return self.places.local_dir(group)

    def control_dir(self, group: GroupInfo) -> Path:
        return self.places.control_dir(group)

    def slot_set(self, group: GroupInfo, local_rank: int) -> SlotSet:
        """A local rank's slots (see :mod:`elasticft.ckpt.memory.nodeslots`)."""
        return self.slots.slot_set(local_rank)

    def newest_common_step(self, group: GroupInfo) -> int | None:
        """Newest step every local worker holds complete in shared memory (for its rank)."""
        return self.slots.newest_common_step(group.workers)

    # ------------------------------------------------------------------------------------------
    # Agent hooks.

    def _event(self, group: GroupInfo, kind: str, **payload: Any) -> None:
        with self._events_lock:
            if self._events is None:
                self._events = EventLog(self._event_dir or group.run_dir, group.node_id)
        self._events.emit(kind, **payload)

    def _event_directory(self) -> Path | None:
        """Where this agent's event log is (the node's health checks log there too)."""
        if self._events is not None:
            return self._events.directory
        group = self._group
        return self._event_dir or (group.run_dir if group is not None else None)

    def _group_event(self, kind: str, **payload: Any) -> None:
        if self._group is not None:
            self._event(self._group, kind, **payload)

    def on_rendezvous(self, group: GroupInfo, store: Any) -> None:
        self._group = group
        self.fingerprints.store = store
        if self._health is None or self._health.node != group.node_id:
            self._health = NodeHealth(group.node_id, self._event_directory)
            self.fingerprints.health = self._health
        if self.config.ckpt_sdc_action == "evict" and self.config.ckpt_fingerprint_every > 0:
            try:
                self._roll_back(group, store)
            except run_ending_errors():
                raise
            except Exception:
                logger.exception("could not agree on the restore limit of round %d",
                                 group.round)
        if not self.config.ckpt_peer_backup or group.group_world_size < 2 or store is None:
            return
        try:
            self._setup_peers(group, store)
        except run_ending_errors():
            raise
        except Exception:
            logger.exception("peer backup unavailable this round")
            self._backup_addr = self._holder_addr = self._replica_addr = None

    def _roll_back(self, group: GroupInfo, store: Any) -> None:
        """Every node of the round agrees on the restore limit of a rollback under way (a
        standby that joins learns it here), and every persisted step after it is rejected in
        each place this node keeps steps: its local directory, the remote directory and its
        peer store (:mod:`elasticft.ckpt.persisting.rejected`). They hold the corrupted state,
        and no later restore, in this job or a relaunch of the run, may find them."""
        watch = self.fingerprints
        # A persist of a corrupted step in flight ends first, and none starts: once the limit
        # is agreed (every node publishes after this), no node writes such a step any more.
        self._stop_persisting_corrupted()
        if store is not None and group.group_world_size > 1:
            watch.agree_limit(group, store)
            self._stop_persisting_corrupted()
        at_most = watch.restore_at_most
        if at_most is None:
            return
        newest = watch.newest_before
        reason = (f"silent data corruption after step {at_most}, the newest at which every "
                  f"fingerprint agreed")
        places: list[tuple[str, list[int]]] = []
        with self.persister.held():
            self.persister.forget_pending_after(at_most)
            roots = [self.local_dir(group)]
            if self.config.ckpt_remote_dir is not None:
                roots.append(Path(self.config.ckpt_remote_dir))
            for root in roots:
                places.append((str(root), durable.reject_after(root, at_most, reason)))
            if self._peer_server is not None:
                through = max(newest if newest is not None else at_most, at_most)
                places.append((f"{self._peer_server.root} (peer backups)",
                               self._peer_server.reject_after(at_most, through, reason)))
        for where, removed in places:
            if removed:
                logger.warning("rejected persisted step(s) %s of %s: after the last agreed "
                               "step %d", removed, where, at_most)
        self._event(group, "sdc_rejected", restore_at_most=at_most, newest_before=newest,
                    removed={where: removed for where, removed in places if removed})

    def _stop_persisting_corrupted(self, wait: bool = True) -> None:
        """The snapshots in memory up to the newest step held when a verdict came are the
        corrupted ones until the redone steps overwrite them: none of them is persisted (with
        ``wait``, a persist of one in flight ends before this returns)."""
        newest = self.fingerprints.newest_before
        if newest is None:
            return
        if newest > self.persister.persisted:
            self.persister.persisted = max(self.persister.persisted, newest)
        if wait:
            with self.persister.held():
                pass

    def _setup_peers(self, group: GroupInfo, store: Any) -> None:
        if group.group_rank == 0:
            # A fresh secret every round (the store is the round's): a new leader never keeps
            # a secret of its own that the others do not know, and a node that left the job
            # (evicted, cut off) cannot authenticate any more.
            self._secret = self.config.ckpt_peer_secret or new_secret()
            store.set(_SECRET_KEY, self._secret)
        else:
            self._secret = store.get(_SECRET_KEY).decode()
        if self._peer_server is not None:
            self._peer_server.set_secret(self._secret)
        else:
            host = bind_host(self.config.ckpt_peer_addr, [self._local_addr or "", _host_ip()])
            peer_root = self.places.default_root(group) / "peer-backups" / \
                f"node-{group.node_id}"
            self._peer_server = PeerServer(peer_root, self._secret, host,
                                           keep=self.config.ckpt_keep, replicas=self.replicas)
        store.set(_PEER_KEY.format(group.group_rank), self._peer_server.address)
        nproc = len(group.workers)
        target = backup_node(group.group_rank, group.group_world_size, nproc, self.layout)
        self._backup_addr = store.get(_PEER_KEY.format(target)).decode() \
            if target is not None else None
        # Workers fetch this node's backup from the node that holds it.
        self._holder_addr = self._backup_addr
        logger.info("checkpoint backups of node %s go to node rank %s (%s)", group.node_id,
                    target, self._backup_addr)
        # Under a (tp, pp, dp) layout the backup node holds none of these shards in memory; a
        # replacement node asks a data-parallel replica's node first, for the newest step.
        replica = replica_node(group.group_rank, group.group_world_size, nproc, self.layout)
        self._replica_addr = store.get(_PEER_KEY.format(replica)).decode() \
            if replica is not None and replica != target else None

    def worker_env(self, group: GroupInfo, worker: WorkerInfo) -> Mapping[str, str]:
        slots = self.slot_set(group, worker.local_rank)
        control = self.control_dir(group)
        control.mkdir(parents=True, exist_ok=True, mode=0o700)
        cap = self.config.ckpt_memory_cap_mb * (1 << 20)
        env = {
            settings.ENV_SHM: slots.where,
            settings.ENV_SLOTS: str(slots.count),
            settings.ENV_MEMORY_CAP: str(cap),
            settings.ENV_LOCAL: str(self.local_dir(group)),
            settings.ENV_CONTROL: str(control),
            settings.ENV_GPU_STAGING: str(self.config.ckpt_gpu_staging_mb * (1 << 20)),
        }
        if self.places.node_dir(group):
            env[settings.ENV_NODE_DIR] = self.places.node_dir(group)
        if self.fresh_launch is not None:
            env[settings.ENV_FRESH] = self.fresh_launch
        if self.fingerprints.restore_at_most is not None:
            env[settings.ENV_RESTORE_AT_MOST] = str(self.fingerprints.restore_at_most)
        if self.config.ckpt_remote_dir is not None:
            env[settings.ENV_REMOTE] = str(self.config.ckpt_remote_dir)
        if self._holder_addr and self._secret:
            env[settings.ENV_PEER] = self._holder_addr
            env[settings.ENV_SECRET] = self._secret
        if self._replica_addr and self._secret:
            env[settings.ENV_REPLICA_PEER] = self._replica_addr
        if self._peer_server is not None and self._secret:
            env[settings.ENV_NODE_PEER] = self._peer_server.address
        return env

    def on_workers_started(self, group: GroupInfo) -> None:
        self._group = group
        self.fingerprints.restarted(group, time.time())

    def on_workers_stopped(self, group: GroupInfo) -> None:
        self.fingerprints.stopped(self.newest_common_step(group))

    def failure_facts(self, group: GroupInfo, failures: tuple[FailureRecord, ...]
                      ) -> KnownFacts:
        reason = self.fingerprints.suspect_reason
        return {"suspect_evidence": reason} if reason else {}

    def check(self, group: GroupInfo) -> Detection | None:
        self._group = group
        self._count_skips(group)
        self._log_restores(group)
        self._flush.release_when_resumed(self.control_dir(group),
                                         [w.local_rank for w in group.workers],
                                         lambda: self.newest_common_step(group))
        self.persister.tick(group)
        self.fingerprints.tick(group)
        found = self.fingerprints.detection()
        if found is not None:
            self._stop_persisting_corrupted(wait=False)
        return found

    def _log_restores(self, group: GroupInfo) -> None:
        """One line (and a ``restore`` event) per attempt: what local rank 0 resumed from."""
        if not group.workers:
            return
        first = min(w.local_rank for w in group.workers)
        try:
            reports = self._restores.new_restores(self.control_dir(group), [first])
        except OSError:
            return
        if first in reports:
            report = reports[first]
            logger.info("run %s: %s", group.run_id, restore_line(report))
            self._event(group, "restore", step=report.get("step"),
                        source=report.get("source"), where=report.get("where"),
                        restart_count=group.restart_count)
            self._count_redone(group, report.get("step"))

    def _count_redone(self, group: GroupInfo, step: int | None) -> None:
        """After a rollback for silent data corruption, one ``sdc_recovered`` event (from the
        round's leader) with the steps the job redoes because of it."""
        at_most, newest = self.fingerprints.redone()
        self.fingerprints.settle()
        if at_most is None or self._rollback_counted == group.restart_count:
            return
        self._rollback_counted = group.restart_count
        restored = step if step is not None else 0
        redone = max(0, (newest if newest is not None else restored) - restored)
        logger.warning("silent data corruption: restored step %s (at most %d), redoing %d "
                       "step(s)", step, at_most, redone)
        if group.group_rank == 0:
            self._event(group, "sdc_recovered", step=step, restore_at_most=at_most,
                        newest_before=newest, steps_redone=redone)

    def _count_skips(self, group: GroupInfo) -> None:
        """Every save a worker could not take becomes a ``snapshot_skipped`` event."""
        try:
            skips = self._skips.new_skips(self.control_dir(group))
        except OSError:
            return
        for skip in skips:
            self.snapshots_skipped += 1
            self._event(group, "snapshot_skipped", **skip)

    def before_survivors_stopped(self, group: GroupInfo, failed_local_ranks: tuple[int, ...]
                                 ) -> None:
        """Lets the survivors' snapshot copies in flight complete before torch stops them.

        A survivor that had just called ``save`` would otherwise die with that step torn, and
        every rank would restart from the step before. A copy takes milliseconds; the wait is
        bounded (a stopped worker never finishes its copy).
        """
        survivors = [w.local_rank for w in group.workers
                     if w.local_rank not in failed_local_ranks]
        started = time.monotonic()
        writing = self.slots.wait_for_copies(survivors, _SURVIVOR_COPY_GRACE_S)
        if writing:
            logger.warning("snapshot copies of local ranks %s still in flight after %.1f s; "
                           "their workers are stopped anyway", writing, _SURVIVOR_COPY_GRACE_S)
            return
        waited = time.monotonic() - started
        if waited >= 0.005:
            logger.info("waited %.3f s for the survivors' snapshot copies in flight", waited)

    def on_failure(self, group: GroupInfo, failures: tuple[FailureRecord, ...]) -> None:
        """Readies the flush of the newest complete snapshot and returns at once (see
        :mod:`elasticft.ckpt.persisting.flush`)."""
        self._count_skips(group)
        self._ready_flush(group)

    def _ready_flush(self, group: GroupInfo) -> None:
        if not self.config.ckpt_flush_on_failure or \
                self.fingerprints.restore_at_most is not None:
            return  # the newest steps are after the corruption: nothing worth a flush
        step = self.newest_common_step(group)  # headers only: microseconds
        if step is None or step <= self.persister.persisted:
            return
        if self._flush.waiting():
            self._flush.newer(step)
        else:
            self._flush.start(step, group)

    def on_decision(self, group: GroupInfo, action: Action) -> None:
        if action.takes_jit:  # taken by the recovery orchestrator's on_decision, just before
            self._ready_flush(group)
        restarting = action.kind in (ActionKind.RESTART_IN_PLACE, ActionKind.RECOVER_IN_PROCESS)
        if restarting and self._flush.waiting():
            # The restarted workers restore from memory and take a step first; the flush follows.
            self._flush.defer(self.control_dir(group), (w.local_rank for w in group.workers))
            return
        self._flush.wait()  # the node may not come back: the disk copy comes first

    def checkpoint_now(self, reason: str, timeout: float) -> bool:
        """Asks the workers for their newest snapshot and persists it; True once durable."""
        group = self._group
        if group is None:
            return False
        deadline = time.monotonic() + timeout
        local_ranks = [w.local_rank for w in group.workers]
        acks = request_checkpoint(self.control_dir(group), local_ranks, reason, timeout / 2)
        if len(acks) < len(local_ranks):
            logger.warning("checkpoint now (%s): %d of %d workers answered; persisting the "
                           "newest complete snapshot anyway", reason, len(acks), len(local_ranks))
        step = self.newest_common_step(group)
        if step is None:
            return False
        while self.persister.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.persister.persist(step, group, cause=f"request: {reason}")

    def on_workers_succeeded(self, group: GroupInfo) -> None:
        # The final state goes to disk and to the backup node now: after the exit barrier the
        # other nodes' peer servers may already be gone.
        self._persist_final(group)

    def _persist_final(self, group: GroupInfo) -> None:
        self._count_skips(group)
        self._log_restores(group)
        self._flush.wait()
        self._stop_persisting_corrupted(wait=False)
        step = self.newest_common_step(group)
        if step is not None and step > self.persister.persisted:
            self.persister.persist(step, group, cause="final")  # before its memory goes away

    def _replicate(self, step: int, group: GroupInfo) -> None:
        """Pushes this node's shards of a persisted step to its backup node."""
        if not self._backup_addr or not self._secret:
            return
        client = PeerClient(self._backup_addr, self._secret)
        directory = durable.step_dir(self.local_dir(group), step)
        try:
            for worker in group.workers:
                client.put_from_dir(directory, worker.global_rank)
        except (OSError, CheckpointError) as e:
            logger.warning("peer backup of step %d to %s failed: %s", step, self._backup_addr, e)

    def close(self) -> None:
        group = self._group
        self._flush.wait()
        self.fingerprints.close(10.0)
        self.persister.close()
        if group is not None:
            self._persist_final(group)
            self.persister.drain_remote(30.0)  # other nodes' final shards may still land
        self.slots.close()
        if self._peer_server is not None:
            self._peer_server.close()
        if group is not None:  # this agent's own channel; a relaunch makes its own
            control = self.control_dir(group)
            shutil.rmtree(control, ignore_errors=True)
            with contextlib.suppress(OSError):
                control.parent.rmdir()  # unless another agent of the run still uses it
        if self._events is not None and self._owns_events:
            self._events.close()


def _host_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class CheckpointAddOn:
    """The checkpoint service as an add-on of the agent (:class:`elasticft.addon.api.AddOn`)."""

    name: ClassVar[str] = "ckpt"
    needs: ClassVar[tuple[str, ...]] = ()
    runs_before: ClassVar[tuple[str, ...]] = ()

    def build(self, context: AddOnContext, built: Mapping[str, AgentCollaborator | None]
              ) -> CheckpointService | None:
        options = context.options
        if not options.ckpt.ckpt_enabled:
            return None
        for flag, directory in (("--ckpt-dir", options.ckpt.ckpt_dir),
                                ("--ckpt-remote-dir", options.ckpt.ckpt_remote_dir)):
            if directory is not None:
                require_writable_dir(flag, Path(directory))
        ckpt = options.ckpt
        if ckpt.ckpt_sdc_action == "evict" and (ckpt.ckpt_fingerprint_every <= 0
                                                or ckpt.ckpt_memory_slots < 3):
            raise ConfigError(
                "--ckpt-sdc-action evict acts on the fingerprints' findings and keeps the last "
                "agreed step in a memory slot of its own: give --ckpt-fingerprint-every N "
                f"(now {ckpt.ckpt_fingerprint_every}) and at least 3 memory slots (now "
                f"{ckpt.ckpt_memory_slots})", reason="sdc_action")
        remote = options.ckpt.ckpt_remote_dir
        if options.agent.fresh and remote is not None and durable.committed_steps(Path(remote)):
            # Shared by every node, and by a node that joins later: never removed by one.
            raise ConfigError(f"--fresh: --ckpt-remote-dir {remote} holds checkpoints of earlier "
                              "launches, which a restore would use; give a new remote directory "
                              "or remove them", reason="fresh_remote")
        layout = options.plan.layout.complete() if options.plan.layout is not None else None
        return CheckpointService(options.ckpt, local_addr=context.launch.local_addr,
                                 events=context.events, event_dir=options.agent.event_dir,
                                 layout=layout, fresh=options.agent.fresh,
                                 copy_delay_s=float(context.env.get(COPY_DELAY_ENV) or 0),
                                 sdc_watch_lag=int(context.env.get(LAG_ENV) or 0))
