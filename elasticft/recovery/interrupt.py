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

The main thread takes the monitor's lock when it enters and leaves a recovery
(:meth:`Monitor.recovering`, :meth:`Monitor.resumed`), and withdraws a pending asynchronous
exception there, so the exception can only land in the training function.
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


def _raise_in(thread_id: int, error: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(error) if error is not None else None)


class Monitor:
    """The thread that interrupts this worker's main thread when its generation ends."""

    def __init__(self, directory: Path, read: Callable[[Path], dict | None],
                 end: Callable[[], str], poll_s: float = 0.005, grace_s: float = 0.5) -> None:
        self.directory = directory
        self._read = read
        self._end = end
        self._poll_s = poll_s
        self._grace_s = grace_s
        self._lock = threading.Lock()
        self._main = threading.main_thread().ident or threading.get_ident()
        self._generation = 0
        self._state = "idle"  # idle | running | interrupting | recovering
        self._stop = threading.Event()
        self.interrupted_at: float | None = None
        """Wall clock when this monitor ended the groups of the current generation."""
        self.how = ""
        self._thread: threading.Thread | None = None
        self._stamp: list[tuple[int, int, int] | None] = []
        self._last = -1

    def start(self, generation: int) -> None:
        self._main = threading.get_ident()
        with self._lock:
            self._generation, self._state = generation, "running"
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="elasticft-interrupt",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._state = "idle"
            _raise_in(self._main, None)
        self._stop.set()

    @property
    def interrupted(self) -> bool:
        return self.interrupted_at is not None

    def recovering(self) -> None:
        """The main thread enters a recovery: no asynchronous exception lands after this."""
        with self._lock:
            self._state = "recovering"
            _raise_in(self._main, None)

    def resumed(self, generation: int) -> None:
        """The main thread runs the training function again, in ``generation``."""
        with self._lock:
            self._generation, self._state = generation, "running"
            self.interrupted_at = None
            self.how = ""

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
        return self._last

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            ended = self._ended()
            with self._lock:
                due = self._state == "running" and ended >= self._generation
                if due:
                    self._state = "interrupting"
            if due:
                self._interrupt()

    def _interrupt(self) -> None:
        started = time.time()
        try:
            how = self._end()
        except Exception as e:  # the asynchronous exception below still frees the main thread
            how = f"end failed: {type(e).__name__}: {e}"
        with self._lock:
            self.interrupted_at, self.how = started, how
        logger.warning("generation %d ended by the agent: process groups ended (%s) in %.3f s",
                       self._generation, how, time.time() - started)
        while not self._stop.wait(self._grace_s):
            with self._lock:
                if self._state != "interrupting":
                    return
                _raise_in(self._main, PeerInterrupted)
