"""Interrupting a survivor: the agent knows of a failure, the worker's main thread leaves the
call it is blocked in.

A survivor whose peer died may sit in a collective that never returns by itself: on NCCL a
kernel waits for the dead peer; on gloo a receive waits on a connection that stays open when
the peer's sockets outlive it. The agent usually knows first (a worker's exit, a hang verdict,
a lost node, a worker's own communication error): when it decides to recover in process it
writes an **interrupt notice** (``interrupt.json``: the generation that ended) in the node's
in-process directory, and later the next generation (``generation.json``).

Each armed worker runs a :class:`Monitor`, a thread that watches both files. When either says
the worker's generation is over while the main thread still runs the training function, the
monitor

1. ends every process group of the process (``end``: NCCL's abort, gloo's pending work ended
   through the survivor's own connections, :func:`elasticft.inprocess.groups.end_groups`), so a
   collective the main thread waits in raises;
2. if the main thread has not entered the recovery within ``grace_s`` (it runs Python code, or
   waits in something else), raises :class:`PeerInterrupted` into it as an asynchronous
   exception, again every ``grace_s`` until it does.

**Where the interrupt may land.** The main thread tells the monitor when it enters the training
function (:meth:`Monitor.entering`) and when it has left it (:meth:`Monitor.left`), both under
the monitor's lock; the monitor ends the groups and raises only between the two, and
:meth:`Monitor.left` withdraws a pending asynchronous exception. An exception the monitor
raised just before the main thread said it left can still be delivered on the way out (Python
delivers one at its next check, which may be the call of :meth:`Monitor.left` itself): the
caller absorbs it there
(:meth:`elasticft.inprocess.worker.InProcess.run`), and the monitor raises again only after
``grace_s``.

**At a step boundary.** When no peer failed (nodes join the job, a growth in process), the
notice says ``at_step``: the monitor then ends nothing at first, and the main thread stops at
its next step boundary, where it runs Python and waits in no collective
(:meth:`Monitor.stop_due`, asked by :class:`elasticft.inprocess.worker.InProcess` after each
optimizer step). A peer that went on into the next step waits in a collective with it until
its teardown closes their connections, which that peer's collective reports as a failed peer.
Only a main thread that reaches no step boundary within ``step_wait_s`` is interrupted as
above. An end of the groups while every rank trains would race the main thread: one that
issues its next collective on a group just ended may wait in it for good, out of reach of the
asynchronous exception.

**The end is over before the recovery starts.** The monitor ends the groups while the main thread
may already be leaving (its collective raised by itself, or by the first connection the monitor
shut down). :meth:`Monitor.left` waits until an end under way is over: the survivor's teardown and
regroup never run beside it. Beside them the end would abort the next generation's group (it
aborts whatever torch's table holds at that moment) and race the teardown over the old ones. (A
socket whose descriptor number the regroup reused is safe either way: the end checks each
recorded socket's inode before it shuts it down.)

**No step committed after the end.** A collective the end interrupts need not raise: an aborted
NCCL kernel returns, and the buffer it leaves holds a partial sum. The main thread can then go on
to its optimizer step and its save before the asynchronous exception lands. So the monitor marks
the generation over (:meth:`Monitor.generation_over`) *before* it ends the groups, and the
survivor asks the mark where a step becomes state (:func:`commit_refusal`): before every optimizer
step, at :meth:`~elasticft.inprocess.worker.InProcess.step_done`, when a checkpoint's save
starts and when its snapshot would be sealed complete (the monitor is the checkpointer's commit
gate, :class:`elasticft.ckpt.api.CommitGate`). A step whose collective returned after the mark is
refused everywhere: its optimizer step does not run (:class:`PeerInterrupted`), and a snapshot
taken in the generation and sealed after the mark stays incomplete, so no tier (memory, disk,
peer, replicas, fingerprints: all read only complete snapshots) ever holds it.

**Outside ``except Exception:``.** :class:`PeerInterrupted` is a ``BaseException``: a script's
``except Exception:`` retry loop does not swallow it. A section that must not be interrupted in
its middle runs under :meth:`Monitor.protected` (``InProcess.atomic()``): the asynchronous
exception waits until the section's end, then is raised at once. The groups are still ended in
the section, so a collective there raises: a protected section must not wait on a peer.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from elasticft.inprocess.protocol import (
    GENERATION_FILE,
    INTERRUPT_FILE,
    STEP_WAIT_S,
    Generation,
    InterruptNotice,
    Read,
)

logger = logging.getLogger(__name__)


class PeerInterrupted(BaseException):
    """The agent reported a failed peer: this survivor's generation is over and it regroups.

    A ``BaseException``, as ``KeyboardInterrupt`` is: a script's ``except Exception:`` around
    its step does not swallow it, and the recovery it asks for still happens."""


def commit_refusal(taken_in: int, ended: int) -> str | None:
    """Why a step (or snapshot) taken in generation ``taken_in`` may not be committed when
    ``ended`` is the newest generation marked over (-1: none), or None when it may (pure).

    Marked over means its groups' end has begun: a collective of that generation may have
    returned a wrong result without raising, so nothing it computed counts any more."""
    if ended >= taken_in:
        return f"generation {taken_in} ended (its process groups were ended)"
    return None


def notice(directory: Path, read: Read) -> int:
    """The newest generation the agent's files say is over (-1: none)."""
    interrupt = InterruptNotice.read(directory, read)
    published = Generation.read(directory, read)
    return max(interrupt.ended if interrupt is not None else -1,
               published.generation - 1 if published is not None else -1)


