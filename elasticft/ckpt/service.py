"""The agent's checkpoint service: owns the memory tier, persists and replicates it.

One :class:`CheckpointService` runs inside each node's agent (an ``AgentCollaborator``):

* **Memory it owns.** It creates every local worker's shared-memory slots as files with no
  name (:mod:`elasticft.unnamed`), empty until the worker sizes them (see
  :mod:`elasticft.ckpt.shm`), and passes their ``/proc/<agent pid>/fd/<n>`` paths to the
  workers (``ELASTICFT_WORKER_CKPT_*``). A worker that crashes loses nothing: the agent holds the
  files. When the agent exits, however it exits, the kernel frees them: nothing is left to
  sweep (named segments that older versions left are swept at start).
* **Persistence in the background.** Every monitor tick it peeks at the slot headers; when all
  local workers hold a complete snapshot of a step due for persistence (``ckpt_persist_every``),
  a background thread writes it to the local directory and the remote one, DCP-readable, with
  checksums and a commit marker once every rank is durable (:mod:`elasticft.ckpt.durable`), then
  keeps the newest ``ckpt_keep``.
* **Peer backup.** In a multi-node job it runs a :class:`~elasticft.ckpt.peer.PeerServer` on the
  job's address, publishes its address in the rendezvous store, and pushes each persisted shard
  to its backup node. The leader of every round publishes the round's secret
  (``CheckpointConfig.ckpt_peer_secret`` through the Python API, else a fresh random one per
  round) and every node adopts it, so all
  nodes of a round agree even when a new node becomes the leader, and a node that left cannot
  fetch shards any more. The server also answers for ranks this node holds a data-parallel
  replica of (:meth:`replica_shard`), so a replacement node restores the newest step. Under a
  (tp, pp, dp) layout the backup node is outside the node's parallel groups and holds no
  replica, so workers are also given a replica's node (:func:`~elasticft.ckpt.peer.replica_node`)
  and ask it first.
* **Flush on failure.** When a worker fails it writes the newest snapshot every local worker
  completed to disk on a thread of its own: ``on_failure`` returns at once, so the policy
  decides without waiting for gigabytes to be written. Any decision but a restart in place
  (evict, stop) starts the write at once and waits for it, so a node that does not come back
  still left it on disk. A restart in place resumes from memory, and the flush waits until
  the restarted workers have restored and finished their first optimizer step (they say so
  through the control directory), have saved a newer step, or :data:`FLUSH_DEFER_MAX_S`
  passed: writing gigabytes to disk beside a restore of the same gigabytes made the restore
  2-3x slower on two cores, and beside the first step made that step 3.6x slower. The flush never
  holds a slot the restarted workers need: with three usable slots (the default) it writes
  the snapshot straight from its slot, whose shared lock the restore shares and whose
  neighbours take the new saves; with two it copies the snapshot out first (into a reused
  staging buffer, with the GIL released) and holds the lock for that copy only. Every persist
  is a ``checkpoint`` event.
* **Checkpoint now.** :meth:`checkpoint_now` (used by the Slurm handler and recovery) asks the
  workers' control threads for their newest snapshot, waits for the acks and persists it.
* **The job's directory.** Checkpoints persist in the directory the script chose
  (``Checkpointer.from_env(ckpt_dir=...)``, announced by its workers before their first save),
  else ``--ckpt-dir``, else ``<run-dir>/ckpt``; a relaunch restores from there, and the service
  logs one line saying what each attempt resumed from (a ``restore`` event). Under ``--fresh``
  the workers first remove what earlier launches left there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from elasticft import unnamed
from elasticft.agent.api import (
    AddOnContext,
    AgentCollaborator,
    GroupInfo,
    WorkerInfo,
    run_ending_errors,
)
from elasticft.agent.classify import FailureRecord
from elasticft.agent.policy import Action, ActionKind
from elasticft.ckpt import diskfile, durable, settings, shm
from elasticft.ckpt.api import CheckpointError, Snapshot, StorageFull
from elasticft.ckpt.control import (
    RestoreReader,
    SkipReader,
    all_loaded,
    announced_dirs,
    clear_loaded,
    request_checkpoint,
    restore_line,
)
from elasticft.ckpt.peer import (
    PeerClient,
    PeerServer,
    backup_node,
    bind_host,
    new_secret,
    replica_node,
)
from elasticft.config import (
    CheckpointConfig,
    ConfigError,
    checkpoint_dir_default,
    require_writable_dir,
)
from elasticft.events import EventLog

logger = logging.getLogger(__name__)

_SECRET_KEY = "elasticft/ckpt/secret"
_PEER_KEY = "elasticft/ckpt/peer/{}"
_SURVIVOR_COPY_GRACE_S = 2.0
"""How long a failure's survivors may finish a snapshot copy before torch stops them."""
FLUSH_DEFER_MAX_S = 30.0
"""The longest a restart in place defers its flush while the restarted workers restore (a
script that never calls ``restore`` nor saves again leaves no other sign)."""
COPY_DELAY_ENV = "EFT_TEST_CKPT_COPY_DELAY_S"
"""Test seam: seconds a persist holds the slots it reads, as a copy or a disk write of many
gigabytes would: added to every copy out of a slot (two slots), or once all of a step's slots
are held for a write straight from them (three). Tests make the persister slow with a small
state this way.
Not an ``ELASTICFT_`` name: those are options, and an unknown one is refused."""


