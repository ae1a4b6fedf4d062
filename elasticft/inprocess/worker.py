"""In-process recovery, the worker's side: a failed peer costs the survivors a roll-back, not
their process.

A training function wrapped by :meth:`InProcess.run` is re-entered in the same process after a
peer fails. When it raises an error of the communication layer (the failure classifier's
:func:`~elasticft.addon.classify.peer_failure`, the one judge of a failed peer: gloo's
"connection closed by peer" when another rank died, a ``DistError``, a connection reset), the
survivor

1. **reports** it to the agent (a file in the agent's in-process directory),
2. **aborts** its process groups, with the same calls on every backend (every group's abort
   at once, then torch's ``_abort_process_group`` of the default group, which clears torch's
   table of groups: :func:`elasticft.inprocess.groups.tear_down`); what it needs of its group
   it took when recovery armed (:class:`elasticft.inprocess.groups.ArmedGroup`), its device it
   reads again at the failure,
3. **waits for the agent's next generation**: the agent starts a replacement for the failed
   rank at once, in parallel, from its warm interpreter, and publishes a new store for the
   generation (``generation.json``: its address and port); when the failed rank was on another
   node, the generation is the next rendezvous round's, where a standby's new worker takes the
   failed rank (rank 0 then hosts the store, as ``env://`` does),
4. **regroups**: ``init_process_group`` on that store, with the same backend, rank and world
   size; the replacement's own unchanged ``init_process_group()`` (``env://``, its
   ``MASTER_PORT`` is the new store's) meets it there,
5. **re-enters the function**, with no gradient on the parameters of the optimizers that
   stepped here (the step the failure cut short left its own), which restores the newest step
   every rank holds into the live tensors (:meth:`elasticft.ckpt.Checkpointer.restore`, an
   in-place copy from the agent's memory: no new allocation) and continues from there. Its
   ``resumed`` record, at the first step, carries when that restore ended (``restored``: the
   checkpointer's report of it, or :meth:`InProcess.restore_done` for a script that restores
   by itself), so the agent tells the restore from the redone step.

Everything built outside the function stays alive: the model, the optimizer and its state
tensors, the data, compiled graphs. What is bound to a process group is built inside it, since
the group it was bound to is gone: ``DistributedDataParallel`` is re-wrapped around the same
module on every entry (its constructor broadcasts nothing new: the restore makes every rank
equal), as are groups made with ``new_group``. Modules sharded in the set-up (FSDP2's
``fully_shard``, tensor parallel DTensors) are kept whole when they are given as
``InProcess(modules=[model])``: after the regroup their device meshes' groups are made again
and FSDP2 is pointed at them (:mod:`elasticft.inprocess.meshes`).

A generation that reshapes the job (:mod:`elasticft.inprocess.reshape`: a node lost with no
standby, or one that joins) carries this rank's new variables: the survivor sets them, regroups as
its new rank in the new world, re-points the kept meshes at the new layout's shape
(:meth:`~elasticft.inprocess.meshes.KeptModules.reshape`) and renumbers its checkpointers; the
function, which reads ``elasticft.layout()`` at each entry (``follows_layout=True``), goes on in
the new layout.

Whatever goes wrong during recovery falls back to the agent's full restart from the same
snapshots: an error that is not a peer failure (a bug, a CUDA error: the device's context may be
unusable after it) is raised as before, and a generation that does not come within the timeout
re-raises the original error, so the process exits and the agent restarts the group.

A step that finishes after its generation ended is never committed (an aborted NCCL collective
may return a wrong result without raising): an optimizer-step pre-hook, :meth:`InProcess.step_done`
and the checkpointers' commit gate refuse it (:mod:`elasticft.inprocess.interrupt`). A section
that must not be interrupted in its middle runs under :meth:`InProcess.atomic`.

Without ``elasticft-run`` (no in-process directory in the environment) :meth:`InProcess.run`
just calls the function once.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from elasticft.addon.classify import peer_failure, process_unusable
from elasticft.ckpt.control import restored_path
from elasticft.ckpt.settings import ENV_CONTROL
from elasticft.diag import groupsockets
from elasticft.diag import recorder as diag_recorder
from elasticft.inprocess import cuda_graphs, reconfigure
from elasticft.inprocess.certify import Replicated, certify
from elasticft.inprocess.ddp_buckets import BucketLayouts
from elasticft.inprocess.device import ArmedDevice, within
from elasticft.inprocess.groups import (
    ArmedGroup,
    GroupOps,
    backend_config,
    process_groups,
    regroup,
    release_ended,
    tear_down,
    waits_on_gloo,
)
from elasticft.inprocess.interrupt import Monitor, PeerInterrupted
from elasticft.inprocess.meshes import KeptModules, RebindError, device_meshes
from elasticft.inprocess.ncclenv import abort_warning, missing, nccl_version
from elasticft.inprocess.protocol import (
    Generation,
    InProcessSettings,
    WorkerRecord,
)
from elasticft.jsonfile import read_json

logger = logging.getLogger(__name__)

LEAVE_EXIT_CODE = 86
"""A survivor's exit status when its teardown overran the hard limit or its device is unfit:
it leaves for a replacement (the agent replaces it in the same recovery)."""

_T = TypeVar("_T")


def _started_at() -> float:
    """Wall clock when this process started (from ``/proc``; now where it cannot be read)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


