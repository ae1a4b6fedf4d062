"""Replacing workers of torch's process context one by one, while the others keep running.

In-process recovery replaces only the failed workers: it finds the ones that exited before
torch's own poll would stop the others (:func:`failed_exits`), kills and reaps what is left of
them (:func:`replace_after_kill`, with :func:`elasticft.procs.kill` and
:func:`~elasticft.procs.reap`: on a node with GPUs after they are gone, since a dead
process's device memory is released only at its end), and starts their replacements in the same
context, from the warm pool when there is one (:func:`start_replacements`).
:class:`ContextWorkers` offers them to in-process recovery as its
:class:`~elasticft.inprocess.ports.WorkerOps`, and records each new process in torch's worker
group, which only the agent edits.

Two hooks into torch's watch of the workers keep the survivors alive long enough to act: a
worker that is dying with a failing status is seen before ``waitpid`` answers
(:func:`ending_exits`), and torch's poll, which stops every other worker in the poll that finds a
failed one, first lets the agent's collaborators act on the survivors
(:func:`notify_before_survivors_stopped`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from elasticft import procs, torch_compat
from elasticft.agent.warmpool import WarmPool, WarmSubprocessContext, WarmSubprocessHandler
from elasticft.inprocess.spare_keeper import SPARE_LOCAL_RANK
from elasticft.procs import kill, reap

_R = TypeVar("_R")


def failed_exits(context: Any, workers: Sequence[Any]) -> dict[int, Any]:
    """Workers of torch's process ``context`` that exited with a failing status, as torch's
    ``ProcessFailure`` by global rank; reaped here, before torch's poll would see them and stop
    the others."""
    failures = {}
    for worker in workers:
        proc = torch_compat.worker_process(context, worker.local_rank)
        exitcode = proc.poll()
        if exitcode not in (None, 0):
            failures[worker.global_rank] = torch_compat.ProcessFailure(
                local_rank=worker.local_rank, pid=proc.pid, exitcode=exitcode,
                error_file=context.error_files.get(worker.local_rank, ""))
    return failures


def ending_exits(context: Any, workers: Sequence[Any]) -> dict[int, Any]:
    """Workers that are dying with a failing status, as torch's ``ProcessFailure`` by global
    rank, before they are reaped.

    torch learns of a death from ``waitpid``, which answers only once the kernel has torn down
    the worker's mappings: most of a second for a worker with its checkpoint slots mapped (see
    :func:`elasticft.procs.ending_status`). The failure is the same one torch reports a moment
    later; stopping the group then waits for the teardown to finish.
    """
    if context is None:
        return {}
    by_local = {w.local_rank: w for w in workers}
    failures = {}
    for local_rank, pid in context.pids().items():
        status = procs.ending_status(pid)
        if not status or local_rank not in by_local:
            continue
        try:
            exitcode = os.waitstatus_to_exitcode(status)
        except ValueError:
            continue
        if exitcode != 0:
            failures[by_local[local_rank].global_rank] = torch_compat.ProcessFailure(
                local_rank=local_rank, pid=pid, exitcode=exitcode,
                error_file=context.error_files.get(local_rank, ""))
    return failures


def notify_before_survivors_stopped(context: Any, hook: Callable[[tuple[int, ...]], Any]
                                    ) -> bool:
    """Makes ``context`` call ``hook(failed_local_ranks)`` before it stops the other workers.

    torch's ``SubprocessContext._poll`` terminates every other worker in the same poll that
    finds a failed one, before any agent hook runs; this wraps that poll (once per context, at
    the first failure). Returns False for a context that is not a ``SubprocessContext`` (or one
    without the parts the hook needs: :func:`torch_compat.can_hook_survivor_stop`).
    """
    if not torch_compat.can_hook_survivor_stop(context):
        return False
    announced = False

    def hooked(poll: Callable[[], Any]) -> Callable[[], Any]:
        def poll_after_hook() -> Any:
            nonlocal announced
            if not announced:
                failed = tuple(sorted(
                    rank for rank in torch_compat.running_local_ranks(context)
                    if torch_compat.worker_exit_code(context, rank) not in (None, 0)
                ))
                if failed:
                    announced = True
                    hook(failed)
            return poll()

        return poll_after_hook

    torch_compat.wrap_poll(context, hooked)
    return True


def start_replacements(context: Any, local_ranks: Sequence[int], pool: WarmPool | None,
                       env_of: Callable[[Mapping[str, str]], dict[str, str]]) -> dict[int, int]:
    """Starts a new process for each of ``local_ranks`` in torch's process ``context``, from the
    warm pool when there is one (which then prepares the next warm interpreter), with
    ``env_of(the old worker's environment)``; returns their pids by local rank."""
    def make(**kwargs: Any) -> Any:
        if pool is not None and isinstance(context, WarmSubprocessContext):
            return WarmSubprocessHandler(pool, **kwargs)
        return torch_compat.SubprocessHandler(**kwargs)

    started = {}
    for local_rank in local_ranks:
        handler = torch_compat.replace_worker(context, local_rank,
                                              env_of(context.envs[local_rank]), make)
        launch = getattr(handler, "launch", None)
        if pool is not None and launch is not None:
            pool.refill(local_rank, *launch)
        started[local_rank] = handler.proc.pid
    return started


def replace_after_kill(procs: Sequence[Any], timeout_s: float, reap_first: bool,
                       replace: Callable[[], _R],
                       reaped: Callable[[float], None] | None = None) -> _R:
    """Kills ``procs``, then runs ``replace``: after reaping them when ``reap_first``, else at
    once, while a thread reaps them.

    A node with GPUs reaps first: the device memory a dead process held is released only when
    its teardown ends, and a replacement that allocated before then could run out of it. On a
    CPU node the teardown (most of a second with gigabytes of checkpoint slots mapped) frees
    only host memory, and the replacement or the spare need not wait for it. ``reaped`` is
    called with the wall clock once they are gone.
    """
    def reap_all() -> None:
        reap(procs, timeout_s)
        if reaped is not None:
            reaped(time.time())

    kill(procs)
    if reap_first:
        reap_all()
        return replace()
    try:
        return replace()
    finally:
        if procs:
            threading.Thread(target=reap_all, name="elasticft-reap", daemon=True).start()


@dataclasses.dataclass(frozen=True)
class ContextWorkers:
    """The agent's workers in torch's process context, as in-process recovery changes them
    (its :class:`~elasticft.inprocess.ports.WorkerOps`)."""

    context: Callable[[], Any]
    """torch's process context of the workers, now."""
    worker_group: Callable[[], Any]
    """torch's ``WorkerGroup``, now."""
    warm_pool: Callable[[], WarmPool | None]
    """The agent's warm interpreters, now (None: cold starts)."""

    def start_replacements(self, local_ranks: Sequence[int],
                           env_of: Callable[[Mapping[str, str]], dict[str, str]]
                           ) -> dict[int, int]:
        return start_replacements(self.context(), local_ranks, self.warm_pool(), env_of)

    def hand_over(self, local_rank: int, env: Mapping[str, str], spare: Any) -> int:
        # In torch's context first: from there on a restart ends it like any worker.
        torch_compat.replace_worker(self.context(), local_rank, dict(env), lambda **_: spare)
        return spare.proc.pid

    def record_pids(self, pids: Mapping[int, int | None]) -> None:
        workers = self.worker_group().workers
        for local_rank, pid in pids.items():  # torch's monitor compares ids and pids
            workers[local_rank].id = pid

    def kill(self, local_ranks: Sequence[int]) -> None:
        kill(self._processes(local_ranks))

    def kill_then(self, local_ranks: Sequence[int], timeout_s: float, reap_first: bool,
                  then: Callable[[], _R], reaped: Callable[[float], None] | None = None) -> _R:
        return replace_after_kill(self._processes(local_ranks), timeout_s, reap_first, then,
                                  reaped)

    def warm_spare(self) -> bool | None:
        pool = self.warm_pool()
        warm = pool.interpreters().get(SPARE_LOCAL_RANK) if pool is not None else None
        return None if warm is None else warm.ready(0)

    def start_spare(self, env: dict[str, str], outputs: Mapping[str, str], *, warm: bool
                    ) -> Any:
        context, pool = self.context(), self.warm_pool() if warm else None
        handler = WarmSubprocessHandler(pool, **torch_compat.subprocess_handler_kwargs(
            entrypoint=context.entrypoint, args=context.args[SPARE_LOCAL_RANK], env=env,
            stdout=outputs.get("stdout"), stderr=outputs.get("stderr"),
            local_rank_id=SPARE_LOCAL_RANK, numa_options=None))
        if pool is not None and handler.launch is not None:
            pool.refill(SPARE_LOCAL_RANK, *handler.launch)
        return handler

    def _processes(self, local_ranks: Sequence[int]) -> list[Any]:
        context = self.context()
        return [torch_compat.worker_process(context, lr) for lr in local_ranks]