class CheckpointService(AgentCollaborator):
    """Owns this node's memory tier; persists, replicates and flushes it."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        local_addr: str | None = None,
        shm_dir: Path = shm.SHM_DIR,
        event_dir: Path | None = None,
        layout: tuple[int, int, int] | None = None,
        fresh: bool = False,
    ) -> None:
        self.config = config
        self.fresh_launch = f"{os.getpid()}-{time.time_ns()}" if fresh else None
        """``--fresh``: this launch's token (see :func:`durable.start_fresh`)."""
        self._chosen_dir: Path | None = None
        self._restores = RestoreReader()
        self.layout = layout
        """The job's (tp, pp, dp) when fully given (--layout): backups then go to a node
        outside this node's parallel groups; None: to the next node in a ring."""
        self._local_addr = local_addr
        self._shm_dir = shm_dir
        self._owner = os.getpid()
        self._group: GroupInfo | None = None
        self._slots: dict[int, shm.SlotSet] = {}
        self._slot_fds: dict[int, list[int]] = {}
        self._persist_lock = threading.Lock()
        self._persisted = -1
        self._jobs: queue.Queue[int | None] = queue.Queue()
        self._busy = threading.Event()
        self._storage_full_reported = False
        self._staging: dict[int, shm.StagingBuffer] = {}
        """Per local rank: every worker's snapshot is copied out before any is written, since
        a worker overwrites its older slot within two steps, long before another rank's shard
        is on disk (one buffer for all made a node of several fast workers fail most
        persists)."""
        self._remote_pending: set[int] = set()
        self._last_remote_try = 0.0
        self._secret = config.ckpt_peer_secret
        self._peer_server: PeerServer | None = None
        self._backup_addr: str | None = None
        self._holder_addr: str | None = None
        self._replica_addr: str | None = None
        self._flusher: threading.Thread | None = None
        self._flush_go = threading.Event()
        """Set when the flush may write: at the decision, or once a restart in place has
        restored (see :meth:`_release_flush`)."""
        self._flush_go.set()
        self._flush_step: int | None = None
        self._flush_deferred_since: float | None = None
        self._event_dir = event_dir
        self._events: EventLog | None = None
        self._events_lock = threading.Lock()  # the agent's thread and the persist threads
        self._copy_delay_s = float(os.environ.get(COPY_DELAY_ENV) or 0)
        self._skips = SkipReader()
        self.snapshots_skipped = 0
        shm.sweep_orphans(shm_dir)
        self._thread = threading.Thread(target=self._persist_loop, name="elasticft-ckpt-persist",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------
    # Where things are.

    def local_dir(self, group: GroupInfo) -> Path:
        # Each node keeps its own shards on its own disk; a single node's directory is a
        # complete DCP checkpoint.
        return self.local_root(group) / self._node_dir(group)

    @staticmethod
    def _node_dir(group: GroupInfo) -> str:
        return "" if group.group_world_size <= 1 else f"node-{group.node_id}"

    def local_root(self, group: GroupInfo) -> Path:
        """The job's local checkpoint directory: the one the script chose, else --ckpt-dir,
        else ``<run-dir>/ckpt``."""
        try:
            chosen = announced_dirs(self.control_dir(group), (w.local_rank for w in group.workers))
        except OSError:
            chosen = {}
        if chosen:
            directory = chosen[min(chosen)]
            if directory != self._chosen_dir:
                self._chosen_dir = directory
                instead = checkpoint_dir_default(self.config.ckpt_dir, group.run_dir)
                logger.info("checkpoints persist in %s, the directory the script chose%s",
                            directory, "" if directory == instead.absolute()
                            else f" (not {instead})")
                if len(set(chosen.values())) > 1:
                    logger.warning("the local ranks chose different checkpoint directories "
                                   "(%s); local rank %d's is used", sorted(map(str, set(
                                       chosen.values()))), min(chosen))
        return self._chosen_dir or checkpoint_dir_default(self.config.ckpt_dir, group.run_dir)

    def control_dir(self, group: GroupInfo) -> Path:
        return group.run_dir / "ckpt-control" / str(self._owner)

    def slot_set(self, group: GroupInfo, local_rank: int) -> shm.SlotSet:
        """A local rank's slots: files with no name in the shared-memory directory, empty
        until its worker sizes them, held open here for the job's life (restarted workers
        find their snapshots in them) and freed by the kernel when the agent exits, however
        it exits."""
        slots = self._slots.get(local_rank)
        if slots is None:
            fds = self._slot_fds.setdefault(local_rank, [])
            while len(fds) < self.config.ckpt_memory_slots:
                fds.append(unnamed.anonymous_file(self._shm_dir))
            where = ",".join(str(unnamed.path_of(fd)) for fd in fds)
            slots = shm.SlotSet(where, len(fds), self._shm_dir)
            self._slots[local_rank] = slots
        return slots

    # ------------------------------------------------------------------------------------------
    # Agent hooks.

    def _event(self, group: GroupInfo, kind: str, **payload: Any) -> None:
        with self._events_lock:
            if self._events is None:
                self._events = EventLog(self._event_dir or group.run_dir, group.node_id)
        self._events.emit(kind, **payload)

    def on_rendezvous(self, group: GroupInfo, store: Any) -> None:
        self._group = group
        if not self.config.ckpt_peer_backup or group.group_world_size < 2 or store is None:
            return
        try:
            self._setup_peers(group, store)
        except run_ending_errors():
            raise
        except Exception:
            logger.exception("peer backup unavailable this round")
            self._backup_addr = self._holder_addr = self._replica_addr = None

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
            peer_root = checkpoint_dir_default(self.config.ckpt_dir, group.run_dir) / \
                "peer-backups" / f"node-{group.node_id}"
            self._peer_server = PeerServer(peer_root, self._secret, host,
                                           keep=self.config.ckpt_keep, replicas=self)
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
        if self._node_dir(group):
            env[settings.ENV_NODE_DIR] = self._node_dir(group)
        if self.fresh_launch is not None:
            env[settings.ENV_FRESH] = self.fresh_launch
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

    def check(self, group: GroupInfo) -> None:
        self._group = group
        self._count_skips(group)
        self._log_restores(group)
        self._flush_when_resumed(group)
        every = self.config.ckpt_persist_every
        if every <= 0 or self._busy.is_set():
            return None
        if self._remote_pending and time.monotonic() - self._last_remote_try > 1.0:
            self._last_remote_try = time.monotonic()
            self._busy.set()
            self._jobs.put(-1)  # a commit attempt, on the persister thread
            return None
        step = self.step_to_persist(group, every)
        if step is not None:
            self._busy.set()
            self._jobs.put(step)
        return None

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
            logger.info("%s", restore_line(report))
            self._event(group, "restore", step=report.get("step"),
                        source=report.get("source"), where=report.get("where"),
                        restart_count=group.restart_count)

    def _count_skips(self, group: GroupInfo) -> None:
        """Every save a worker could not take becomes a ``snapshot_skipped`` event."""
        try:
            skips = self._skips.new_skips(self.control_dir(group))
        except OSError:
            return
        for skip in skips:
            self.snapshots_skipped += 1
            self._event(group, "snapshot_skipped", **skip)

    def step_to_persist(self, group: GroupInfo, every: int) -> int | None:
        """The step due for persistence: a multiple of ``every`` every local worker holds
        (every node picks the same one, so the shared directory's commit completes); else the
        newest step once a multiple was passed unseen (steps faster than the monitor tick)."""
        steps = self.common_steps(group)
        if not steps:
            return None
        newest = max(steps)
        if newest <= self._persisted or newest // every <= max(self._persisted, 0) // every:
            return None
        multiples = [s for s in steps if s % every == 0 and s > self._persisted]
        return max(multiples) if multiples else newest

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
        while True:
            writing = [r for r in survivors if self.slot_set(group, r).writing()]
            if not writing:
                break
            if time.monotonic() - started >= _SURVIVOR_COPY_GRACE_S:
                logger.warning("snapshot copies of local ranks %s still in flight after %.1f s; "
                               "their workers are stopped anyway", writing,
                               _SURVIVOR_COPY_GRACE_S)
                return
            time.sleep(0.005)
        waited = time.monotonic() - started
        if waited >= 0.005:
            logger.info("waited %.3f s for the survivors' snapshot copies in flight", waited)

    def on_failure(self, group: GroupInfo, failures: tuple[FailureRecord, ...]) -> None:
        """Starts writing the newest complete snapshot to disk and returns at once.

        Nothing is copied here: the copy out of shared memory runs on the flush thread, so the
        decision (and a restart in place) never waits for it. The slots survive the crash,
        and the flush copies each out under its shared lock, for that one copy only.
        """
        self._count_skips(group)
        if not self.config.ckpt_flush_on_failure:
            return
        step = self.newest_common_step(group)  # headers only: microseconds
        if step is None or step <= self._persisted:
            return
        started = time.monotonic()
        previous = self._flusher
        self._flush_step = step
        self._flush_go.clear()  # until the decision says whether the restore comes first

        def flush() -> None:
            if previous is not None:
                previous.join()  # an earlier failure's flush; persists are serial anyway
            self._flush_go.wait()
            diskfile.background_priority()
            if self.persist(step, group, cause="flush"):
                logger.info("flushed the step %d snapshot to disk (%.2f s after the failure)",
                            self._persisted, time.monotonic() - started)

        self._flusher = threading.Thread(target=flush, name="elasticft-ckpt-flush", daemon=True)
        self._flusher.start()

    def on_decision(self, group: GroupInfo, action: Action) -> None:
        restarting = action.kind in (ActionKind.RESTART_IN_PLACE, ActionKind.RECOVER_IN_PROCESS)
        if restarting and self._flusher is not None and not self._flush_go.is_set():
            # The restarted workers restore from memory and take a step first; the flush follows.
            clear_loaded(self.control_dir(group), (w.local_rank for w in group.workers))
            self._flush_deferred_since = time.monotonic()
            logger.info("the flush of step %s waits for the restarted workers' restore and "
                        "first step (at most %.0f s)", self._flush_step, FLUSH_DEFER_MAX_S)
            return
        self._wait_flush()  # the node may not come back: the disk copy comes first

    def _flush_when_resumed(self, group: GroupInfo) -> None:
        """Lets a deferred flush start once the restarted workers are past their restore and
        their first step."""
        since = self._flush_deferred_since
        if since is None:
            return
        if all_loaded(self.control_dir(group), (w.local_rank for w in group.workers)):
            self._release_flush("the restarted workers took their first step")
            return
        newest = self.newest_common_step(group)
        if newest is not None and self._flush_step is not None and newest > self._flush_step:
            self._release_flush(f"the restarted workers saved step {newest}")
        elif time.monotonic() - since >= FLUSH_DEFER_MAX_S:
            self._release_flush(f"no first step seen in {FLUSH_DEFER_MAX_S:.0f} s")

    def _release_flush(self, why: str) -> None:
        if self._flush_deferred_since is not None:
            logger.info("the flush of step %s starts: %s (%.2f s after the decision)",
                        self._flush_step, why, time.monotonic() - self._flush_deferred_since)
            self._flush_deferred_since = None
        self._flush_go.set()

    def _wait_flush(self) -> None:
        self._release_flush("the run goes on elsewhere or ends")
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.join()

    def _copies(self, step: int, group: GroupInfo,
                held: contextlib.ExitStack) -> dict[int, Snapshot]:
        """Every local worker's snapshot of ``step`` (by global rank), readable until ``held``
        closes (call under ``_persist_lock``).

        Where the worker keeps three usable slots, the snapshot is read in place and its slot
        stays locked until then: the worker needs only the newest complete snapshot and one
        slot to write, so the slot being written to disk costs it nothing, and the write needs
        no second copy of gigabytes in the agent's memory (nor the copy's time). With two, the
        snapshot is copied out first, into the persister's staging buffer of that local rank,
        and the slot's lock is held for that copy only.
        """
        copies = {}
        in_place = False
        for worker in group.workers:
            slots = self.slot_set(group, worker.local_rank)
            for index, header in slots.complete().items():
                slot = slots.get(index) if header.step == step and \
                    header.rank == worker.global_rank else None
                if slot is None:
                    continue
                if self._usable_slots(slots, slot) >= 3:
                    snapshot = _hold(slot, step, held)
                    in_place = True
                else:
                    buffer = self._staging.setdefault(worker.local_rank, shm.StagingBuffer())
                    snapshot = _copy_out(slot, step, buffer, self._copy_delay_s)
                if snapshot is not None:
                    copies[worker.global_rank] = snapshot
                    break
            else:
                raise CheckpointError(
                    f"local rank {worker.local_rank} no longer holds step {step}", "missing")
        if in_place and self._copy_delay_s:
            time.sleep(self._copy_delay_s)
        return copies

    def _usable_slots(self, slots: shm.SlotSet, slot: shm.Slot) -> int:
        """How many slots of this size the worker may use (the memory cap may leave fewer)."""
        cap = self.config.ckpt_memory_cap_mb << 20
        return min(slots.count, cap // slot.size) if cap else slots.count

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
        while self._busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.persist(step, group, cause=f"request: {reason}")

    def on_workers_succeeded(self, group: GroupInfo) -> None:
        # The final state goes to disk and to the backup node now: after the exit barrier the
        # other nodes' peer servers may already be gone.
        self._persist_final(group)

    def _persist_final(self, group: GroupInfo) -> None:
        self._count_skips(group)
        self._log_restores(group)
        self._wait_flush()
        step = self.newest_common_step(group)
        if step is not None and step > self._persisted:
            self.persist(step, group, cause="final")  # before its memory goes away

    def close(self) -> None:
        group = self._group
        self._wait_flush()
        self._jobs.put(None)
        self._thread.join(timeout=600)
        if group is not None:
            self._persist_final(group)
            world = group.workers[0].world_size if group.workers else 0
            deadline = time.monotonic() + 30.0  # other nodes' final shards may still land
            while self._remote_pending and time.monotonic() < deadline:
                self._commit_remote(world)
                if self._remote_pending:
                    time.sleep(0.2)
        for slots in self._slots.values():
            slots.close()
        for fds in self._slot_fds.values():
            for fd in fds:
                os.close(fd)
        self._slot_fds.clear()
        if self._peer_server is not None:
            self._peer_server.close()
        if group is not None:  # this agent's own channel; a relaunch makes its own
            control = self.control_dir(group)
            shutil.rmtree(control, ignore_errors=True)
            with contextlib.suppress(OSError):
                control.parent.rmdir()  # unless another agent of the run still uses it
        if self._events is not None:
            self._events.close()

    # ------------------------------------------------------------------------------------------
    # Persisting.

    def common_steps(self, group: GroupInfo) -> set[int]:
        """Steps every local worker holds complete in shared memory (each for its rank)."""
        common: set[int] | None = None
        for worker in group.workers:
            slots = self.slot_set(group, worker.local_rank)
            steps = {h.step for h in slots.complete().values()
                     if h.rank == worker.global_rank and h.world_size == worker.world_size}
            common = steps if common is None else common & steps
            if not common:
                return set()
        return common or set()

    def newest_common_step(self, group: GroupInfo) -> int | None:
        """Newest step every local worker holds complete in shared memory (for its rank)."""
        return max(self.common_steps(group), default=None)

    # ------------------------------------------------------------------------------------------
    # Replicas, for the peer server (a replacement node restores from a healthy replica).

    def _replica_of(self, held_rank: int, rank: int, world: int) -> bool:
        """Whether ``held_rank`` holds the same shard as ``rank`` (same tp and pp coordinates;
        pure data parallelism without a layout)."""
        tp, pp, dp = self.layout or (1, 1, world)
        if tp * pp * dp != world:
            return False
        return (held_rank % tp, held_rank // (tp * dp)) == (rank % tp, rank // (tp * dp))

    def _replica_headers(self, rank: int, world: int) -> list[tuple[shm.SlotSet, int, Any]]:
        # Headers carry the rank a snapshot was taken as: this node's ranks may have changed
        # since (a new round), so every slot set is looked at, not the current ranks'.
        found = []
        for slots in list(self._slots.values()):
            for index, header in slots.complete().items():
                if header.world_size == world and self._replica_of(header.rank, rank, world):
                    found.append((slots, index, header))
        return found

    def replica_steps(self, rank: int, world_size: int) -> list[int]:
        return sorted({h.step for _, _, h in self._replica_headers(rank, world_size)},
                      reverse=True)

    def replica_shard(self, step: int, rank: int, world_size: int
                      ) -> tuple[dict[str, Any], bytes] | None:
        group = self._group
        if group is None:
            return None
        for slots, index, header in self._replica_headers(rank, world_size):
            if header.step != step:
                continue
            slot = slots.get(index)
            # A buffer of its own: the persist thread may be using the staging buffers.
            snapshot = _copy_out(slot, step, shm.StagingBuffer()) if slot is not None else None
            if snapshot is None or not _whole_tensors(snapshot.manifest):
                continue
            # Encoded exactly as the durable tier writes a shard (checksummed blobs). Each
            # request gets a scratch directory of its own: two ranks asking for the same step
            # at once are served from the same replica, so they would write the same file.
            cache = checkpoint_dir_default(self.config.ckpt_dir, group.run_dir) / "replica-cache"
            cache.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f"node-{group.node_id}-", dir=cache))
            try:
                directory = durable.write_rank_shard(scratch, snapshot)
                manifest = durable.read_rank_manifest(directory, snapshot.rank)
                data = (directory / manifest["file"]).read_bytes()
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            logger.info("serving step %d of rank %d from the replica rank %d in memory", step,
                        rank, snapshot.rank)
            return dict(manifest, rank=rank, replica_of=snapshot.rank), data
        return None

    def _persist_loop(self) -> None:
        diskfile.background_priority()
        while True:
            step = self._jobs.get()
            if step is None:
                return
            try:
                group = self._group
                if group is not None and step < 0:
                    with self._persist_lock:
                        self._commit_remote(group.workers[0].world_size if group.workers else 0)
                elif group is not None:
                    self.persist(step, group, cause="periodic")
            finally:
                self._busy.clear()

    def persist(self, step: int, group: GroupInfo,
                copies: Mapping[int, Snapshot] | None = None, *, cause: str = "") -> bool:
        """Writes the local workers' snapshots of ``step`` (or ``copies`` of them, by global
        rank) to disk, commits, replicates. A ``step`` the workers have overwritten since it
        was picked gives way to the newest one they all hold. ``cause`` goes in the event."""
        with self._persist_lock:
            if step <= self._persisted:
                return True
            started = time.monotonic()
            with contextlib.ExitStack() as held:  # slots read in place stay locked till written
                if copies is None:
                    taken = self._copy_newest(step, group, held)
                    if taken is None:
                        return False
                    step, copies = taken
                    # One INFO line per periodic persist (below); a flush's steps are told.
                    logger.log(logging.DEBUG if cause == "periodic" else logging.INFO,
                               "took step %d out of shared memory in %.2f s (%s)", step,
                               time.monotonic() - started, cause or "persist")
                if not self._write(step, group, copies, started, cause):
                    return False
            self._replicate(step, group)
            return True

    def _write(self, step: int, group: GroupInfo, copies: Mapping[int, Snapshot],
               started: float, cause: str) -> bool:
        """The disk part of :meth:`persist` (under ``_persist_lock``)."""
        try:
            nbytes = self._write_shards(step, group, copies)
            self._commit(step, group)
        except StorageFull as e:
            if not self._storage_full_reported:
                logger.error("checkpoint step %d not persisted: %s", step, e)
                self._storage_full_reported = True
            return False
        except (CheckpointError, OSError) as e:
            logger.error("checkpoint step %d not persisted: %s", step, e)
            return False
        self._persisted = step
        seconds = time.monotonic() - started
        logger.info("persisted checkpoint step %d (%.1f MB) in %.2f s", step, nbytes / 1e6,
                    seconds)
        self._event(group, "checkpoint", step=step, bytes=nbytes, seconds=round(seconds, 3),
                    cause=cause or "persist")
        return True

    def _copy_newest(self, step: int, group: GroupInfo, held: contextlib.ExitStack
                     ) -> tuple[int, dict[int, Snapshot]] | None:
        """Every local worker's snapshot of ``step`` (see :meth:`_copies`), else of the newest
        step they all hold now: with steps faster than a tick the one picked may already be
        overwritten, which is no error. None when no newer step than the last persisted is
        held."""
        for _ in range(3):
            try:
                with contextlib.ExitStack() as attempt:  # an attempt that fails holds nothing
                    copies = self._copies(step, group, attempt)
                    held.enter_context(attempt.pop_all())
                return step, copies
            except CheckpointError as e:
                newest = self.newest_common_step(group)
                if newest is None or newest <= self._persisted:
                    logger.debug("step %d not persisted: %s", step, e)
                    return None
                step = newest
        logger.info("no step held by every local worker long enough to copy; trying later")
        return None

    def _write_shards(self, step: int, group: GroupInfo, copies: Mapping[int, Snapshot]) -> int:
        roots = [self.local_dir(group)]
        if self.config.ckpt_remote_dir is not None:
            roots.append(self.config.ckpt_remote_dir)
        total = 0
        for snapshot in copies.values():
            for root in roots:
                durable.write_rank_shard(root, snapshot)
            total += len(snapshot.payload)
        return total

    def _commit(self, step: int, group: GroupInfo) -> None:
        world = group.workers[0].world_size if group.workers else 0
        local_ranks = [w.global_rank for w in group.workers]
        local = self.local_dir(group)
        single = group.group_world_size <= 1
        durable.try_commit(local, step, world, range(world) if single else local_ranks)
        durable.retain(local, self.config.ckpt_keep)
        if self.config.ckpt_remote_dir is not None and group.group_rank == 0:
            # The leader commits the shared directory once every node's shards landed; other
            # nodes may still be writing, so this is retried every tick instead of waited for.
            self._remote_pending.add(step)
            self._commit_remote(world)

    def _commit_remote(self, world: int) -> None:
        remote = self.config.ckpt_remote_dir
        if remote is None or not self._remote_pending:
            return
        try:
            durable.commit_pending(remote, self._remote_pending, world, range(world),
                                   self.config.ckpt_keep)
        except (CheckpointError, OSError) as e:
            logger.error("committing in %s failed: %s", remote, e)

    def _replicate(self, step: int, group: GroupInfo) -> None:
        if not self._backup_addr or not self._secret:
            return
        client = PeerClient(self._backup_addr, self._secret)
        directory = durable.step_dir(self.local_dir(group), step)
        try:
            for worker in group.workers:
                client.put_from_dir(directory, worker.global_rank)
        except (OSError, CheckpointError) as e:
            logger.warning("peer backup of step %d to %s failed: %s", step, self._backup_addr, e)


def _copy_out(slot: shm.Slot, step: int, staging: shm.StagingBuffer,
              delay_s: float = 0.0) -> Snapshot | None:
    """A private copy of the slot's snapshot of ``step``, taken under the slot's shared lock.

    The lock is held for one memory copy only, not for the disk write: the worker never waits
    for a reader, it takes another slot, so a long hold would tie up a slot. The copy releases
    the GIL and leaves page faults to itself (no ``madvise`` under the GIL), so the agent's
    monitor loop keeps running meanwhile. ``delay_s``: see ``COPY_DELAY_ENV``.
    """
    with slot.shared(timeout_s=30) as locked:
        if not locked:
            return None
        snapshot = shm.read_slot(slot, verify=False, prefault=False)
        if snapshot.step != step:
            return None  # overwritten between the peek and the lock
        copy = Snapshot(snapshot.manifest, staging.copy_of(snapshot.payload))
        if delay_s:
            time.sleep(delay_s)
        return copy


def _hold(slot: shm.Slot, step: int, held: contextlib.ExitStack) -> Snapshot | None:
    """The slot's snapshot of ``step`` in place, its shared lock held until ``held`` closes."""
    with contextlib.ExitStack() as locked:  # released here unless handed to ``held``
        if not locked.enter_context(slot.shared(timeout_s=30)):
            return None
        snapshot = shm.read_slot(slot, verify=False, prefault=False)
        if snapshot.step != step:
            return None  # overwritten between the peek and the lock
        held.enter_context(locked.pop_all())
        return snapshot


def _whole_tensors(manifest: Mapping[str, Any]) -> bool:
    """Whether every tensor is whole (no DTensor/FSDP shard), so another rank can load it."""
    return all(not any(item.get("chunk_offsets", ())) and
               item.get("shape") == item.get("global_size", item.get("shape"))
               for item in manifest["items"] if item["kind"] == "tensor")


def _host_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class CheckpointAddOn:
    """The checkpoint service as an add-on of the agent (:class:`elasticft.agent.api.AddOn`)."""

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
        remote = options.ckpt.ckpt_remote_dir
        if options.agent.fresh and remote is not None and durable.committed_steps(Path(remote)):
            # Shared by every node, and by a node that joins later: never removed by one.
            raise ConfigError(f"--fresh: --ckpt-remote-dir {remote} holds checkpoints of earlier "
                              "launches, which a restore would use; give a new remote directory "
                              "or remove them", reason="fresh_remote")
        layout = options.plan.layout.complete() if options.plan.layout is not None else None
        return CheckpointService(options.ckpt, local_addr=context.launch.local_addr,
                                 event_dir=options.agent.event_dir, layout=layout,
                                 fresh=options.agent.fresh)