# ------------------------------------------------------------------------------------------------

class RecoveryTimeout(RuntimeError):
    """The agent published no next generation in time; the process exits for a restart."""


class InProcess:
    """Runs a training function, and runs it again in this process after a peer failed.

    ``InProcess().run(train)``: ``train`` builds what is bound to the process group (DDP),
    restores the newest checkpoint into the live model and optimizer, and trains. Call it after
    ``init_process_group`` and with no collective between the two: a replacement process runs
    the script from its start and must reach the same first collective as the survivors.
    """

    def __init__(self, settings: InProcessSettings | None = None,
                 ops: GroupOps | None = None, modules: Sequence[Any] = (),
                 follows_layout: bool = False) -> None:
        self._reached = time.time()
        """When the script reached its recovery: a replacement's start-up up to here is its
        interpreter's, its imports, its model and its group (the ``start`` phase of a recovery;
        not the import of this module, which a warm interpreter did before the fork)."""
        self.settings = settings if settings is not None else InProcessSettings.from_env()
        self.ops = ops if ops is not None else GroupOps.for_torch(
            self.settings.teardown_limit_s)
        self.follows_layout = follows_layout
        """The training function reads ``elasticft.layout()``, its rank and world size at each
        entry: a round that shrinks or grows the world then goes on in process when it can
        (:mod:`elasticft.inprocess.reshape`); without it such a round restarts the workers."""
        self.modules = tuple(modules)
        """The sharded modules (FSDP2, tensor parallel) built before :meth:`run` and kept
        through recoveries: their device meshes' groups are made again after a regroup
        (:mod:`elasticft.inprocess.meshes`)."""
        self._kept: KeptModules | None = None
        self.generation = self.settings.generation
        self.recoveries = 0
        """How often this process regrouped."""
        self._phases: dict[str, float] = {}
        self._resume_hook: Any = None
        self._gate_hooks: list[Any] = []
        """The optimizer-step pre-hook, the checkpointers' commit gate and start keeper, while
        armed."""
        self._awaiting: int | None = None
        """The generation whose first step is still to be reported."""
        self._steps: list[float] = []
        self._entered = time.time()
        self._first_step_s: float | None = None
        self._restored_at: float | None = None
        """When the script said its restore ended (:meth:`restore_done`)."""
        self.group: ArmedGroup | None = None
        """The script's default group as recovery armed it (backend, rank, world size, the
        script's settings), kept current through regroups: after a failure nothing of
        it is read from torch's table of groups, which an abort clears."""
        self.device = ArmedDevice()
        """The rank's device and NVML's baseline for it, taken when recovery arms."""
        self.monitor: Monitor | None = None
        self.bucket_layouts = BucketLayouts.of_this_node()
        """The DDPs' rebuilt bucket layouts, carried to the DDPs of the next generation."""
        self._replicated: list[Replicated] = []
        """The DDPs made since the latest optimizer step, whose replicas certify their state at
        the next one (:mod:`elasticft.inprocess.certify`)."""
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        """The ``torch.optim`` optimizers that stepped in this generation, whose gradients a
        re-entry drops (:meth:`_forget_gradients`) and whose state the certified restore
        compares."""

    def run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        directory = self.settings.directory
        if directory is None:
            return fn(*args, **kwargs)
        from elasticft.inprocess import spare

        was_spare = spare.is_spare()
        if was_spare and device_meshes(self.modules):
            raise RebindError("a spare cannot take a rank of a script whose modules are "
                              "sharded over a device mesh (its mesh is a world of one); run "
                              "without --recovery-inprocess-spare")
        if was_spare:  # a pre-started spare: it waits here until it takes a rank
            self.settings = spare.take_rank(self.settings, self.ops)
            self.generation = self.settings.generation
        # What the set-up made (torch's modules, the model) leaves the collector's walks: the
        # collection that frees a failed call's group (_release) then walks only what came
        # after; a full walk of a torch process took 0.2-0.7 s of a survivor's teardown.
        gc.freeze()
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        from elasticft.ckpt import Checkpointer, start_snapshot

        self._entered = time.time()
        self._resume_hook = register_optimizer_step_post_hook(self._on_step)
        self._gate_hooks = [register_optimizer_step_pre_hook(self._before_step)]
        self.group = ArmedGroup.of_default_group()
        self.device = ArmedDevice.arm(self.group.settings.device_id if self.group else None)
        if self.modules:
            self._kept = KeptModules.arm(self.modules)
        if groupsockets.installed() is None:  # the bootstrap records from the script's first group
            groupsockets.install()
            if waits_on_gloo(backend_config(g) for g in process_groups()):
                logger.warning("the sockets of the groups made before InProcess.run were not "
                               "recorded: a gloo wait on a silent peer is not ended")
        if self.group is not None:
            backend = self.group.backend
            if any("nccl" in backend_config(g).lower() for g in process_groups()):
                if warning := abort_warning(nccl_version()):
                    logger.warning("%s", warning)
                if lacking := missing(os.environ):  # a job's first start (ncclenv's docstring)
                    logger.warning("NCCL groups made without %s: torch's watchdog may end or "
                                   "hold this survivor after a peer failure (the agent gives "
                                   "them from the job's next start on)", ", ".join(lacking))
            monitor = Monitor(directory, read_json,
                              lambda: self.ops.end(backend, lambda: monitor.inside))
            self.monitor = monitor
            monitor.start()
            self._gate_hooks.append(Checkpointer.register_commit_gate(monitor))
        # Until its first step, a restore that finds nothing snapshots the start: the roll-back
        # of a peer failure before the first checkpoint.
        self._gate_hooks.append(
            start_snapshot.register_keeper(lambda: self._first_step_s is None))
        self._write("armed", {"follows_layout": self.follows_layout,
                              "sharded_over": self._kept.sharded_over() if self._kept else []})
        if self.generation > 0:  # a replacement: the script's own init joined the generation
            now = time.time()
            self._phases = {"joined": now, **_rebuild()}
            if not was_spare:  # a new process: its start-up is part of the recovery
                self._phases.update(reached=self._reached, started=_started_at())
            self._write("joined", self._phases)
            self._report_first_step()
        unarm_buckets = self.bucket_layouts.arm(  # a re-made DDP sums as the one before it
            lambda ddp, parameters: self._replicated.append(
                Replicated(tuple(parameters), ddp.process_group)))
        try:
            while True:
                returned, outcome = self._call(fn, args, kwargs)
                if returned:
                    return outcome
                if not self._recoverable(outcome):
                    raise outcome
                if self.monitor is not None:  # the teardown's abort ends the groups too
                    self.monitor.generation_over(self.generation)
                self._recover(outcome)
                self._forget_gradients()
                # The optimizers of the generation to come are the ones that step in it (a
                # framework makes a new one on each entry; the old one lives on in its hands).
                self._optimizers = weakref.WeakSet()
                self._report_first_step()
        finally:
            if self.monitor is not None:
                self.monitor.stop()
            self._resume_hook.remove()
            for hook in self._gate_hooks:
                hook.remove()
            unarm_buckets()

    def step_done(self) -> None:
        """Tells the agent that a training step after the latest (re-)entry is over. Steps of a
        ``torch.optim`` optimizer say so by themselves; a script whose optimizer is not one
        calls this after each step's update and before its save (it costs nothing after the
        first). Raises :class:`PeerInterrupted` when the generation ended: the update may have
        used a collective's wrong result, and the restore replaces it."""
        self._before_step()
        self._on_step()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A section of the main thread that the monitor's asynchronous
        :class:`PeerInterrupted` does not interrupt (:meth:`Monitor.protected
        <elasticft.inprocess.interrupt.Monitor.protected>`): one due in it is raised when the
        section ends. The process groups are ended all the same, so a collective in the section
        raises (gloo) or returns a wrong result (NCCL), and the optimizer step and the checkpoint
        save still refuse a step of a generation that ended. A section must not wait on a peer
        by other means (a blocking receive, a store key): nothing ends such a wait."""
        if self.monitor is None:
            yield
            return
        with self.monitor.protected():
            yield

    def _before_step(self, *args: Any) -> None:
        """Before every optimizer step (and at :meth:`step_done`): a step of a generation whose
        groups were ended is refused, whatever its collectives returned."""
        if args:  # torch's pre-hook: (optimizer, args, kwargs)
            self._optimizers.add(args[0])
        if self.monitor is not None and (refused := self.monitor.refusal(self.generation)):
            logger.warning("step refused in generation %d: %s", self.generation, refused)
            raise refused
        if self._replicated:
            # The first step after a DDP was made, before it changes anything: its replicas
            # agree on what they restored, or every worker restarts. Every rank makes its DDPs
            # together (their construction is collective) and steps after it, survivor,
            # replacement and a standby's new worker alike, whatever generation each counts,
            # so every rank of a DDP's group takes part in the check.
            made, self._replicated = self._replicated, []
            certify(made, list(self._optimizers), self.generation)

    def restore_done(self) -> None:
        """Tells the agent that this entry's restore is over, for a script that restores without
        :meth:`elasticft.ckpt.Checkpointer.restore` (whose restores say so by themselves): the
        recovery's ``restore`` phase ends here and its ``redo`` begins."""
        self._restored_at = time.time()

    def _call(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> tuple[bool, Any]:
        """Runs ``fn`` once: (True, its result) or (False, its error). The monitor may interrupt
        it only in between (:mod:`elasticft.inprocess.interrupt`), and an end of the groups it
        began is over when this returns."""
        monitor = self.monitor
        if monitor is not None:
            monitor.entering(self.generation)
        outcome: tuple[bool, Any]
        try:
            outcome = (True, fn(*args, **kwargs))
        except BaseException as error:
            outcome = (False, error)
        if monitor is None:
            return outcome
        limit = self.settings.teardown_limit_s
        # A failed call's CUDA graphs go before the wait: the abort may be waiting for them.
        drop = _drop_graphs if not outcome[0] else (lambda: None)
        try:
            over = monitor.left(limit, drop)
        except PeerInterrupted:  # raised just before the monitor heard that fn ended: absorbed
            over = monitor.left(limit, drop)  # (the monitor raises again only grace_s later)
        if not over:
            self._leave(f"the end of its process groups did not finish within {limit:.0f} s")
        return outcome

    # -- the steps of one recovery ------------------------------------------------------------

    def _recoverable(self, error: BaseException) -> bool:
        interrupted = self.monitor is not None and self.monitor.interrupted
        return (isinstance(error, (Exception, PeerInterrupted)) and self.group is not None
                and (peer_failure(error) or isinstance(error, PeerInterrupted)
                     or (interrupted
                         and not process_unusable(f"{type(error).__name__} {error}"))))

    def _recover(self, error: BaseException) -> None:
        settings = self.settings
        assert settings.directory is not None
        failed_at = time.time()
        interrupted_at = self.monitor.interrupted_at if self.monitor is not None else None
        cause = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        logger.warning("in-process recovery of generation %d: %s", self.generation, cause)
        self._write("failed", {"cause": cause, "failed": failed_at, **self.measured(),
                               **({"interrupted": interrupted_at} if interrupted_at else {})})
        assert self.group is not None  # _recoverable
        backend, rank, world = self.group.backend, self.group.rank, self.group.world_size
        self._replicated.clear()  # the ended DDPs' groups: released in the bounded teardown
        _release(error)
        if self._kept is not None and (held := self._kept.held_elsewhere()):
            logger.warning("parameters still held after the failed call was released: %s (a "
                           "move of the module at the re-entry cannot swap them)",
                           ", ".join(held))
        # The device the teardown synchronizes and the health check judges: the rank's now.
        self.device = self.device.at_failure(self.group.settings.device_id)
        how = self._bounded_teardown(backend)
        aborted_at = time.time()
        self._write("torn", {"aborted": aborted_at})  # the agent's limit on it ends here
        deadline = time.monotonic() + settings.timeout_s
        generation = self._wait_generation(deadline)
        if generation is None:
            raise RecoveryTimeout(
                f"no in-process regroup after {settings.timeout_s:.0f} s (the agent restarts "
                f"the workers): {cause}") from error
        changed = generation.env_of(settings.local_rank)
        if changed:  # a reshape: this survivor's new rank, world and layout
            os.environ.update(changed)
            old_rank, rank = rank, int(changed.get("RANK", rank))
            logger.warning("reshape: rank %d of %d goes on as rank %d of %d", old_rank, world,
                           rank, generation.world_size)
        # The regroup ends by the agent's deadline for it, when the generation tells it.
        left_s = (generation.regroup_by - time.time() if generation.regroup_by
                  else deadline - time.monotonic())
        regroup(backend, rank, generation, max(left_s, 1.0), self.ops, self.group.settings)
        self.group = self.group.moved(rank, generation.world_size)
        regrouped_at = time.time()
        if changed:
            rebound = self._reshape(rank, generation.world_size)
        else:
            rebound = self._kept.rebind() if self._kept is not None else "no kept modules"
        self.generation = generation.generation
        self.recoveries += 1
        self._phases = {"failed": failed_at, "aborted": aborted_at, "joined": time.time(),
                        **({"interrupted": interrupted_at} if interrupted_at else {}),
                        **_rebuild()}
        logger.warning("rank %d rejoined in generation %d (%s %.3f s, regroup %.3f s, %s "
                       "%.3f s)", rank, self.generation, how, aborted_at - failed_at,
                       regrouped_at - aborted_at, rebound, self._phases["joined"] - regrouped_at)
        self._write("joined", self._phases)
        if (recorder := diag_recorder.installed()) is not None:
            # The re-made DDP's buckets are timed as the one before it were (and are summed by
            # the same hook as the replacement's, which gives DDP's own bits).
            recorder.rearm_ddp_autoattach()

    def _forget_gradients(self) -> None:
        """Before a re-entry: the gradients of the optimizers that stepped here and of the kept
        modules are set to None, as at a step boundary in a fresh process (the replacement's).
        They are the step the failure cut short, which a loop that zeroes them after its step
        or accumulates micro-batches would add to the redone step's. ``Checkpointer.restore``
        drops the restored model's too; this is for a script that restores by other means."""
        from elasticft.ckpt.restoring.state import drop_gradients

        drop_gradients(param for optimizer in list(self._optimizers)
                       for group in optimizer.param_groups for param in group["params"])
        for module in self.modules:
            drop_gradients(module.parameters())

    def _reshape(self, rank: int, world_size: int) -> str:
        """After a regroup into a reshaped world: the kept modules' meshes take the new
        layout's shape, and the checkpointers write as the new rank (their snapshots of the old
        one still restore). A failure raises, and the agent restarts the job."""
        from elasticft.ckpt import Checkpointer
        from elasticft.plan.worker import layout

        new = layout()
        done = "no kept modules"
        if self._kept is not None:
            done = self._kept.reshape({"pp": new.pp, "dp": new.dp, "tp": new.tp})
        for checkpointer in Checkpointer.instances():
            checkpointer.renumber(rank, world_size)
        return f"{done}, {new.describe()}"

    def _bounded_teardown(self, backend: str) -> str:
        """:func:`tear_down` and the device's health check, each under the hard limit; a
        survivor that overruns it or whose device is unfit leaves the job (its process exits
        with :data:`LEAVE_EXIT_CODE`), and the agent replaces it in the same generation."""
        limit = self.settings.teardown_limit_s
        how: list[str] = []
        device = self.device.index
        finished, error = within(lambda: how.append(tear_down(backend, self.ops, device)), limit,
                                 device)
        if not finished:
            self._leave(f"the teardown of its process groups did not end within {limit:.0f} s")
        if error is not None:
            logger.warning("teardown: %s: %s", type(error).__name__, error)
        sick = self.ops.health(limit, self.device)
        if sick is not None:
            self._leave(f"its device failed the health check: {sick}")
        return how[0] if how else "teardown failed"

    def _leave(self, why: str) -> None:
        logger.error("rank %s leaves for a replacement: %s", os.environ.get("RANK", "?"), why)
        self._write("left", {"why": why, "left": time.time()})
        logging.shutdown()
        os._exit(LEAVE_EXIT_CODE)

    def _wait_generation(self, deadline: float) -> Generation | None:
        assert self.settings.directory is not None
        while time.monotonic() < deadline:
            generation = Generation.read(self.settings.directory)
            if generation is not None and generation.generation > self.generation:
                return generation
            time.sleep(0.005)
        return None

    def _report_first_step(self) -> None:
        """Reports ``resumed`` once the first step after (re-)entry is over (an optimizer's
        step, or :meth:`step_done`)."""
        self._awaiting = self.generation

    def _on_step(self, *_: Any) -> None:
        """Every step: its time (for the agent's limits), and ``resumed`` once per entry."""
        now = time.time()
        self._steps.append(now)
        del self._steps[:-17]
        if self._first_step_s is None:
            self._first_step_s = now - self._entered
        if self._awaiting is not None and self._awaiting == self.generation:
            self._awaiting = None
            restored = self._restore_end(now)
            self._write("resumed", {**self._phases, "resumed": now,
                                    **({"restored": restored} if restored is not None else {})})
        if self.monitor is not None and self.monitor.stop_due():
            raise PeerInterrupted(f"generation {self.generation} ended by the agent at a step "
                                  "boundary (nodes join)")

    def _restore_end(self, now: float) -> float | None:
        """When this entry's restore ended, if it was reported after the entry's join and
        before its first step (``now``): the script's :meth:`restore_done`, else this process's
        latest checkpoint restore (:func:`elasticft.ckpt.control.report_restored`)."""
        joined = self._phases.get("joined", self._entered)
        found = self._restored_at
        control = os.environ.get(ENV_CONTROL)
        if found is None and control:
            record = read_json(restored_path(Path(control), self.settings.local_rank)) or {}
            if record.get("pid") == os.getpid() and isinstance(record.get("time"), (int, float)):
                found = float(record["time"])
        return found if found is not None and joined <= found <= now else None

    def measured(self) -> dict[str, float]:
        """What this process measured of its steps: ``first_s`` (from entering :meth:`run` to
        its first step: the set-up a replacement repeats, compilation included) and
        ``step_s`` (the median of its latest steps)."""
        out = {}
        if self._first_step_s is not None:
            out["first_s"] = round(self._first_step_s, 4)
        gaps = sorted(b - a for a, b in zip(self._steps, self._steps[1:], strict=False))
        if gaps:
            out["step_s"] = round(gaps[len(gaps) // 2], 4)
        return out

    def _write(self, kind: str, record: Mapping[str, Any]) -> None:
        assert self.settings.directory is not None
        try:
            WorkerRecord(kind, self.settings.local_rank, os.getpid(), self.generation,
                         record).write(self.settings.directory)
        except OSError as e:  # the agent then falls back to a restart after its timeout
            logger.warning("could not write the in-process %s record: %s", kind, e)


def _drop_graphs() -> None:
    """The CUDA graphs that captured the failed generation's communicators
    (:mod:`elasticft.inprocess.cuda_graphs`), dropped before the main thread waits for their
    abort."""
    if dropped := cuda_graphs.drop_all():
        logger.info("CUDA graphs dropped before the groups' abort: %s", ", ".join(dropped))


def _rebuild() -> dict[str, float]:
    """The group's rebuild in place, for the ``joined`` record (nothing on a new group)."""
    regime = reconfigure.active()
    return regime.joined_record() if regime is not None else {}


def _release(error: BaseException) -> None:
    """Drops what the failed call still holds: the locals of its finished frames (the DDP
    wrapper, the step's tensors) and the cycles they were in.

    A gloo group closes its connections only once nothing holds it, and its peers' collectives
    with this process end only then; ``destroy_process_group`` alone unregisters it.
    """
    for carried in exceptions_carried(error):
        traceback.clear_frames(carried.__traceback__)
    gc.collect()
    release_ended()  # the groups the monitor ended: their last holder, without the GIL


def exceptions_carried(error: BaseException) -> list[BaseException]:
    """``error`` and every exception it carries, each once: its cause *and* its context (one
    raised ``from`` another while a third was handled has both, each with a traceback of its
    own), an exception group's members, and theirs."""
    found: dict[int, BaseException] = {}
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in found:
            continue
        found[id(current)] = current
        pending += [current.__cause__, current.__context__]
        members = getattr(current, "exceptions", ())  # an exception group's (3.11 on)
        if isinstance(members, (list, tuple)):
            pending += [m for m in members if isinstance(m, BaseException)]
    return list(found.values())


def run(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``InProcess().run(fn, *args, **kwargs)``."""
    return InProcess().run(fn, *args, **kwargs)
