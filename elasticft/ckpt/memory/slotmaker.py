"""Slots made off the training thread: a first save never waits for the pages of its slot.

Allocating a slot's pages (``posix_fallocate``) takes about 0.2 s a GB; made on the training
thread, a worker's first save would pay it, and on CUDA the registration of the new slot
besides. :class:`SlotMaker` makes and grows slot files on a thread of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from elasticft.ckpt.api import StorageFull
from elasticft.ckpt.memory.slot import Slot

logger = logging.getLogger(__name__)


class SlotMaker:
    """Creates and grows slot files on a thread of its own.

    The checkpointer asks for its slots as soon as it knows their size (its first
    save) and picks them up once made; a save that finds none ready yet stages its copy and
    its copy thread waits here (:meth:`wait`). After a restart the slots already exist at
    their size and nothing is made.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._wanted: dict[Path, int] = {}
        self._made: dict[Path, Slot] = {}
        """Made and not yet taken by the writer's set."""
        self._latest: dict[Path, Slot] = {}
        """The last slot made per path, for :meth:`wait` (taken or not)."""
        self._failed: dict[Path, BaseException] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self.made_count = 0

    def request(self, path: Path, size: int) -> None:
        """Asks for ``path`` of at least ``size`` bytes (no-op if already asked)."""
        with self._cond:
            made = self._made.get(path)
            if self._closed or (made is not None and made.size >= size) \
                    or self._wanted.get(path, -1) >= size:
                return
            self._wanted[path] = size
            self._failed.pop(path, None)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="elasticft-ckpt-slots",
                                                daemon=True)
                self._thread.start()

    def pending(self, path: Path) -> bool:
        """``path`` is being made, or was made and not yet taken: a save that found no slot a
        moment ago may have raced with its making, and must not count as skipped."""
        with self._cond:
            return path in self._wanted or path in self._made

    def take(self, path: Path) -> Slot | None:
        """A slot made since the last call, handed over to the caller's set (or None)."""
        with self._cond:
            return self._made.pop(path, None)

    def wait(self, path: Path, size: int, timeout_s: float) -> Slot:
        """The slot at ``path`` once made with ``size`` bytes (for the copy thread); the maker
        keeps it for :meth:`take` as well."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                made = self._latest.get(path)
                if made is not None and made.size >= size:
                    return made
                if path in self._failed:
                    raise self._failed[path]
                left = deadline - time.monotonic()
                if left <= 0 or path not in self._wanted:
                    raise StorageFull(f"shared memory {path} was not made within {timeout_s} s")
                self._cond.wait(left)

    def close(self) -> None:
        """Stops making slots. The one being made is finished first: a thread cut off at exit
        would leave its file under a temporary name that nobody removes. What was made and
        not taken is closed."""
        with self._cond:
            self._closed = True
            self._wanted.clear()
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cond:
            made, self._made = list(self._made.values()), {}
            self._latest.clear()
        for slot in made:
            slot.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._wanted:
                    self._thread = None
                    return
                path, size = next(iter(self._wanted.items()))
            try:
                slot: Slot | None = Slot.create_or_grow(path, size)
                error: BaseException | None = None
            except BaseException as e:  # the saves that wait for it say so
                slot, error = None, e
                logger.error("making the checkpoint slot %s failed: %s", path, e)
            with self._cond:
                if self._wanted.get(path) == size:
                    del self._wanted[path]
                if slot is not None:
                    stale = self._made.pop(path, None)
                    if stale is not None:
                        stale.close()
                    self._made[path] = self._latest[path] = slot
                    self.made_count += 1
                elif error is not None:
                    self._failed[path] = error
                    self._wanted.pop(path, None)
                self._cond.notify_all()
