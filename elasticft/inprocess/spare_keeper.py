"""A pre-started spare, the agent's side: one process per node that has run the script's set-up
and waits to take a failed rank (``--recovery-inprocess-spare``).

A replacement started after a failure pays the script's start-up (the model built, the process
group, the optimizer) and a first step in new memory, which grow with the state (at 1 GB per
rank here most of the in-process recovery). The spare pays them before any failure: the
:class:`SpareKeeper` starts it once every worker runs under ``InProcess`` (so it does not compete
with the workers' own start), from the warm interpreter of local rank 0 when it is ready, else
cold, with the environment of :func:`spare_env` (a one-member world of its own). The spare's side
is :mod:`elasticft.inprocess.spare`.

When a rank fails and the agent recovers in process, :meth:`SpareKeeper.take` gives the spare
the failed local rank (:func:`pick`): it writes the spare's
:class:`~elasticft.inprocess.protocol.Assignment` (the failed worker's environment for the new
generation) and puts the spare's process in torch's process context in that worker's place; no
process is started. The next monitor tick starts a new spare. A spare that is not ready (its
set-up still runs) or has exited is not used: the rank gets a replacement process as without a
spare. A spare that exits while it waits is replaced, up to :data:`FAILED_LIMIT` times per
attempt (:func:`next_move`); it never stops the job.

Cost: a second copy of one rank's memory on the node (host memory on CPU).

**On a node with GPUs** the spare's device is chosen before it builds anything
(:func:`elasticft.inprocess.placement.spare_gpu`): a GPU of the node that no worker uses and none
died on, the only one it sees (``CUDA_VISIBLE_DEVICES``), and that device becomes the rank's
when the spare takes one; the GPU the rank's dead worker used is then free, and the next spare
goes there. It never holds a copy of a rank's state on another rank's GPU (as ``LOCAL_RANK=0``
would make it do on rank 0's). Such a spare starts cold: the warm interpreter it would fork from
may hold a CUDA context on rank 0's GPU. Where every GPU runs a rank there is no spare (a failed
rank gets a new process); the price of the spare is then a GPU kept free, and what it buys is the
set-up and first step of a replacement, paid before the failure. The keeper holds the node's
:class:`~elasticft.inprocess.placement.GpuUse`, which says where a replacement process may start
too (:meth:`SpareKeeper.place_replacement`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elasticft import procs, steps
from elasticft.ckpt import settings as ckpt_settings
from elasticft.diag import workerenv as diag_workerenv
from elasticft.events import EventLog
from elasticft.inprocess import placement
from elasticft.inprocess.placement import GpuUse, Placement, spare_gpu
from elasticft.inprocess.ports import EnvOf, WorkerOps
from elasticft.inprocess.protocol import Assignment, Generation, SpareReady, ready_file
from elasticft.inprocess.spare import SPARE_ENV

logger = logging.getLogger(__name__)

FAILED_LIMIT = 3
"""Spares that may exit while waiting in one attempt before no more are started."""
SPARE_LOCAL_RANK = 0
"""The local rank whose environment (and warm interpreter) a spare starts from."""

_ONE_MEMBER_WORLD = {
    "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
}
"""A world of its own: rank 0 of 1 on a private store (port 0: any free port)."""
_RANK_BOUND = (ckpt_settings.WORKER_ENV | diag_workerenv.WORKER_ENV
               | {steps.STEP_LOG_ENV, "TORCHELASTIC_ERROR_FILE"})
"""A rank's own files (checkpoint memory, diagnostics rings, step and error records): the spare
gets them only with the rank it takes."""


def node_gpus(visible: str | None, device_files: Sequence[str]) -> list[str]:
    """The GPUs the node's workers see (pure): ``CUDA_VISIBLE_DEVICES`` (``visible``) where it
    is set, else one per ``/dev/nvidia<N>`` device file."""
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    indices = {int(name) for f in device_files
               if (name := Path(f).name.removeprefix("nvidia")).isdigit()}
    return [str(i) for i in sorted(indices)]


def spare_env(worker_env: Mapping[str, str], spare: str) -> dict[str, str]:
    """The spare's environment, from a worker's (pure): the same script and options, a world of
    its own, none of the worker's rank-bound files."""
    env = {k: v for k, v in worker_env.items() if k not in _RANK_BOUND}
    return {**env, **_ONE_MEMBER_WORLD, SPARE_ENV: spare}


