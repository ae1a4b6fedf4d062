"""The failure flush: when a worker fails, the newest snapshot every local worker completed
goes to disk, without delaying the decision or the restore.

* **Off the decision's path.** The flush runs on a thread of its own: the agent's
  ``on_failure`` returns at once, so the policy decides without waiting for gigabytes to be
  copied or written. The slots survive the crash, and the flush reads each under its shared
  lock (see :mod:`elasticft.ckpt.persisting.agentpersist`).
* **First, when the node may not come back.** Any decision but a restart (evict, stop) lets
  the write start at once and waits for it, so a node that does not come back still left the
  snapshot on disk.
* **After the restore, when the workers restart.** A restart resumes from memory, and the
  flush waits until the restarted workers have restored and finished their first optimizer
  step (they say so through the control directory), have saved a newer step, or
  :data:`FLUSH_DEFER_MAX_S` passed: a write of gigabytes beside the restore of the same
  gigabytes, or beside the first step, slows either several times on a host of few cores
  (docs/benchmarks.md). It never holds a slot the restarted workers need: it reads a slot in
  place only where the workers keep a third one to write.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from elasticft.addon.api import GroupInfo
from elasticft.ckpt.control import all_loaded, clear_loaded
from elasticft.ckpt.persisting import diskfile
from elasticft.ckpt.persisting.agentpersist import AgentPersister

logger = logging.getLogger(__name__)

FLUSH_DEFER_MAX_S = 30.0
"""The longest a restart in place defers its flush while the restarted workers restore (a
script that never calls ``restore`` nor saves again leaves no other sign)."""


class FailureFlush:
    """The flush of one node's newest complete snapshot after a failure."""

    def __init__(self, persister: AgentPersister) -> None:
        self._persister = persister
        self._thread: threading.Thread | None = None
        self._go = threading.Event()
        """Set when the flush may write: at the decision, or once a restart in place has
        restored (see :meth:`release`)."""
        self._go.set()
        self._step: int | None = None
        self._deferred_since: float | None = None

    def start(self, step: int, group: GroupInfo) -> None:
        """Readies the flush of ``step`` on its thread; it writes once :meth:`release`\\ d."""
        started = time.monotonic()
        previous = self._thread
        self._step = step
        self._go.clear()  # until the decision says whether the restore comes first
        persister = self._persister

        def flush() -> None:
            if previous is not None:
                previous.join()  # an earlier failure's flush; persists are serial anyway
            self._go.wait()
            diskfile.background_priority()
            step = self._step  # a newer one when the decision took a just-in-time checkpoint
            assert step is not None
            if persister.persist(step, group, cause="flush"):
                logger.info("flushed the step %d snapshot to disk (%.2f s after the failure)",
                            persister.persisted, time.monotonic() - started)

        self._thread = threading.Thread(target=flush, name="elasticft-ckpt-flush", daemon=True)
        self._thread.start()

    def newer(self, step: int) -> None:
        """A newer complete step appeared while the flush waits for the decision (the
        just-in-time checkpoint it chose): the flush writes that one instead."""
        if self.waiting() and self._step is not None and step > self._step:
            self._step = step

    def waiting(self) -> bool:
        """Whether a flush waits for the decision."""
        return self._thread is not None and not self._go.is_set()

    def defer(self, control_dir: Path, local_ranks: Iterable[int]) -> None:
        """The workers restart in place: the flush waits for their restore and first step."""
        clear_loaded(control_dir, local_ranks)
        self._deferred_since = time.monotonic()
        logger.info("the flush of step %s waits for the restarted workers' restore and "
                    "first step (at most %.0f s)", self._step, FLUSH_DEFER_MAX_S)

    def release_when_resumed(self, control_dir: Path, local_ranks: Iterable[int],
                             newest_step: Callable[[], int | None]) -> None:
        """Lets a deferred flush start once the restarted workers are past their restore and
        their first step (``newest_step()``: the newest step they all hold)."""
        since = self._deferred_since
        if since is None:
            return
        if all_loaded(control_dir, local_ranks):
            self.release("the restarted workers took their first step")
            return
        newest = newest_step()
        if newest is not None and self._step is not None and newest > self._step:
            self.release(f"the restarted workers saved step {newest}")
        elif time.monotonic() - since >= FLUSH_DEFER_MAX_S:
            self.release(f"no first step seen in {FLUSH_DEFER_MAX_S:.0f} s")

    def release(self, why: str) -> None:
        if self._deferred_since is not None:
            logger.info("the flush of step %s starts: %s (%.2f s after the decision)",
                        self._step, why, time.monotonic() - self._deferred_since)
            self._deferred_since = None
        self._go.set()

    def wait(self) -> None:
        """Lets the flush write now, and waits until it has."""
        self.release("the run goes on elsewhere or ends")
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