def soft(directory: Path, read: Read) -> int:
    """The newest generation the interrupt notice ends at a step boundary (-1: none)."""
    interrupt = InterruptNotice.read(directory, read)
    return interrupt.ended if interrupt is not None and interrupt.at_step else -1


def _raise_in(thread_id: int, error: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(error) if error is not None else None)


class _TakenBack(BaseException):
    """Raised by the main thread into itself, in place of an interrupt it takes back."""


def _take_back(thread_id: int) -> None:
    """Takes back an asynchronous exception sent to thread ``thread_id`` and not delivered yet.

    ``PyThreadState_SetAsyncExc(id, NULL)`` takes it back but leaves CPython 3.11's eval
    breaker signalled for good (only a delivered exception clears the flag): under a profiler or
    a tracer (cProfile, coverage) the thread's next call then loops at its first instruction
    forever. An exception of its own, delivered here and caught, replaces the pending one and
    clears the flag. From another thread only ``NULL`` can be sent.
    """
    if thread_id != threading.get_ident():
        _raise_in(thread_id, None)
        return
    try:
        _raise_in(threading.get_ident(), _TakenBack)
        for _ in range(1_000_000):  # delivered at the loop's first backward jump
            pass
    except _TakenBack:
        pass


class Monitor:
    """The thread that interrupts this worker's main thread when its generation ends."""

    def __init__(self, directory: Path, read: Read,
                 end: Callable[[], str], poll_s: float = 0.005, grace_s: float = 0.5,
                 step_wait_s: float = STEP_WAIT_S) -> None:
        self.directory = directory
        self._read = read
        self._end = end
        self._poll_s = poll_s
        self._grace_s = grace_s
        self._step_wait_s = step_wait_s
        self._stop_by = 0.0
        """While ``stopping``: the monotonic time after which the groups are ended anyway."""
        self._soft = -1
        self._lock = threading.Lock()
        self._main = threading.main_thread().ident or threading.get_ident()
        self._generation = 0
        self._state = "outside"  # outside | running | stopping | interrupting
        """``running``: the main thread is in the training function; ``stopping``: and its
        generation ends at its next step boundary; ``interrupting``: and this monitor ended its
        generation; ``outside``: anywhere else (nothing is raised there)."""
        self._quiet = threading.Event()
        """Set while no end of the groups is under way (cleared under the lock with the state)."""
        self._quiet.set()
        self._stop = threading.Event()
        self.interrupted_at: float | None = None
        """Wall clock when this monitor ended the groups of the current generation."""
        self.how = ""
        self._thread: threading.Thread | None = None
        self._stamp: list[tuple[int, int, int] | None] = []
        self._last = -1
        self._over = -1
        """The newest generation marked over (:meth:`generation_over`): set before its groups'
        end begins, never lowered."""
        self._protected = 0
        """How deep the main thread is in protected sections (:meth:`protected`)."""

    def start(self) -> None:
        """Starts the thread; it interrupts nothing before :meth:`entering`."""
        self._main = threading.get_ident()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="elasticft-interrupt",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._state = "outside"
            _take_back(self._main)
        self._stop.set()

    @property
    def interrupted(self) -> bool:
        return self.interrupted_at is not None

    @property
    def inside(self) -> bool:
        """Whether the main thread is still in the training function (it has not said it left)."""
        return self._state != "outside"

    def entering(self, generation: int) -> None:
        """The main thread (re-)enters the training function, in ``generation``: from here the
        monitor interrupts it when that generation ends."""
        with self._lock:
            self._generation, self._state = generation, "running"
            self.interrupted_at = None
            self.how = ""

    def stop_due(self) -> bool:
        """Whether the main thread, at a step boundary, is to leave the training function
        now (its generation ends there: :class:`PeerInterrupted`)."""
        with self._lock:
            return self._state == "stopping"

    def generation_over(self, generation: int) -> None:
        """Marks ``generation`` over: from here nothing it computes is committed
        (:meth:`refusal`). The monitor marks it before it ends the groups; the main thread
        before its own teardown ends them."""
        with self._lock:
            self._over = max(self._over, generation)

    def current(self) -> int:
        """The generation the main thread trains in (a save taken now belongs to it)."""
        with self._lock:
            return self._generation

    def refusal(self, taken_in: int) -> PeerInterrupted | None:
        """The error that refuses a step or snapshot taken in ``taken_in``, or None when it may
        be committed (:func:`commit_refusal`; the checkpointer's commit gate)."""
        with self._lock:
            why = commit_refusal(taken_in, self._over)
        return PeerInterrupted(f"not committed: {why}") if why is not None else None

    @contextlib.contextmanager
    def protected(self) -> Iterator[None]:
        """A section of the main thread that the asynchronous :class:`PeerInterrupted` does not
        interrupt: one due in it is raised as the section ends. The groups are ended all the
        same (a collective in the section raises), and the commit gate still refuses. Only the
        main thread's sections count: the monitor raises into no other thread."""
        if threading.get_ident() != self._main:
            yield
            return
        with self._lock:
            self._protected += 1
            if self._protected == 1 and self._state == "interrupting":
                _take_back(self._main)  # one sent just before: raised at the end instead
        try:
            yield
        finally:
            with self._lock:
                self._protected -= 1
                due = self._protected == 0 and self._state == "interrupting"
            if due:
                raise PeerInterrupted(f"generation {self._generation} ended by the agent "
                                      "(raised at the end of a protected section)")

    def left(self, limit_s: float | None = None,
             before_wait: Callable[[], object] = lambda: None) -> bool:
        """The main thread has left the training function: no asynchronous exception lands
        after this, ``before_wait()`` runs (what the end may be waiting for: CUDA graphs that
        captured a communicator, :mod:`elasticft.inprocess.cuda_graphs`), and an end of the
        groups under way is waited for (at most ``limit_s``); returns whether it is over."""
        with self._lock:
            self._state = "outside"
            _take_back(self._main)
        before_wait()
        return self._quiet.wait(limit_s)

    def _ended(self) -> int:
        """:func:`notice`, read again only when one of the two files changed (a stat per poll)."""
        stamp = []
        for name in (INTERRUPT_FILE, GENERATION_FILE):
            try:
                st = os.stat(self.directory / name)
                stamp.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                stamp.append(None)
        if stamp != self._stamp:
            self._stamp, self._last = stamp, notice(self.directory, self._read)
            self._soft = soft(self.directory, self._read)
        return self._last

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            ended = self._ended()
            with self._lock:
                if self._state == "running" and ended >= self._generation \
                        and self._soft >= self._generation:
                    self._state = "stopping"  # at the next step boundary
                    self._stop_by = time.monotonic() + self._step_wait_s
                due = ended >= self._generation and (
                    self._state == "running"
                    or (self._state == "stopping" and time.monotonic() > self._stop_by))
                if due:
                    self._state = "interrupting"
                    self._over = max(self._over, self._generation)  # before the end begins
                    self._quiet.clear()
            if due:
                self._interrupt()

    def _interrupt(self) -> None:
        started = time.time()
        how = "end failed"
        try:
            how = self._end()
        except Exception as e:  # the asynchronous exception below still frees the main thread
            how = f"end failed: {type(e).__name__}: {e}"
        finally:  # whatever happened, the main thread's recovery may go on
            with self._lock:
                self.interrupted_at, self.how = started, how
                self._quiet.set()
        logger.warning("generation %d ended by the agent: process groups ended (%s) in %.3f s",
                       self._generation, self.how, time.time() - started)
        while not self._stop.wait(self._grace_s):
            with self._lock:
                if self._state != "interrupting":
                    return
                if not self._protected:
                    _raise_in(self._main, PeerInterrupted)
