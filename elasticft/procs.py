"""What an agent can tell about a process from its pid alone (Linux).

The agent judges its workers and the owners of leftover files by pid: a one-letter state from
``/proc/<pid>/stat`` (R running, S sleeping, T stopped, Z zombie...) and whether any process
still has the pid at all. The sets of states below are the one meaning of a state letter that
the agent, the hang verdict (:mod:`elasticft.diag.verdict`) and the diagnostics exchange share.

Ending processes the agent started (``subprocess.Popen`` objects, a worker or a spare):
:func:`kill` (SIGKILL, and SIGCONT for a stopped one), :func:`reap` (wait for them, with one
deadline for all) and the two in order (:func:`kill_and_reap`). Adopting a process another
one forked (:func:`adopting_orphans`, Linux's child subreaper) and watching it as a child
(:class:`AdoptedWorker`): how a worker forked by a warm interpreter becomes the agent's own.

A command-line process that has imported torch leaves its objects to the operating system at
exit (:func:`skip_final_collection`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import os
import select
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from subprocess import Popen
from typing import Any

STOPPED_STATES = frozenset({"T", "t"})
"""Stopped by a signal (SIGSTOP) or held by a tracer: still holding its sockets and memory."""
EXITED_STATES = frozenset({"Z", "X"})
"""Exited: a zombie not yet reaped, or dead."""
UNRESPONSIVE_STATES = STOPPED_STATES | EXITED_STATES
"""States in which a process cannot answer."""
UNINTERRUPTIBLE_STATE = "D"
"""Waiting in the kernel (disk I/O, a driver): a hang only when it also uses no CPU."""
_PF_EXITING = 0x4
"""The kernel's per-task flag set as a task begins to exit (``include/linux/sched.h``)."""


def skip_final_collection() -> None:
    """At this process's exit, Python's last garbage collections skip every object that exists
    by then (:func:`gc.freeze` from an ``atexit`` hook, which runs first). Those collections walk
    the million objects ``import torch`` makes, a second of CPU per process, to free memory the
    operating system frees anyway. For the console entry points only: an in-process caller (a
    test) goes on running and must keep collecting."""
    atexit.register(gc.freeze)


