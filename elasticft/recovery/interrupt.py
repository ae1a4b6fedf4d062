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
   through the survivor's own connections, :func:`elasticft.recovery.groups.end_groups`), so a
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
(:meth:`elasticft.recovery.inprocess.InProcess.run`), and the monitor raises again only after
``grace_s``.

**At a step boundary.** When no peer failed (nodes join the job, a growth in process), the
notice says ``at_step``: the monitor then ends nothing at first, and the main thread stops at
its next step boundary, where it runs Python and waits in no collective
(:meth:`Monitor.stop_due`, asked by :class:`elasticft.recovery.inprocess.InProcess` after each
optimizer step). A peer that went on into the next step waits in a collective with it until
its teardown closes their connections, which that peer's collective reports as a failed peer.
Only a main thread that reaches no step boundary within ``step_wait_s`` is interrupted as
above. An end of the groups while every rank trains would race the main thread: one that
issues its next collective on a group just ended may wait in it for good, out of reach of the
asynchronous exception.

**The end is over before the recovery starts.** The monitor ends the groups while the main thread
may already be leaving (its collective raised by itself, or by the first connection the monitor
shut down). :meth:`Monitor.left` waits until an end under way is over: the survivor's teardown and
regroup never run beside it. Beside them the end would shut down connections of the next
generation (the teardown closes the old sockets and the regroup's new ones reuse their descriptor
numbers, which the end listed before it shut them down) and abort a group the teardown destroys.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

INTERRUPT_FILE = "interrupt.json"


class PeerInterrupted(RuntimeError):
    """The agent reported a failed peer: this survivor's generation is over and it regroups."""


def notice(directory: Path, read: Callable[[Path], dict | None]) -> int:
    """The newest generation the agent's files say is over (-1: none)."""
    ended = -1
    record = read(directory / INTERRUPT_FILE)
    if record is not None and isinstance(record.get("ended"), int):
        ended = record["ended"]
    published = read(directory / "generation.json")
    if published is not None and isinstance(published.get("generation"), int):
        ended = max(ended, published["generation"] - 1)
    return ended


def soft(directory: Path, read: Callable[[Path], dict | None]) -> int:
    """The newest generation the interrupt notice ends at a step boundary (-1: none)."""
    record = read(directory / INTERRUPT_FILE)
    if record is not None and record.get("at_step") and isinstance(record.get("ended"), int):
        return int(record["ended"])
    return -1


def _raise_in(thread_id: int, error: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(error) if error is not None else None)


class Monitor:
    """The thread that interrupts this worker's main thread when its generation ends."""

    def __init__(self, directory: Path, read: Callable[[Path], dict | None],
                 end: Callable[[], str], poll_s: float = 0.005, grace_s: float = 0.5,
                 step_wait_s: float = 10.0) -> None:
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
            _raise_in(self._main, None)
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

    def left(self, limit_s: float | None = None) -> bool:
        """The main thread has left the training function: no asynchronous exception lands
        after this, and an end of the groups under way is waited for (at most ``limit_s``);
        returns whether it is over."""
        with self._lock:
            self._state = "outside"
            _raise_in(self._main, None)
        return self._quiet.wait(limit_s)

    def _ended(self) -> int:
        """:func:`notice`, read again only when one of the two files changed (a stat per poll)."""
        stamp = []
        for name in (INTERRUPT_FILE, "generation.json"):
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
                _raise_in(self._main, PeerInterrupted)