class SpareMove(enum.Enum):
    """What the keeper does about its spare at a monitor tick (not a training step)."""

    OFF = "off"
    """No spare: the option is off, or too many spares failed in this attempt."""
    WAIT = "wait"
    """Not yet: the workers are still starting, a recovery is under way, or the warm
    interpreter is still importing."""
    START = "start"
    KEEP = "keep"
    """The spare runs (starting, or ready and waiting)."""


def next_move(*, enabled: bool, running: bool, failed: int, armed: bool, recovering: bool,
              warm_ready: bool | None, placeable: bool = True) -> SpareMove:
    """The keeper's decision at a tick (pure). ``failed``: spares that exited while waiting in
    this attempt; ``warm_ready``: whether the warm interpreter the spare forks from has done its
    imports (None: there is none, the spare starts cold); ``placeable``: whether the node has a
    device for a spare (:func:`spare_gpu`)."""
    if not enabled or not placeable or failed >= FAILED_LIMIT:
        return SpareMove.OFF
    if running:
        return SpareMove.KEEP
    if not armed or recovering or warm_ready is False:
        return SpareMove.WAIT
    return SpareMove.START


def pick(*, ready: bool, alive: bool, failed_local_ranks: Sequence[int]) -> int | None:
    """The failed local rank the spare takes (the lowest), or None: no spare that can (pure)."""
    if not (ready and alive) or not failed_local_ranks:
        return None
    return min(failed_local_ranks)


