"""One slot file, mapped: how it is made and grown, locked, and its header and payload read.

A slot holds at most one rank's snapshot (its layout is :mod:`elasticft.ckpt.memory.slotformat`).
The slots of one local rank, and which of them a writer or a reader takes, are
:class:`elasticft.ckpt.memory.shm.SlotSet`; slots are made off the training thread by
:mod:`elasticft.ckpt.memory.slotmaker`. Both use this module, which uses neither.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from elasticft import unnamed
from elasticft.ckpt.api import SnapshotCorrupt, SnapshotMissing, StorageFull
from elasticft.ckpt.memory.slotformat import HEADER_BYTES, PACKED_HEADER_BYTES, SlotHeader

logger = logging.getLogger(__name__)

_MADV_POPULATE_READ = 22
"""Linux >= 5.14; Python's mmap module does not name it."""


class Slot:
    """One slot file, mapped; locking and header access. Not thread-safe on its own."""

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self.path = path
        self._fd = fd
        self.size = size
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.before_close: list[Callable[[], None]] = []
        """Called before the mapping goes (e.g. to unpin memory registered with CUDA)."""

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open_existing(cls, path: Path) -> Slot | None:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            os.close(fd)
            return None
        return cls(path, fd, size)

    @classmethod
    def create_or_grow(cls, path: Path, size: int) -> Slot:
        """Opens (creating 0600 if needed) and makes the file at least ``size`` bytes, with
        every page allocated now rather than on first touch.

        A new file is allocated under a temporary name and renamed into place, so a reader
        never maps a slot whose pages are still being allocated; an existing one (the agent's
        unnamed slots always exist) grows in place, and its snapshot, if any, stays readable
        meanwhile: until its header is written, a grown slot reads as empty.
        """
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            if unnamed.is_unnamed(path):  # the agent that made it is gone
                raise SnapshotMissing(f"{path}: the agent holding this slot has exited") from None
            fd = -1
        if fd < 0:
            partial = path.with_name(f"{path.name}.new{os.getpid()}-{threading.get_ident()}")
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                cls._allocate(fd, path, size)
                os.rename(partial, path)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    partial.unlink()
                raise
            return cls(path, fd, os.fstat(fd).st_size)
        try:
            if os.fstat(fd).st_size < size:
                cls._allocate(fd, path, size)
            return cls(path, fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _allocate(fd: int, path: Path, size: int) -> None:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise StorageFull(
                    f"shared memory {path} cannot grow to {size} bytes ({e.strerror}); "
                    "free /dev/shm or lower the memory tier's slots/cap"
                ) from None
            raise

    def close(self) -> None:
        callbacks, self.before_close = self.before_close, []
        for callback in callbacks:
            callback()
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    # -- locking ---------------------------------------------------------------------------

    def try_lock(self, exclusive: bool) -> bool:
        op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        try:
            fcntl.flock(self._fd, op)
            return True
        except BlockingIOError:
            return False

    def lock_shared(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.try_lock(exclusive=False):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def shared(self, timeout_s: float = 10.0) -> Iterator[bool]:
        locked = self.lock_shared(timeout_s)
        try:
            yield locked
        finally:
            if locked:
                self.unlock()

    # -- header ----------------------------------------------------------------------------

    def header(self) -> SlotHeader | None:
        return SlotHeader.parse(self.map[:PACKED_HEADER_BYTES])

    def write_header(self, header: SlotHeader) -> None:
        self.map[:PACKED_HEADER_BYTES] = header.pack()

    def manifest(self, header: SlotHeader) -> dict[str, Any]:
        raw = self.map[HEADER_BYTES : HEADER_BYTES + header.manifest_len]
        try:
            return json.loads(raw)
        except ValueError as e:
            raise SnapshotCorrupt(f"{self.path}: unreadable manifest ({e})") from None

    def payload(self, header: SlotHeader) -> memoryview:
        end = header.payload_offset + header.payload_len
        if end > self.size:
            raise SnapshotCorrupt(f"{self.path}: payload ends past the segment ({end})")
        return memoryview(self.map)[header.payload_offset : end]

    def prefault(self, header: SlotHeader) -> None:
        """Maps the payload's pages now, in one call, instead of one page fault per 4 KiB.

        A restarted worker maps the segment afresh; faulting hundreds of MB in page by page
        costs about a third of copying them (measured: 300 MB, 55-70 ms fresh vs 37-46 ms
        already mapped). Pages already mapped cost nothing. Best effort: older kernels lack
        MADV_POPULATE_READ.
        """
        start = header.payload_offset // mmap.PAGESIZE * mmap.PAGESIZE
        length = min(self.size, header.payload_offset + header.payload_len) - start
        if length <= 0:
            return
        try:
            self.map.madvise(_MADV_POPULATE_READ, start, length)
        except (OSError, ValueError):
            logger.debug("MADV_POPULATE_READ unavailable; pages fault in on first touch")
