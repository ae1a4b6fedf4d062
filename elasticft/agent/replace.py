"""Replacing workers of torch's process context one by one, while the others keep running.

In-process recovery replaces only the failed workers: it finds the ones that exited before
torch's own poll would stop the others (:func:`failed_exits`), kills and reaps what is left of
them (:func:`replace_after_kill`, with :func:`elasticft.procs.kill` and
:func:`~elasticft.procs.reap`: on a node with GPUs after they are gone, since a dead
process's device memory is released only at its end), and starts their replacements in the same
context, from the warm pool when there is one (:func:`start_replacements`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from elasticft import torch_compat
from elasticft.agent.warmpool import WarmPool, WarmSubprocessContext, WarmSubprocessHandler
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