class SpareKeeper:
    """This node's spare: started, watched, assigned, stopped."""

    def __init__(self, directory: Path, events: EventLog, enabled: bool,
                 gpus: Sequence[str] = ()) -> None:
        self.directory = directory
        self.events = events
        self.enabled = enabled
        self.gpus = list(gpus)
        """The GPUs the node's workers see (:func:`node_gpus`); empty on a CPU node."""
        self.use: GpuUse | None = None
        """Which GPU each process of the node uses (None until the workers' first tick)."""
        self._unplaced = ""
        self.handler: Any = None
        """torch's ``SubprocessHandler`` of the spare that runs, or None."""
        self.number = 0
        self.failed = 0
        """Spares that exited while waiting in this attempt."""
        self.taken: dict[int, dict[int, int]] = {}
        """Generation → local rank → pid of the spare that took it."""
        self._started_at = 0.0
        self._ready = False

    # -- monitor ticks --------------------------------------------------------------------------

    def tick(self, context: Any, workers: WorkerOps, *, armed: bool,
             recovering: bool) -> None:
        """Notices a spare that became ready or exited, and starts one when :func:`next_move`
        says so. Never raises: a spare is an optimisation."""
        try:
            self._watch()
            if context is None:
                return
            use = self.gpu_use(context)
            gpu, why = spare_gpu(use)
            if gpu is None and self.enabled and why != self._unplaced:
                self._unplaced = why
                logger.warning("no in-process spare: %s", why)
            # cold on a GPU: the warm interpreter may hold a context on rank 0's GPU
            warm_ready = None if gpu else workers.warm_spare()
            move = next_move(enabled=self.enabled, running=self.handler is not None,
                             failed=self.failed, armed=armed, recovering=recovering,
                             warm_ready=warm_ready, placeable=gpu is not None)
            if move is SpareMove.START:
                self._start(context, workers, gpu or "", warm=warm_ready is not None)
        except Exception:
            logger.warning("the in-process spare could not be kept", exc_info=True)

    def _watch(self) -> None:
        if self.handler is None:
            return
        pid = self.handler.proc.pid
        exitcode = self.handler.proc.poll()
        if exitcode is not None:
            self.failed += 1
            logger.warning("in-process spare %d (pid %d) exited with %s while waiting; %s",
                           self.number, pid, exitcode,
                           "starting another" if self.failed < FAILED_LIMIT else
                           f"no more spares in this attempt ({self.failed} exited)")
            self.events.emit("spare_failed", spare=self.number, pid=pid, exitcode=exitcode)
            self._discard()
            return
        if not self._ready and self.ready():
            self._ready = True
            setup = time.time() - self._started_at
            logger.info("in-process spare %d (pid %d) ready after %.1f s", self.number, pid,
                        setup)
            self.events.emit("spare_ready", spare=self.number, pid=pid, setup_s=round(setup, 3))

    def gpu_use(self, context: Any) -> GpuUse:
        """The node's GPUs and who uses them; from torch's ``context`` at the workers' start."""
        if self.use is None:
            self.use = GpuUse.start(self.gpus, context.envs.keys())
        return self.use

    def place_replacement(self, context: Any, local_rank: int, device_fault: bool) -> Placement:
        """Where a replacement of ``local_rank`` starts (:func:`placement.replacement_gpu`);
        a spare in its set-up on that GPU is stopped first, and the rank's GPU is recorded."""
        use = self.gpu_use(context)
        where = placement.replacement_gpu(use, local_rank, device_fault)
        if where.stop_spare:
            logger.warning("in-process spare %d gives up %s", self.number, where.reason)
            self._discard()
        if where.gpu is not None:
            self.use = placement.restarted(self.gpu_use(context), local_rank, device_fault)
        return where

    def ready(self) -> bool:
        """Whether the running spare has finished its set-up and waits for a rank."""
        if self.handler is None:
            return False
        ready = SpareReady.read(self.directory, str(self.number))
        return ready is not None and ready.pid == self.handler.proc.pid

    def _start(self, context: Any, workers: WorkerOps, gpu: str = "", *, warm: bool) -> None:
        self.number += 1
        name = str(self.number)
        env = spare_env(context.envs[SPARE_LOCAL_RANK], name)
        if gpu:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        outputs = {}
        for stream, paths in (("stdout", context.stdouts), ("stderr", context.stderrs)):
            worker_log = paths.get(SPARE_LOCAL_RANK)
            if worker_log:  # torch's <log dir>/attempt_N/<local rank>/<stream>.log
                path = Path(worker_log).parent.parent / f"spare-{name}" / f"{stream}.log"
                path.parent.mkdir(parents=True, exist_ok=True)
                outputs[stream] = str(path)
        self._started_at = time.time()
        self._ready = False
        handler = workers.start_spare(env, outputs, warm=warm)
        self.handler = handler
        if self.use is not None:
            self.use = dataclasses.replace(self.use, spare=gpu or None)
        logger.info("in-process spare %d started (pid %d, %s)", self.number, handler.proc.pid,
                    "warm" if handler.warm else "cold")
        self.events.emit("spare_started", spare=self.number, pid=handler.proc.pid,
                         warm=handler.warm)

    # -- a failure -------------------------------------------------------------------------------

    def would_take(self, failed_local_ranks: Sequence[int]) -> int | None:
        """The failed local rank the spare takes now (:func:`pick`), or None."""
        alive = self.handler is not None and self.handler.proc.poll() is None
        return pick(ready=self.ready(), alive=alive, failed_local_ranks=failed_local_ranks)

    def take(self, context: Any, workers: WorkerOps, failed_local_ranks: Sequence[int],
             generation: Generation, env_of: EnvOf,
             device_faults: Mapping[int, bool] | None = None) -> dict[int, int]:
        """Gives the spare a failed local rank, in torch's process ``context`` and in the
        spare's assignment; returns {local rank: pid} (empty: no spare could, the caller starts
        replacements). ``device_faults``: the failed ranks whose worker died of a fault of its
        GPU, which then takes no spare either."""
        local_rank = self.would_take(failed_local_ranks)
        if local_rank is None:
            if self.enabled:
                logger.info("no in-process spare ready for local rank(s) %s; starting a "
                            "process", list(failed_local_ranks))
            return {}
        handler, self.handler = self.handler, None
        env = env_of(context.envs[local_rank])
        workers.hand_over(local_rank, env, handler)  # a restart now ends it like any worker
        Assignment(generation, local_rank, env).write(self.directory, str(self.number))
        self.taken[generation.generation] = {local_rank: handler.proc.pid}
        if self.use is not None:  # the spare's GPU is the rank's; the dead worker's is free
            self.use = placement.taken(self.use, local_rank,
                                       (device_faults or {}).get(local_rank, False))
        logger.warning("in-process spare %d (pid %d) takes local rank %d", self.number,
                       handler.proc.pid, local_rank)
        return {local_rank: handler.proc.pid}

    # -- the end of an attempt -------------------------------------------------------------------

    def stop(self) -> None:
        """Ends the spare that waits (the attempt's workers are gone, or the run ends): the
        next workers start on their own GPUs again."""
        self.failed = 0
        self._discard()
        self.use = None
        for pattern in ("spare-*.json", "assign-*.json"):
            for path in self.directory.glob(pattern):
                with contextlib.suppress(OSError):
                    path.unlink()

    def _discard(self) -> None:
        handler, self.handler = self.handler, None
        if self.use is not None:
            self.use = dataclasses.replace(self.use, spare=None)
        if handler is not None:
            procs.kill_and_reap([handler.proc], 10.0)
            for stream in (getattr(handler, "_stdout", None), getattr(handler, "_stderr", None)):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        with contextlib.suppress(OSError):
            ready_file(self.directory, str(self.number)).unlink()