@contextlib.contextmanager
def no_collection_while_importing() -> Iterator[None]:
    """Python's cyclic collector off for a block of heavy imports, and back as it was after.
    ``import torch`` makes about a million objects and no garbage; the collections their
    allocations set off are a seventh of its CPU, paid again by every agent."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` from the state on. The command name before it may hold spaces and
    parentheses, so the fields start after the last ')'."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def state(pid: int | None) -> str | None:
    """The process's state letter, or None when there is no such process (or no pid)."""
    if not pid:
        return None
    try:
        return _stat_fields(pid)[0]
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int | None) -> float | None:
    """User plus system CPU time of every thread of the process, or None when it is gone."""
    if not pid:
        return None
    try:
        fields = _stat_fields(pid)
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def started_at(pid: int) -> float:
    """When the process started, on the ``time.time()`` clock, to the clock tick.

    The kernel counts a process's start in ticks since boot; psutil adds the boot time, which
    ``/proc/stat`` gives in whole seconds, so its ``create_time`` can be up to 1 s early (0.7 s
    was seen here, which a report counts as wall time the run never had). The time since boot
    is read from the clock the kernel counts it on instead.
    """
    ticks = int(_stat_fields(pid)[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def exists(pid: int | None) -> bool:
    """The process has not exited (it may be stopped, still holding its sockets and memory)."""
    current = state(pid)
    return current is not None and current not in EXITED_STATES


def responsive(pid: int | None) -> bool:
    """The process exists and is neither stopped nor exited."""
    current = state(pid)
    return current is not None and current not in UNRESPONSIVE_STATES


def gone(pid: int) -> bool:
    """No process has this pid any more. A pid taken by another user's process is not gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def exit_status(pid: int) -> int | None:
    """The wait status of an exited child not yet reaped (a zombie); None while it runs.

    A caller that cannot reap (the agent reaps its workers only in its monitor loop) still
    learns how a worker ended: the kernel holds a zombie's status. A pid already reaped gives 0:
    it exited, and its status is no longer known.
    """
    try:
        fields = _stat_fields(pid)
    except (OSError, IndexError):
        return 0
    if fields[0] != "Z":
        return None
    try:
        return int(fields[-1])
    except (ValueError, IndexError):
        return 0


def ending_status(pid: int) -> int | None:
    """The wait status of a process that has begun to exit, or None while it runs (or when
    there is no such process).

    A process killed with gigabytes of shared memory mapped stays in the kernel's teardown of
    its address space for most of a second before it becomes the zombie ``waitpid`` reports
    (measured here: 0.74 s with 9.6 GB of populated /dev/shm mapped, 0.02 s with 3 GB of
    private memory). The kernel flags the task as exiting and records its exit code at the
    start of that teardown, in the same ``stat`` fields :func:`exit_status` reads.
    """
    try:
        fields = _stat_fields(pid)
        exiting = bool(int(fields[6]) & _PF_EXITING) or fields[0] in EXITED_STATES
        return int(fields[-1]) if exiting else None
    except (OSError, IndexError, ValueError):
        return None


class ExitWatch:
    """The agent's wait between two looks at its workers, cut short when one is killed.

    torch's agent sleeps its whole ``monitor_interval`` (0.1 s) between polls, so a crash is seen
    0.05 s late on average, and a recovery starts as late. :meth:`wait` returns as soon as a
    watched process killed by a signal (SIGKILL, SIGSEGV, the OOM killer) is gone (its pidfd
    turns readable) or has begun its exit (:func:`ending_status`, read every :data:`SLICE_S`: a
    process with gigabytes of shared memory mapped is in its teardown for most of a second
    before its pidfd says anything). A process that exits with a status does not cut the wait
    short: it may be the victim of another's failure (a peer's socket closed while the culprit
    still runs its exception's clean-up), and the poll at the interval's end sees both. Each
    process is looked at once: one that has exited stays so until it is reaped.
    """

    SLICE_S = 0.02

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._told: set[int] = set()

    def wait(self, pids: Iterable[int], timeout_s: float) -> set[int]:
        """Waits ``timeout_s``, or less; returns the pids killed by a signal meanwhile."""
        given = set(pids)
        self._told &= given  # a pid no longer given may come back as another process's
        watched = given - self._told
        self._track(watched)
        by_fd = {fd: pid for pid, fd in self._fds.items()}
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if by_fd:
                readable = select.select(list(by_fd), [], [], min(left, self.SLICE_S))[0]
            else:
                time.sleep(min(left, self.SLICE_S))
                readable = []
            statuses = {pid: ending_status(pid) for pid in watched}
            exiting = {by_fd[fd] for fd in readable} | {
                pid for pid, status in statuses.items() if status is not None}
            if exiting:
                self._told |= exiting
                watched -= exiting
                self._track(watched)
                by_fd = {fd: pid for pid, fd in self._fds.items()}
                killed = {pid for pid in exiting if os.WIFSIGNALED(statuses[pid] or 0)}
                if killed:
                    return killed
        return set()

    def _track(self, pids: set[int]) -> None:
        """pidfds of exactly ``pids`` (one that cannot be opened is watched through /proc)."""
        for pid in set(self._fds) - pids:
            os.close(self._fds.pop(pid))
        for pid in pids - set(self._fds):
            with contextlib.suppress(OSError):
                self._fds[pid] = os.pidfd_open(pid)

    def close(self) -> None:
        self._track(set())


def continue_stopped(pids: Sequence[int | None]) -> None:
    """SIGCONTs each of the processes that is stopped (SIGSTOP): one ignores a SIGTERM until
    it is continued, which would make its stop wait for the whole shutdown timeout."""
    for pid in pids:
        if pid and state(pid) in STOPPED_STATES:
            with contextlib.suppress(OSError):
                os.kill(pid, 18)


def kill(procs: Sequence[Any]) -> None:
    """SIGKILLs (and continues, if stopped) each ``Popen`` still running."""
    for proc in procs:
        if proc.poll() is None:
            for sig in (9, 18):  # SIGKILL, then SIGCONT for a stopped one
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, sig)


def reap(procs: Sequence[Any], timeout_s: float) -> None:
    """Waits for each ``Popen`` to end, ``timeout_s`` for all of them."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))


def kill_and_reap(procs: Sequence[Any], timeout_s: float) -> None:
    """SIGKILLs (and continues, if stopped) each ``Popen`` still running, then reaps it."""
    kill(procs)
    reap(procs, timeout_s)


_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_adoption_lock = threading.Lock()


@contextlib.contextmanager
def adopting_orphans() -> Any:
    """While inside, orphaned descendants of this process are re-parented to it (Linux's
    child-subreaper flag), so a worker forked by a warm interpreter becomes this agent's child.

    Held only around one fork: left on, the agent would also adopt (and have to reap) every
    process its workers leave behind.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    with _adoption_lock:
        already = ctypes.c_int(0)
        if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(already), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_GET_CHILD_SUBREAPER) failed")
        if not already.value and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
        try:
            yield
        finally:
            if not already.value:
                libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


class AdoptedWorker(Popen):
    """``Popen`` of a worker this process adopted rather than spawned: ``wait``, ``poll``,
    ``send_signal`` and the return code behave as for any child (``waitpid`` on its pid)."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        # Popen.__init__ would spawn a process; these are the attributes its methods read.
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None
        self.encoding = self.errors = None
        self.text_mode = False
        self.pipesize = -1
        self._waitpid_lock = threading.Lock()
        self._input = None
        self._communication_started = False
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = True
        self._child_created = True
